"""The documentation's code and data (the site itself is built by `make docs`, `mkdocs build --strict`, in CI).

Convention: a code block fenced ```python in README.md or docs/getting-started.md is a complete script; each one is
run on 2 cpu ranks (`weft run -n 2`). Blocks meant only to be read are fenced ```py or ```text.
The performance pages are generated from docs/performance/data/*.json by scripts/perf_pages.py: the data must load
(every table with hardware, date, commit, command and rows), every plot they name must exist, every plot in
docs/img must be shown by a page, and the "where weft loses" list must name exactly the rows where weft's best is
behind the best baseline.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT_DOCS = ["README.md", os.path.join("docs", "getting-started.md")]
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return PYTHON_BLOCK.findall(text)


def _blocks():
    out = []
    for doc in SCRIPT_DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            out += [(f"{doc}:{i + 1}", code) for i, code in enumerate(python_blocks(f.read()))]
    return out


BLOCKS = _blocks()


def _perf_pages():
    spec = importlib.util.spec_from_file_location("perf_pages", os.path.join(ROOT, "scripts", "perf_pages.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_python_blocks_are_found_and_others_are_not():
    text = ("x\n```python\nprint(1)\n```\n```py\nnot run\n```\n```text\nnot run\n```\n"
            "```python\nimport weft\n\nprint(2)\n```\n")
    assert python_blocks(text) == ["print(1)\n", "import weft\n\nprint(2)\n"]
    with open(os.path.join(ROOT, "docs", "getting-started.md")) as f:
        assert len(python_blocks(f.read())) >= 2  # a first op and a first kernel


@pytest.mark.parametrize("code", [c for _, c in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_python_block_runs_on_two_cpu_ranks(code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "weft", "run", "-n", "2", str(script)], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_performance_data_loads_and_names_existing_plots():
    perf = _perf_pages()
    families = perf.families(perf.DATA_DIR)
    assert len(families) >= 10
    shown = set()
    for family, _ in families:
        data = perf.load(os.path.join(perf.DATA_DIR, family + ".json"))
        for rec in data["records"]:
            if rec.get("plot"):
                assert os.path.isfile(os.path.join(ROOT, "docs", rec["plot"])), (family, rec["plot"])
                shown.add(os.path.basename(rec["plot"]))
    images = {f for f in os.listdir(os.path.join(ROOT, "docs", "img"))}
    assert images == shown, f"plots no page shows: {sorted(images - shown)}"
    pages = perf.render_all(perf.DATA_DIR)
    assert set(pages) == {"index.md"} | {f"{family}.md" for family, _ in families}


def test_losses_name_the_rows_where_weft_is_behind(tmp_path):
    perf = _perf_pages()
    rec = {"title": "t", "hardware": "h", "date": "2026-01-01", "commit": "c", "command": "x",
           "references": ["bound"],
           "rows": [{"case": "a", "impl": "weft push", "value": 5.0}, {"case": "a", "impl": "weft pull", "value": 9.0},
                    {"case": "a", "impl": "nccl", "value": 6.0}, {"case": "a", "impl": "bound", "value": 1.0},
                    {"case": "b", "impl": "weft push", "value": 7.0}, {"case": "b", "impl": "nccl", "value": 6.0},
                    {"case": "b", "impl": "torch", "value": 8.0},
                    {"case": "b", "impl": "weft push", "value": 5.0, "view": "eager"},
                    {"case": "b", "impl": "nccl", "value": 6.0, "view": "eager"}]}
    lost = perf.losses(rec)
    assert [(x["case"], x["view"], x["weft"], x["baseline"]) for x in lost] == [("b", "", ("weft push", 7.0), ("nccl", 6.0))]
    higher = dict(rec, better="higher")  # bandwidths: a wins (9 against 6), b loses in both views (7 < 8, 5 < 6)
    assert [(x["case"], x["view"]) for x in perf.losses(higher)] == [("b", ""), ("b", "eager")]
    (tmp_path / "fam.json").write_text('{"family": "fam", "title": "F", "records": [%s]}'
                                       % json.dumps(dict(rec, date="Jan 1")))
    with pytest.raises(ValueError, match="records\\[0\\]: date"):
        perf.load(str(tmp_path / "fam.json"))
