"""Bench output: JSON rows, a markdown table per view (sizes down, implementations across), a PNG plot."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass
class Row:
    suite: str
    case: str        # e.g. "64 MiB"
    impl: str        # e.g. "weft push", "nccl"
    ms: float        # median per call, slowest rank
    gbps: float      # the suite's bandwidth (default: algorithmic, result bytes / time), 0 where meaningless
    nbytes: int = 0
    world_size: int = 1
    view: str = ""   # what ms measures where a suite reports several ways (a key of VIEWS); "": the suite's only one


VIEWS = {
    "graph": "CUDA-graph replay",
    "eager": "eager back-to-back calls on plain tensors",
    "host": "host (CPU) time to issue one call",
}


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


ALGBW = "algorithmic bandwidth (GB/s)"


def _best(by, case, impls, prefix):
    times = [by[(case, i)].ms for i in impls if i.startswith(prefix) and (case, i) in by]
    return min(times) if times else None


def _unit(bandwidth: str) -> str:
    """"GB/s" of "bus bandwidth (GB/s)", "TFLOP/s" of "TFLOP/s of the GEMM"."""
    inner = bandwidth[bandwidth.find("(") + 1:bandwidth.find(")")] if "(" in bandwidth else ""
    return inner or bandwidth.split()[0]


def _ratio(num, den) -> str:
    return f"{num / den:.2f}×" if num is not None and den is not None else "—"


def _table(rows: list[Row], baseline, rival, bandwidth, focus) -> str:
    cases = list(dict.fromkeys(r.case for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    by = {(r.case, r.impl): r for r in rows}
    rival = rival if rival and any(i.startswith(rival) for i in impls) else None
    focus = focus if focus in impls and baseline else None
    head = ["case"] + [f"{i} µs" + (f" ({_unit(bandwidth)})" if bandwidth else "") for i in impls]
    if baseline:
        head += [f"best weft vs {baseline}"]
    if focus:
        head += [f"{focus} vs {baseline}"]
    if rival:
        head += [f"best weft vs best {rival}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        cells = [c]
        for i in impls:
            r = by.get((c, i))
            cells.append("—" if r is None else f"{r.ms * 1e3:.1f}" + (f" ({r.gbps:.0f})" if bandwidth else ""))
        best = _best(by, c, impls, "weft")
        base = by[(c, baseline)].ms if (c, baseline) in by else None
        if baseline:
            cells.append(_ratio(base, best))
        if focus:
            cells.append(_ratio(base, by[(c, focus)].ms if (c, focus) in by else None))
        if rival:
            cells.append(_ratio(_best(by, c, impls, rival), best))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(rows: list[Row], baseline: str | None = None, rival: str | None = None,
             bandwidth: str | None = ALGBW, focus: str | None = None) -> str:
    """One table per view (the rows' order). `baseline`: an impl the best weft row is compared with;
    `focus`: an impl compared with the baseline too (e.g. "weft auto"); `rival`: a prefix of impls
    (e.g. "torch") whose best is compared with the best weft row; `bandwidth`: what the bracketed figure
    is (None: no bracket). Ratios are baseline time / weft time: above 1, weft is faster."""
    views = list(dict.fromkeys(r.view for r in rows))
    if views == [""]:
        return _table(rows, baseline, rival, bandwidth, focus)
    return "\n\n".join(f"### {VIEWS.get(v, v)}\n\n" + _table([r for r in rows if r.view == v], baseline, rival,
                                                             bandwidth, focus) for v in views)


def plot(rows: list[Row], path: str, title: str, bandwidth: str | None = ALGBW) -> None:
    """Latency and bandwidth against size, a line per implementation and view; without a bandwidth (cases
    that are not sizes), bars of µs per case and implementation, a panel per view."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    views = list(dict.fromkeys(r.view for r in rows))
    if bandwidth is None:
        cases = list(dict.fromkeys(r.case for r in rows))
        impls = list(dict.fromkeys(r.impl for r in rows))
        slot = {c: i * (len(impls) + 1) for i, c in enumerate(cases)}  # a group of bars per case, a gap after
        fig, axes = plt.subplots(1, len(views), figsize=(7 * len(views), 1.5 + 0.12 * len(rows)), squeeze=False)
        for ax, view in zip(axes[0], views):
            for j, impl in enumerate(impls):
                rs = [r for r in rows if r.view == view and r.impl == impl]
                ax.barh([slot[r.case] + j for r in rs], [r.ms * 1e3 for r in rs], color=f"C{j % 10}", label=impl)
            ax.set_yticks([slot[c] + (len(impls) - 1) / 2 for c in cases], cases, fontsize=7)
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.set_xlabel("µs per call (slowest rank)")
            ax.set_title(VIEWS.get(view, view), fontsize=9)
            ax.grid(True, axis="x", which="both", alpha=0.3)
            ax.legend(fontsize=7)
    else:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        color = {impl: f"C{i % 10}" for i, impl in enumerate(dict.fromkeys(r.impl for r in rows))}
        style = {"eager": "--", "host": ":"}  # an impl keeps its colour across views
        for impl, view in dict.fromkeys((r.impl, r.view) for r in rows):
            rs = sorted((r for r in rows if (r.impl, r.view) == (impl, view)), key=lambda r: r.nbytes)
            x = [r.nbytes for r in rs]
            kw = dict(color=color[impl], marker="o", label=f"{impl} ({view})" if len(views) > 1 else impl)
            ax1.plot(x, [r.ms * 1e3 for r in rs], style.get(view, "-"), **kw)
            ax2.plot(x, [r.gbps for r in rs], style.get(view, "-"), **kw)
        for ax, label in ((ax1, "latency (µs, slowest rank)"), (ax2, bandwidth)):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        ax1.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long case labels
    plt.close(fig)


def write(rows: list[Row], out_dir: str, name: str, title: str, baseline: str | None = None,
          rival: str | None = None, bandwidth: str | None = ALGBW, focus: str | None = None,
          meta: dict | None = None) -> str:
    """{name}.json ({"meta": meta, "rows": [...]}), {name}.md and {name}.png under out_dir; returns the
    markdown tables."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"meta": meta or {}, "rows": [asdict(r) for r in rows]}, f, indent=1)
    table = markdown(rows, baseline, rival, bandwidth, focus)
    cells = "µs per call (median, slowest rank)" + (f", in brackets {bandwidth}" if bandwidth else "")
    run = "".join(f"{k}: {v}  \n" for k, v in (meta or {}).items())
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(f"## {title}\n\n{run}cells: {cells}\n\n{table}\n")
    plot(rows, os.path.join(out_dir, f"{name}.png"), title, bandwidth)
    return table


class ProbeLog:
    """A tuning probe's rows (scripts/probe_*.py): each printed as JSON by rank 0 as it comes, and all of them
    saved by rank 0 to $OUT/<name>.json (the working directory without $OUT)."""

    def __init__(self, name: str, rank: int):
        self.name, self.rank, self.rows = name, rank, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if self.rank == 0:
            print(json.dumps(row), flush=True)

    def save(self) -> None:
        if self.rank == 0:
            with open(os.path.join(os.environ.get("OUT", "."), f"{self.name}.json"), "w") as f:
                json.dump(self.rows, f, indent=1)
