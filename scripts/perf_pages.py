"""The performance pages of the documentation site, made from docs/performance/data/<family>.json.

Each data file holds the current figures of one op family, transcribed from the GPU runs that last measured each
case (the history stays in git: docs/perf.md until it was replaced by these files). A file is

    {"family": "all_gather", "title": "all_gather", "summary": "...", "records": [record, ...]}

and a record is one table of one run:

    {"title": ..., "hardware": ..., "date": "YYYY-MM-DD", "commit": ..., "command": ...,
     "timing": how the value was taken, "unit": "µs" (default) or another, "better": "lower" (default) | "higher",
     "case": the case column's header, "references": [impls shown but not compared: bounds, parts of an op, ...],
     "rows": [{"case": ..., "impl": ..., "value": ..., "view": optional, "graph" / "eager" / "host"}, ...],
     "notes": [...], "plot": optional path under docs/}

An impl whose name starts with "weft" is weft's; every other impl not in "references" is a baseline. Each page
lists where weft loses: the rows of a table (case and view) where weft's best impl is slower than the best
baseline. The mkdocs hook (scripts/docs_hooks.py) calls `families` and `render_all` at build time;
`python scripts/perf_pages.py --out DIR` writes the same pages into DIR, `--check` only validates the data.
"""
from __future__ import annotations

import argparse
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(ROOT, "docs", "performance", "data")

# Page order in the nav; a family not named here follows, alphabetically.
ORDER = ["all_gather", "all_reduce", "overlapped_gemm", "gemm", "attention", "moe", "ulysses", "host_overhead",
         "groups", "decode"]
VIEWS = {"graph": "CUDA-graph replay", "eager": "eager, back-to-back calls", "host": "host time to issue one call"}
RECORD_FIELDS = ("title", "hardware", "date", "commit", "command", "rows")


def load(path: str) -> dict:
    """A family's data file, checked: a missing or malformed field raises ValueError naming the file and field."""
    with open(path) as f:
        data = json.load(f)
    name = os.path.basename(path)
    for key in ("family", "title", "records"):
        if key not in data:
            raise ValueError(f"{name}: missing {key!r}")
    if data["family"] != name[:-len(".json")]:
        raise ValueError(f"{name}: family {data['family']!r} is not the file's name")
    if not data["records"]:
        raise ValueError(f"{name}: no records")
    for i, rec in enumerate(data["records"]):
        where = f"{name}: records[{i}]"
        for key in RECORD_FIELDS:
            if not rec.get(key):
                raise ValueError(f"{where}: missing {key!r}")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", rec["date"]):
            raise ValueError(f"{where}: date {rec['date']!r} is not YYYY-MM-DD")
        if rec.get("better", "lower") not in ("lower", "higher"):
            raise ValueError(f"{where}: better must be 'lower' or 'higher', not {rec['better']!r}")
        for j, row in enumerate(rec["rows"]):
            if not {"case", "impl", "value"} <= row.keys() or not isinstance(row["value"], (int, float)):
                raise ValueError(f"{where}.rows[{j}]: needs case, impl and a numeric value: {row}")
            if row.get("view", "") not in ("", *VIEWS):
                raise ValueError(f"{where}.rows[{j}]: view {row['view']!r} is not one of {sorted(VIEWS)}")
        if not any(is_weft(r["impl"]) for r in rec["rows"]):
            raise ValueError(f"{where}: no weft row")
    return data


def families(data_dir: str = DATA_DIR) -> list[tuple[str, str]]:
    """(family, title) of every data file, in page order."""
    names = sorted(f[:-5] for f in os.listdir(data_dir) if f.endswith(".json"))
    names = [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]
    return [(n, load(os.path.join(data_dir, n + ".json"))["title"]) for n in names]


def is_weft(impl: str) -> bool:
    return impl.startswith("weft")


def _tables(rec: dict):
    """(view, cases in order, impls in order, {(case, impl): value}) per view of a record, in order of appearance."""
    views = list(dict.fromkeys(r.get("view", "") for r in rec["rows"]))
    refs = set(rec.get("references", []))
    for view in views:
        rows = [r for r in rec["rows"] if r.get("view", "") == view]
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        impls.sort(key=lambda i: 0 if is_weft(i) else 2 if i in refs else 1)  # weft's, the baselines, references
        yield (view, list(dict.fromkeys(r["case"] for r in rows)), impls,
               {(r["case"], r["impl"]): r["value"] for r in rows})


def _best(values: dict, case: str, impls: list[str], higher: bool):
    """(impl, value) of the best of `impls` measured for `case`, or None."""
    got = [(i, values[(case, i)]) for i in impls if (case, i) in values]
    if not got:
        return None
    return max(got, key=lambda p: p[1]) if higher else min(got, key=lambda p: p[1])


def speedup(rec: dict, weft_value: float, base_value: float) -> float:
    """How many times better weft is than the baseline (> 1: weft ahead)."""
    return weft_value / base_value if rec.get("better") == "higher" else base_value / weft_value


def losses(rec: dict) -> list[dict]:
    """The rows of a record where weft's best impl is behind the best baseline: view, case, both impls and values."""
    higher = rec.get("better") == "higher"
    refs = set(rec.get("references", []))
    out = []
    for view, cases, impls, values in _tables(rec):
        wefts = [i for i in impls if is_weft(i)]
        bases = [i for i in impls if not is_weft(i) and i not in refs]
        for case in cases:
            w, b = _best(values, case, wefts, higher), _best(values, case, bases, higher)
            if w and b and speedup(rec, w[1], b[1]) < 1.0:
                out.append({"view": view, "case": case, "weft": w, "baseline": b,
                            "speedup": speedup(rec, w[1], b[1])})
    return out


def _ratio(x: float) -> str:
    """2 decimals, 3 where 2 would round a loss or a win to 1.00."""
    return f"{x:.2f}×" if round(x, 2) != 1.0 else f"{x:.3f}×"


def _fmt(v: float) -> str:
    """A value as the run recorded it (the data files keep the precision of their source)."""
    return str(v)


def _record_section(rec: dict, page_dir: str) -> list[str]:
    unit = rec.get("unit", "µs")
    higher = rec.get("better") == "higher"
    refs = set(rec.get("references", []))
    out = [f"## {rec['title']}", "",
           f"- **Hardware:** {rec['hardware']}",
           f"- **Date:** {rec['date']} · **commit:** `{rec['commit']}`",
           f"- **Command:** `{rec['command']}`"]
    if rec.get("timing"):
        out.append(f"- **Timing:** {rec['timing']}")
    out.append(f"- **Unit:** {unit}, {'higher' if higher else 'lower'} is better")
    out.append("")
    for view, cases, impls, values in _tables(rec):
        if view:
            out += [f"**{VIEWS[view]}**", ""]
        compared = any(is_weft(i) for i in impls) and any(not is_weft(i) and i not in refs for i in impls)
        head = [rec.get("case", "case")] + [i + (" (ref.)" if i in refs else "") for i in impls]
        head += ["best weft vs best baseline"] if compared else []
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for case in cases:
            cells = [case] + [_fmt(values[(case, i)]) if (case, i) in values else "—" for i in impls]
            if compared:
                w = _best(values, case, [i for i in impls if is_weft(i)], higher)
                b = _best(values, case, [i for i in impls if not is_weft(i) and i not in refs], higher)
                cells.append(_ratio(speedup(rec, w[1], b[1])) if w and b else "—")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if rec.get("references"):
        out += ["(ref.): shown for reference, not a baseline weft is compared with.", ""]
    out += [f"- {n}" for n in rec.get("notes", [])] + ([""] if rec.get("notes") else [])
    if rec.get("plot"):
        out += [f"![{rec['title']}]({os.path.relpath(rec['plot'], page_dir)})", ""]
    return out


def render_family(data: dict) -> str:
    """The markdown page of one family (written as docs/performance/<family>.md)."""
    page_dir = "performance"
    out = [f"# {data['title']}", ""]
    if data.get("summary"):
        out += [data["summary"], ""]
    out += ["Current figures only: each table is the latest GPU run that measured its cases, with its hardware, "
            "date, commit and command; earlier runs are in the repository's history. Raw data: "
            f"[`{data['family']}.json`](data/{data['family']}.json).", "", "## Where weft loses", ""]
    lost = [(rec, loss) for rec in data["records"] for loss in losses(rec)]
    if not lost:
        out += ["Nowhere in these tables: weft's best is ahead of or equal to the best baseline in every row.", ""]
    for rec, loss in lost:
        unit = rec.get("unit", "µs")
        view = f", {VIEWS[loss['view']]}" if loss["view"] else ""
        (wi, wv), (bi, bv) = loss["weft"], loss["baseline"]
        out.append(f"- {rec['title']}{view}, {loss['case']}: {wi} {_fmt(wv)} {unit} against {bi} {_fmt(bv)} {unit} "
                   f"({_ratio(loss['speedup'])})")
    out.append("")
    for rec in data["records"]:
        out += _record_section(rec, page_dir)
    return "\n".join(out)


def render_index(data_dir: str = DATA_DIR) -> str:
    out = ["# Performance", "",
           "Measured on GPUs by `weft bench` (and, where a table says so, the probes under `scripts/`): weft and its "
           "baselines (NCCL, cuBLAS, torch's symmetric-memory ops, torch collectives) in one run, on the same "
           "inputs, each implementation checked against a reference before it is timed; the median per call of the "
           "slowest rank; the implementations of a table row sampled round-robin. `bash scripts/gpu_suite.sh` runs "
           "the benchmarks and the GPU tests on a GPU machine.", "",
           "These pages hold the current figures only, one page per op family, each table with the hardware, date, "
           "commit and command of the run it comes from; each page opens with where weft is behind its best "
           "baseline. The pages are generated from `docs/performance/data/<family>.json` by "
           "`scripts/perf_pages.py`; to update one, replace its record with the new run's rows.", "",
           "| family | tables | runs (date, commit, hardware) | rows where weft loses |", "|---|---|---|---|"]
    for family, title in families(data_dir):
        data = load(os.path.join(data_dir, family + ".json"))
        runs = sorted({(r["date"], r["commit"], r["hardware"].split(";")[0].split(",")[0]) for r in data["records"]})
        lost = sum(len(losses(r)) for r in data["records"])
        out.append(f"| [{title}]({family}.md) | {len(data['records'])} | "
                   + "<br>".join(f"{d}, `{c}`, {h}" for d, c, h in runs) + f" | {lost} |")
    return "\n".join(out) + "\n"


def render_all(data_dir: str = DATA_DIR) -> dict[str, str]:
    """{file name: markdown} of the index and every family's page."""
    pages = {"index.md": render_index(data_dir)}
    for family, _ in families(data_dir):
        pages[f"{family}.md"] = render_family(load(os.path.join(data_dir, family + ".json")))
    return pages


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=DATA_DIR, help="folder of <family>.json files")
    p.add_argument("--out", help="write the pages into this folder")
    p.add_argument("--check", action="store_true", help="only validate the data files")
    args = p.parse_args(argv)
    pages = render_all(args.data)
    if args.check or not args.out:
        print(f"{len(pages) - 1} families OK")
        return
    os.makedirs(args.out, exist_ok=True)
    for name, text in pages.items():
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text)
    print(f"wrote {len(pages)} pages to {args.out}")


if __name__ == "__main__":
    main()
