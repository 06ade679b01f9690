"""The `weft` command: launcher failure handling, info, the demo, tutorials, the bench harness (on cpu ranks); its
help and refusals; what a bare `import weft` reaches."""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weft_cmd(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "weft", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def test_run_stops_all_ranks_when_one_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import weft, time\nweft.init()\n"
                      "if weft.rank() == 2:\n    raise RuntimeError('rank two gives up')\n"
                      "weft.barrier()\n")
    t0 = time.monotonic()
    res = weft_cmd("run", "-n", "4", str(script), timeout=120)
    assert res.returncode != 0
    assert "[rank 2]" in res.stderr and "rank two gives up" in res.stderr
    assert "rank 2 exited with code 1; the other ranks were stopped" in res.stderr
    assert time.monotonic() - t0 < 100


def test_info():
    res = weft_cmd("info", timeout=120)
    assert res.returncode == 0, res.stderr
    for key in ("backend     cpu", "world size  1", "torch", "triton      3.6.0", "heap"):
        assert key in res.stdout


def weft_main(capfd, *args):
    """(exit status, stdout, stderr) of `weft ARGS` run in this process (weft.cli.main): for what exits before any
    rank starts (help, refusals), without a fresh interpreter's imports. capfd, not capsys: the output of any rank
    started by mistake would be in it too."""
    from weft.cli import main

    try:
        status = main(list(args))
    except SystemExit as e:
        status = e.code
    out, err = capfd.readouterr()
    return status, out, err


def test_bench_suite_help_lists_every_option_once(capfd):
    status, out, err = weft_main(capfd, "bench", "allgather", "-h")
    assert status == 0, err
    assert out.count("usage: weft bench allgather") == 1 and "[rank" not in out + err  # no rank started
    for option in ("-n N", "--out", "--min-bytes", "--max-bytes", "--samples", "--dtype", "--view"):
        assert option in out
    status, out, err = weft_main(capfd, "bench", "-n", "2", "allgather", "--no-such-option")
    assert status == 2 and err.count("unrecognized arguments: --no-such-option") == 1 and "[rank" not in out + err


def test_demo_help_and_its_refusals(capfd):
    status, out, err = weft_main(capfd, "demo", "-h")
    assert status == 0, err
    for option in ("-n N", "--model", "--prompt", "--batch", "--prompt-len", "--new-tokens", "--layers"):
        assert option in out
    # Refused before any rank runs, with the reason.
    for args, reason in ((("--model", ROOT), "not a checkpoint directory (it has no config.json)"),
                         (("--prompt", "hello"), "--prompt needs --model"),
                         (("--model", "CKPT", "--layers", "1"), "--layers applies to the built-in model")):
        status, out, err = weft_main(capfd, "demo", *args)
        assert status == 2 and reason in err and "[rank" not in out + err, err


def test_demo_runs_a_checkpoint_on_cpu_ranks(tmp_path):
    """--model on the cpu backend: the checkpoint's decoder on 2 ranks against transformers' of the same files."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)  # fresh random weights
    res = weft_cmd("demo", "-n", "2", "--model", str(tmp_path), "--batch", "1", "--prompt-len", "4",
                   "--new-tokens", "2", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"checkpoint {tmp_path} on 2 cpu ranks" in res.stdout
    assert "against transformers' Qwen3ForCausalLM of the checkpoint on one process" in res.stdout
    assert "greedy tokens identical; comm='nccl' (gloo) tokens identical" in res.stdout


def test_bare_import_reaches_subpackages_and_typed_ops():
    """`import weft` alone reaches weft.models / weft.layers; every public op's annotations resolve, its `group`
    annotated with what group= takes."""
    check = ("import inspect, typing, weft\n"
             "assert callable(weft.models.from_hf) and weft.layers.EPMoE and 'models' in dir(weft)\n"
             "for name in weft.ops.__all__:\n"
             "    op = getattr(weft.ops, name)\n"
             "    if isinstance(op, type):\n"
             "        continue\n"
             "    hints = typing.get_type_hints(op)\n"
             "    if 'group' in inspect.signature(op).parameters:\n"
             "        assert hints['group'] == weft.GroupLike, name\n"
             "    assert hints, name\n"
             "assert typing.get_type_hints(weft.empty)['group'] == weft.GroupLike\n"
             "try:\n"
             "    weft.no_such_module\n"
             "except AttributeError as e:\n"
             "    assert 'no_such_module' in str(e)\n"
             "else:\n"
             "    raise AssertionError('weft.no_such_module did not raise')\n"
             "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_demo_checks_the_model_against_transformers():
    res = weft_cmd("demo", "-n", "2", "--batch", "1", "--prompt-len", "5", "--new-tokens", "3", "--layers", "1",
                   timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "against transformers' Qwen3ForCausalLM on one process" in res.stdout
    assert "greedy tokens identical; comm='nccl' (gloo) tokens identical" in res.stdout


# Tutorials run 15-40 s each here. CI runs the first two (notify / wait, all_gather: the step-by-step kernels the
# others build on) at 2 ranks, and the groups one at the 4 its 2 x 2 layout needs; the first two at 4 ranks (as
# their docstrings run them) and the rest (their kernels are the library's all_reduce, tile layer, ag_gemm,
# gemm_rs, EP and flash_decode, each tested in its own file) run outside CI (WEFT_LONG_TESTS=1).
_LIBRARY_TUTORIALS = ("03_all_reduce.py", "04_ag_gemm.py", "05_gemm_rs.py", "06_moe_all_to_all.py",
                      "07_flash_decode.py", "08_tile_primitives.py")
_FOUR_RANK_TUTORIALS = ("09_groups.py",)


def _tutorial_cases():
    for f in sorted(os.listdir(os.path.join(ROOT, "tutorials"))):
        if not f.endswith(".py"):
            continue
        if f in _LIBRARY_TUTORIALS:
            yield pytest.param(f, 4, marks=pytest.mark.long)
        elif f in _FOUR_RANK_TUTORIALS:
            yield pytest.param(f, 4)
        else:
            yield pytest.param(f, 2)
            yield pytest.param(f, 4, marks=pytest.mark.long)


@pytest.mark.parametrize("tutorial, ranks", list(_tutorial_cases()))
def test_tutorial_runs_on_cpu_ranks(tutorial, ranks):
    res = weft_cmd("run", "-n", str(ranks), os.path.join("tutorials", tutorial), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_tp_dp_training_example_matches_one_process():
    """examples/train_tp_dp.py: TP=2 x DP=2 on 4 ranks; the script fails itself if the loss curves differ."""
    # 3 steps: the first two SGD updates, the second with momentum (the curves compare every step's loss).
    res = weft_cmd("run", "-n", "4", os.path.join("examples", "train_tp_dp.py"), "--steps", "3", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "TP=2 x DP=2 on 4 ranks" in res.stdout


def test_bench_harness_writes_json_table_and_plot(tmp_path):
    res = weft_cmd("bench", "-n", "2", "allgather", "--out", str(tmp_path), "--min-bytes", "4096",
                   "--max-bytes", "8192", "--samples", "1", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "allgather_2.json").read_text())
    assert out["meta"]["command"].startswith("weft bench -n 2 allgather")
    assert len(out["meta"]["heap_used_bytes"]) == 2 and all(b > 0 for b in out["meta"]["heap_used_bytes"])
    rows = out["rows"]
    plain = {"gloo", "weft push", "weft pull", "weft auto"}
    assert {r["impl"] for r in rows if r["view"] == "graph"} == plain | {"weft push (symmetric out)"}
    assert {r["impl"] for r in rows if r["view"] == "eager"} == plain
    assert all(r["ms"] > 0 for r in rows)
    table = (tmp_path / "allgather_2.md").read_text()
    assert "### CUDA-graph replay" in table and "### eager back-to-back calls" in table
    assert "| 4 KiB |" in table and "weft auto vs gloo" in table
    assert (tmp_path / "allgather_2.png").stat().st_size > 1000
    assert "weft heap used per rank:" in res.stdout


@pytest.mark.parametrize("suite, impls", [
    ("allreduce", {"gloo", "weft one_shot", "weft two_shot", "weft auto", "weft auto (in place)",
                   "weft two_shot (symmetric, in place)"}),
    # The same harness as allreduce's: outside CI (`long`) for the suite's time.
    pytest.param("reducescatter", {"gloo", "weft"}, marks=pytest.mark.long),
])
def test_bench_reduction_suites(tmp_path, suite, impls):
    """One size, one sample: the harness's sweep over sizes is test_bench_harness_writes_json_table_and_plot's."""
    res = weft_cmd("bench", "-n", "2", suite, "--out", str(tmp_path), "--max-bytes", "4096", "--samples", "1",
                   "--view", "eager", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "runs on cuda only: skipped" in res.stdout  # torch's symm_mem baselines, noted
    rows = json.loads((tmp_path / f"{suite}_2.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {i for i in impls if "symmetric" not in i}  # eager: plain tensors only
    assert {r["case"] for r in rows} == {"4 KiB"} and {r["view"] for r in rows} == {"eager"}
    assert all(r["ms"] > 0 and r["gbps"] > 0 and r["world_size"] == 2 for r in rows)
    table = (tmp_path / f"{suite}_2.md").read_text()
    assert "bus bandwidth (GB/s)" in table and "best weft vs gloo" in table and "| 4 KiB |" in table
    assert (tmp_path / f"{suite}_2.png").stat().st_size > 1000


@pytest.mark.long  # 30 s here: a smoke run of the overhead suite
def test_bench_overhead(tmp_path):
    res = weft_cmd("bench", "-n", "2", "overhead", "--quick", "--samples", "1", "--out", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "overhead_2.json").read_text())["rows"]
    by = {(r["case"], r["impl"], r["view"]): r["ms"] for r in rows}
    collectives = [f"{op} {size}" for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
                   for size in ("256 B", "1 KiB")]
    gemms = {r["case"] for r in rows if r["case"].split()[0] in ("ag_gemm", "gemm_rs", "gemm_ar")}
    assert len(gemms) == 6
    for case in collectives + ["device_barrier"] + sorted(gemms):
        for impl in ("weft", "weft group", "gloo"):
            assert by[(case, impl, "host")] > 0 and by[(case, impl, "eager")] > 0
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):  # the large message: eager only
        assert by[(f"{op} 4 KiB", "weft", "eager")] > 0 and (f"{op} 4 KiB", "weft", "host") not in by
    assert by[("bare @triton.jit launch, 10 args", "anchor", "host")] > 0
    assert by[("flash_decode b1 kv64", "torch sdpa", "eager")] > 0 and by[("flash_decode b1 kv64", "weft", "host")] > 0
    assert by[("sp_flash_decode b1 kv128 per rank", "gloo", "host")] > 0
    # torch's symm_mem ops and the graph anchor run on cuda only
    assert {r["impl"] for r in rows} == {"weft", "weft group", "gloo", "anchor", "torch sdpa"}
    table = (tmp_path / "overhead_2.md").read_text()
    assert "### host (CPU) time to issue one call" in table and "| all_reduce 256 B |" in table
    assert (tmp_path / "overhead_2.png").stat().st_size > 1000


@pytest.mark.long  # 50 s here; the attention ops' own tests run in CI
def test_bench_attention_suite(tmp_path):
    res = weft_cmd("bench", "-n", "2", "attention", "--out", str(tmp_path), "--models", "llama3-8b", "--batches", "1",
                   "--kv", "32", "--sp-kv", "64", "--samples", "1", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "attention_2.json").read_text())["rows"]
    assert {(r["case"], r["impl"]) for r in rows} == {
        *(("llama3-8b b1 kv32", i) for i in ("weft flash_decode", "weft flash_decode (paged 16)", "torch sdpa",
                                            "copy (same bytes)")),
        *(("sp b1 kv64 (2 x 32)", i) for i in ("weft sp_flash_decode", "weft flash_decode of the local shard",
                                               "weft flash_decode of the local shard, rank 0",
                                               "weft flash_decode of the local shard, rank 1",
                                               "weft sp merge kernel alone (ready partials)",
                                               "weft flash_decode + gloo all_gather + torch merge"))}
    assert all(r["ms"] > 0 for r in rows)
    assert all((r["gbps"] > 0) == ("merge kernel alone" not in r["impl"]) for r in rows)
    by = {(r["case"], r["impl"]): r["ms"] for r in rows}
    local = "weft flash_decode of the local shard"
    assert by[("sp b1 kv64 (2 x 32)", local)] == max(by[("sp b1 kv64 (2 x 32)", f"{local}, rank {r}")] for r in (0, 1))
    assert "best weft vs copy (same bytes)" in (tmp_path / "attention_2.md").read_text()


@pytest.mark.long  # 20 s at one rank here; tests/test_model.py and test_decode.py check the model in CI
@pytest.mark.parametrize("n", [1, 2])
def test_bench_e2e_suite(tmp_path, n):
    """weft against NCCL+cuBLAS (gloo here), the HBM floor of each decode step, and at -n 1 transformers' own
    model of the same weights; every decode implementation's logits are checked against weft's first."""
    cases = ["--batches", "2", "--contexts", "4"] if n == 2 else ["--decode", "2x4"]  # both ways to name cases
    res = weft_cmd("bench", "-n", str(n), "e2e", "--out", str(tmp_path), "--models", "tiny", "--layers", "1",
                   "--prefill", "1x5", *cases, "--samples", "1", "--prefill-samples", "1", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / f"e2e_{n}.json").read_text())["rows"]
    prefill, decode = "tiny (1 layers) prefill 1×5", "tiny (1 layers) decode b2 ctx4"
    decoders = {"weft (fused)", "weft (layers)", "NCCL+cuBLAS", "HBM floor"} | ({"transformers"} if n == 1 else set())
    assert {(r["case"], r["impl"]) for r in rows} == {(prefill, "weft"), (prefill, "NCCL+cuBLAS"),
                                                      *((decode, i) for i in decoders)}
    assert all(r["ms"] > 0 for r in rows)
    assert "weft vs NCCL+cuBLAS logits differ by" in res.stdout
    assert "weft (fused) vs NCCL+cuBLAS logits differ by" in res.stdout
    assert "weft (layers) vs NCCL+cuBLAS logits differ by" in res.stdout
    assert ("weft (fused) vs transformers logits differ by" in res.stdout) == (n == 1)
    assert "note: transformers: its model runs on one device, at -n 1 only" in res.stdout or n == 1
    by = {r["impl"]: r["ms"] for r in rows if r["case"] == decode}
    # The floor: (this rank's weights + the KV cache read) over the copy bandwidth printed at the start.
    bandwidth = float(res.stdout.split("copy bandwidth (read + write): ")[1].split(" GB/s")[0].replace(",", ""))
    hidden, inter, vocab = 64, 128, 512  # tiny; its KV: k and v of 2 rows × 5 positions × 4 heads × 16
    kv = 2 * 2 * 5 * 4 * 16
    weights = (hidden * (8 * 16 + 2 * 4 * 16) + 8 * 16 * hidden + 3 * hidden * inter) // n + 2 * hidden + 2 * 16
    weights += hidden + vocab * hidden // n + 2 * hidden  # final norm, LM head, the embedding's 2 rows
    want = (weights + kv // n) * 4 / (bandwidth * 1e9) * 1e3
    assert abs(by["HBM floor"] / want - 1) < 0.02, (by["HBM floor"], want)
    table = (tmp_path / f"e2e_{n}.md").read_text()
    assert "best weft vs NCCL+cuBLAS" in table and "best weft vs best HBM floor" in table
    assert (tmp_path / f"e2e_{n}.png").stat().st_size > 1000


@pytest.mark.long  # 30 s here: a smoke run of a GPU profiling script
def test_profile_decode_script(tmp_path):
    """scripts/profile_decode.py on one cpu rank (its smoke run), on both decode paths: the JSON report, the GEMMs'
    weight bytes (layers: at one rank the O and down projections are torch.matmul too, 5 GEMMs of the tiny model's
    one layer; fused: the LM head's alone, the projections being the fused kernels)."""
    hidden, inter, vocab, q, kv = 64, 128, 512, 8 * 16, 2 * 4 * 16
    layers = 4 * (hidden * (q + kv) + q * hidden + 2 * hidden * inter + inter * hidden + hidden * vocab)
    for path, weights in (("layers", layers), ("fused", 4 * hidden * vocab)):
        out = tmp_path / f"profile_{path}.json"
        res = weft_cmd("run", "-n", "1", "scripts/profile_decode.py", "--model", "tiny", "--layers", "1", "--batch",
                       "2", "--context", "4", "--steps", "1", "--path", path, "--out", str(out), timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        report = json.loads(out.read_text())
        assert report["meta"]["batch"] == 2 and report["step_us"] > 0 and report["floor_us"] > 0
        assert report["meta"]["path"] == path
        gemms = [k for k in report["kernels"] if k["bytes_per_step"] is not None]
        assert [k["name"] for k in gemms] == ["aten::mm"] and gemms[0]["bytes_per_step"] == weights, path
        assert all(k["us_per_step"] > 0 for k in report["kernels"]) and "written to" in res.stdout


def test_readme_within_its_limits_and_lists_every_op():
    """README.md: at most 150 lines and 9,000 characters, no line over 240; its ops table names every weft.ops op
    (a new op gets its line there)."""
    import re

    import weft.ops

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lines = text.split("\n")
    assert len(lines) <= 150 and len(text) <= 9000 and max(map(len, lines)) <= 240
    table = text.split("\n## Ops\n")[1].split("\n## ")[0]
    listed = {name for row in table.split("\n") if row.startswith("| `")
              for name in re.findall(r"`(\w+)`", row.split(" | ")[0])}
    ops = {name for name in weft.ops.__all__ if not isinstance(getattr(weft.ops, name), type)}
    assert ops - listed == set(), "ops missing from the README's table"
    assert listed - ops == set(), "the README's table names ops that do not exist"


@pytest.mark.long  # 40 s here; tests/test_p2p.py and tests/test_m2n.py check the ops in CI
def test_bench_p2p_suite(tmp_path):
    """send / recv ping-pong between 2 cpu ranks at 4 and 16 KiB and M2N at 4 tokens x 64 (1 + 1), both views:
    every row there, the NVLink bound beside M2N."""
    res = weft_cmd("bench", "-n", "2", "p2p", "--out", str(tmp_path), "--max-bytes", "16384", "--samples", "1",
                   "--m2n-tokens", "4", "--m2n-hidden", "64", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "no 'weft via process group' rows" in res.stdout
    rows = json.loads((tmp_path / "p2p_2.json").read_text())["rows"]
    bound = "NVLink bound (450 GB/s per direction)"
    m2n = [f"m2n 4x64 top-{k} (1+1; gloo: 2 all_to_all_single)" for k in (1, 8)]
    want = {(case, impl) for case in ("send/recv 4 KiB", "send/recv 16 KiB") for impl in ("weft kernel", "gloo")}
    want |= {(case, impl) for case in m2n for impl in ("weft kernel", "gloo", bound)}
    for view in ("graph", "eager"):
        assert {(r["case"], r["impl"]) for r in rows if r["view"] == view} == want, view
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in rows)
    assert all(r["nbytes"] == 2 * 4 * k * 64 * 2 for r in rows for k in (1, 8) if r["case"] == m2n[k > 1])
    assert all(abs(r["gbps"] - 450) < 1e-6 for r in rows if r["impl"] == bound)
    table = (tmp_path / "p2p_2.md").read_text()
    assert "### CUDA-graph replay" in table and "| send/recv 16 KiB |" in table and "weft kernel vs gloo" in table
    assert (tmp_path / "p2p_2.png").stat().st_size > 1000


@pytest.mark.long  # 50 s here; tests/test_disaggregated.py checks the model in CI
def test_bench_disagg_suite(tmp_path):
    """The disaggregated model (2 attention + 2 expert ranks, 2 micro-batches) against DP attention + EPMoE on 4
    cpu ranks at the tiny config: a decode-step row for each, and the timeline of one decode step (both sides'
    spans, every layer of every micro-batch)."""
    res = weft_cmd("bench", "-n", "4", "disagg", "--out", str(tmp_path), "--model", "tiny", "--layers", "1",
                   "--batches", "4", "--context", "3", "--new-tokens", "2", "--samples", "1", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "disagg_4.json").read_text())["rows"]
    case = "tiny (1 layers) decode b4 ctx3"
    assert {(r["case"], r["impl"]) for r in rows} == {(case, "EP (DP attention + EPMoE)"),
                                                      (case, "weft disaggregated 2+2 k=2")}
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in rows)
    timeline = json.loads((tmp_path / "disagg_4_timeline_b4_k2.json").read_text())
    assert timeline["roles"] == ["attention", "attention", "expert", "expert"]
    for rank, spans in enumerate(timeline["spans"]):
        side = "attention" if rank < 2 else "expert"
        assert sorted((s[0], s[2], s[3]) for s in spans) == [(side, 0, 0), (side, 0, 1)], (rank, spans)
        assert all(0 <= s[4] <= s[5] for s in spans)
    assert (tmp_path / "disagg_4_timeline_b4_k2.png").stat().st_size > 1000


@pytest.mark.long  # 60 s here; tests/test_nodes.py checks the ops across nodes in CI
def test_bench_nodes_suite(tmp_path):
    """`weft bench -n 4 nodes` at one tiny size and GEMM shape: every op at each layout (4 nodes of 1, 2 of 2, one
    of 4, each a world of its own in the same ranks), the process group's own once, the model's prediction of each,
    in one report."""
    res = weft_cmd("bench", "-n", "4", "nodes", "--out", str(tmp_path), "--min-bytes", "4096", "--max-bytes", "4096",
                   "--gemm-shapes", "8x16x16", "--samples", "1", "--view", "eager", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "nodes_4.json").read_text())
    cases = ["all_reduce 4 KiB", "all_gather 4 KiB", "reduce_scatter 4 KiB",
             "ag_gemm 8×16×16 per rank (gloo: all_gather, then torch.matmul)",
             "gemm_rs 8×16×16 per rank (gloo: torch.matmul, then reduce_scatter)"]
    measured = ["weft 4×1", "weft 2×2", "single node 1×4", "gloo"]
    predicted = ["model weft 4×1", "model weft 2×2", "model single node 1×4", "model gloo ring"]
    rows = out["rows"]
    assert [(r["case"], r["impl"]) for r in rows] == [(c, i) for c in cases for i in measured + predicted]
    assert all(r["ms"] > 0 and r["view"] == "eager" and r["world_size"] == 4 for r in rows)
    assert all(r["gbps"] > 0 for r in rows if r["impl"] in measured and "gemm" not in r["case"])
    # The model's prediction follows the layout: more nodes of fewer ranks cost more NVLink-simulated network steps.
    model = {(r["case"], r["impl"]): r["ms"] for r in rows if r["impl"] in predicted}
    assert model[(cases[0], "model weft 2×2")] > model[(cases[0], "model single node 1×4")]
    assert "NVLink (simulated nodes" in out["meta"]["model"]
    assert out["meta"]["layouts"].startswith("single node 1×4 (1 node of 4), weft 2×2 (2 nodes of 2)")
    table = (tmp_path / "nodes_4.md").read_text()
    assert "best weft vs gloo" in table and "best weft vs best single node" in table
    assert "| reduce_scatter 4 KiB |" in table and "links between nodes: NVLink" in table
    assert (tmp_path / "nodes_4.png").stat().st_size > 1000


@pytest.mark.long  # ~50 s here
def test_bench_groups_suite(tmp_path):
    """`weft bench -n 4 groups` at one tiny size and GEMM shape: every op on groups of 2 in both layouts (consecutive,
    every other rank) against the process group's own on the same groups, the world reference with the first
    layout only, each checked before it is timed, in one report whose baseline is the group's process group."""
    res = weft_cmd("bench", "-n", "4", "groups", "--out", str(tmp_path), "--sizes", "4KiB", "--gemm-shapes",
                   "64x32x32", "--samples", "1", "--view", "eager", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "groups_4.json").read_text())
    ops = ["all_reduce 4 KiB", "all_gather 4 KiB", "reduce_scatter 4 KiB",
           "ag_gemm 64×32×32", "gemm_rs 64×32×32"]
    suffix = {"ag_gemm": " (gloo: all_gather, then torch.matmul)", "gemm_rs": " (gloo: torch.matmul, then reduce_scatter)"}
    impls = ["weft, group of 2", "gloo, group of 2"]
    want = []
    for op in ops:
        for layout in ("consecutive", "strided"):
            case = f"{op}, {layout}{suffix.get(op.split()[0], '')}"
            want += [(case, i) for i in impls + (["reference: weft, world of 4"] if layout == "consecutive" else [])]
    rows = out["rows"]
    assert [(r["case"], r["impl"]) for r in rows] == want
    assert all(r["ms"] > 0 and r["view"] == "eager" and r["world_size"] == 4 for r in rows)
    # Bus bandwidth at the op's own group size: 2 (G - 1) / G of all_reduce's bytes, (G - 1) / G of the others'.
    for r in rows:
        if "gemm" in r["case"]:
            assert r["gbps"] == 0
        else:
            span = 4 if r["impl"].startswith("reference") else 2
            factor = (2 if r["case"].startswith("all_reduce") else 1) * (span - 1) / span
            assert r["gbps"] == pytest.approx(factor * 4096 / r["ms"] / 1e6)
    assert out["meta"]["layouts"].startswith("consecutive: [[0, 1], [2, 3]]; strided: [[0, 2], [1, 3]]")
    assert "a reference, not a baseline" in out["meta"]["rows"]
    table = (tmp_path / "groups_4.md").read_text()
    assert "best weft vs gloo, group of 2" in table and "best weft vs best reference" in table
    assert "| gemm_rs 64×32×32, strided (gloo: torch.matmul, then reduce_scatter) |" in table
    assert (tmp_path / "groups_4.png").stat().st_size > 1000
