"""weft.tuning: which table a lookup reads, local tables written by `weft tune`, and bad tables named."""
import json
import os
import subprocess
import sys

import pytest
import torch

from weft import tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


@pytest.fixture
def local(tmp_path, monkeypatch):
    """An empty local tuning directory, read afresh."""
    monkeypatch.setenv("WEFT_TUNING_DIR", str(tmp_path))
    tuning.reload()
    yield tmp_path
    tuning.reload()


def _shipped_entries(family: str, world_size: int = 2) -> dict:
    data = json.loads((tuning.DATA_DIR / f"H200-x{world_size}.json").read_text())["values"]
    return {k: v for k, v in data.items() if k.startswith(family + ".")}


def _write(path, gpu, world_size, values):
    path.write_text(json.dumps(dict(gpu=gpu, world_size=world_size, values=values)))


def test_lookup_takes_the_nearest_world_size_then_the_nearest_gpu(local):
    worlds = {w: tuning.table_for("all_reduce", "H200", w).world_size for w in (1, 2, 3, 4, 5, 6, 8, 16)}
    assert worlds == {1: 2, 2: 2, 3: 4, 4: 4, 5: 4, 6: 8, 8: 8, 16: 8}  # a tie goes to the larger world
    # Another GPU of the same architecture, and a cpu backend with no table of its own, take the H200's.
    assert tuning.table_for("all_reduce", "H100", 4).path.name == "H200-x4.json"
    assert tuning.table_for("all_reduce", "cpu", 8).path.name == "H200-x8.json"
    # A table of another architecture serves its own GPU only where it holds the family.
    _write(local / "B200-x2.json", "B200", 2, _shipped_entries("all_gather"))
    tuning.reload()
    assert tuning.table_for("all_gather", "B200", 2).gpu == "B200"
    assert tuning.table_for("all_reduce", "B200", 2).gpu == "H200"
    assert tuning.table_for("all_gather", "H100", 2).gpu == "H200"  # same architecture beats a local table
    # The values the kernels had as literals at 2, 4 and 8 ranks.
    one_shot = {w: tuning.value("all_reduce.one_shot_max_bytes", CPU, w) for w in (2, 4, 8)}
    assert one_shot == {2: 8 << 20, 4: 512 << 10, 8: 256 << 10}
    assert tuning.value("all_gather.nccl_above.symmetric", CPU, 2) == float("inf")
    assert [tuning.value("all_reduce.nccl_above.plain", CPU, w) for w in (2, 4, 8)] == [float("inf"), 32 << 20,
                                                                                       32 << 20]


def test_a_local_table_wins_and_is_reported(local):
    entries = _shipped_entries("all_gather")
    entries["all_gather.push_program_bytes"] = dict(value=4096, measured=None, note="test")
    _write(local / "cpu-x2.json", "cpu", 2, entries)
    tuning.reload()
    assert tuning.value("all_gather.push_program_bytes", CPU, 2) == 4096
    sources = tuning.sources(CPU, 2)
    assert sources["all_gather"].local and sources["all_gather"].path == local / "cpu-x2.json"
    assert not sources["all_reduce"].local  # families the local table lacks come from the shipped ones
    with tuning.overrides({"all_gather.push_program_bytes": 1 << 20}):
        assert tuning.value("all_gather.push_program_bytes", CPU, 2) == 1 << 20
    assert tuning.value("all_gather.push_program_bytes", CPU, 2) == 4096
    with pytest.raises(tuning.TuningError, match="all_gather.push_program_bytes"):
        with tuning.overrides({"all_gather.push_program_bytes": "4K"}):
            pass


@pytest.mark.parametrize("case", ["not json", "missing key", "wrong type", "unknown key", "no world size"])
def test_bad_tables_are_named_with_the_key(local, case):
    path = local / "cpu-x2.json"
    entries = _shipped_entries("all_gather")
    key = "all_gather.pull_program_bytes"
    if case == "not json":
        path.write_text('{"gpu": "cpu", ')
        match = "cannot read"
    elif case == "missing key":
        del entries[key]
        _write(path, "cpu", 2, entries)
        match = f"'{key}' is missing"
    elif case == "wrong type":
        entries[key] = dict(value="8K")
        _write(path, "cpu", 2, entries)
        match = f"'{key}': the value must be a non-negative integer, got '8K'"
    elif case == "unknown key":
        entries["all_gather.pull_bytes"] = dict(value=1)
        _write(path, "cpu", 2, entries)
        match = "unknown key 'all_gather.pull_bytes'"
    else:
        path.write_text(json.dumps(dict(gpu="cpu", world_size="two", values=entries)))
        match = "'world_size' must be a positive integer"
    tuning.reload()
    with pytest.raises(tuning.TuningError, match=match) as raised:
        tuning.value(key, CPU, 2)
    assert str(path) in str(raised.value)


def _weft(*args, env):
    env = dict(os.environ, **env, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "weft", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=240)


@pytest.mark.long  # 17 s here: a whole `weft tune` run on cpu ranks
def test_tune_writes_a_local_table_that_info_then_reports(tmp_path):
    env = {"WEFT_TUNING_DIR": str(tmp_path)}
    res = _weft("tune", "-n", "2", "--quick", env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    path = tmp_path / "cpu-x2.json"
    table = tuning.load(path, local=True)
    assert (table.gpu, table.world_size) == ("cpu", 2)
    entries = json.loads(path.read_text())["values"]
    measured = entries["all_gather.push_program_bytes"]["measured"]
    assert measured["command"] == "python3 -m weft tune -n 2 --ops all_gather,all_reduce,gemm --quick"
    assert measured["date"] and measured["commit"] and measured["hardware"] == "2x cpu"
    # Keys no suite measures keep the shipped table's value and provenance.
    assert entries["all_reduce.ll_max_bytes"] == _shipped_entries("all_reduce")["all_reduce.ll_max_bytes"]
    # A fresh process (one rank) reads the local table for the families tuned, the shipped one for the rest.
    res = _weft("info", env=env)
    assert res.returncode == 0, res.stderr
    lines = {line.split()[0]: line for line in res.stdout.splitlines() if line.startswith("  ")}
    for family in ("all_gather", "all_reduce", "gemm"):
        assert f"local {path} (cpu, 2 ranks)" in lines[family], res.stdout
    assert "shipped" in lines["flash_decode"] and "H200-x2.json (H200, 2 ranks)" in lines["flash_decode"]
