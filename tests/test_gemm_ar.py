"""gemm_ar (GEMM + all-reduce: fused, baseline, auto) on cpu ranks.

Every rank builds every rank's a and b_shard from a seed and checks its result
against an fp32 torch reference, sum over ranks of a_r @ b_r. Outputs are
poisoned with NaN before each call; calls follow each other with fresh data
and no host barrier (a different rank late each time), so the epoch flags and
the double-buffered stage are exercised. Results must be bit-identical across
ranks. Shapes are small but odd: M = 17 needs two row blocks of the cpu
config (16 x 32 x 32 tiles), N = 72 and 37 leave ragged column blocks, K = 40
a ragged K block, K = 8 no whole K block.
"""
import pytest

from weft.testing import run_ranks
from weft.testing.checks import rejects

TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}  # a lost signal fails with a message instead of hanging
TIMEOUT = 150
CALLS = 4  # both halves of the double buffer, each reused


# -- helpers run on the ranks ----------------------------------------------------

def _operands(seed, m, n, k, dtype_name, w):
    import torch

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(m, k, generator=g).to(dtype) for _ in range(w)],
            [torch.randn(k, n, generator=g).to(dtype) for _ in range(w)])


def _digest(t):
    import hashlib

    import torch

    return hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _skew(me, call, w):
    """A different rank arrives late at each call."""
    import time

    if w > 1 and me == call % w:
        time.sleep(0.02)


def _gemm_ar_cases(cases):
    """cases: (method, dtype name, m, n, k, mode), mode "out" (poisoned out passed) | "none".
    Returns the digests of every result and the keys of the contexts created."""
    import torch

    import weft
    from weft.kernels.gemm_ar import gemm_ar

    me, w = weft.rank(), weft.world_size()
    digests = {}
    for ci, (method, dtype_name, m, n, k, mode) in enumerate(cases):
        for call in range(CALLS):
            As, Bs = _operands(ci * 100 + call, m, n, k, dtype_name, w)
            ref = torch.zeros(m, n)
            for a_r, b_r in zip(As, Bs):
                ref += a_r.float() @ b_r.float()
            a, b = As[me].clone(), Bs[me].clone()
            _skew(me, call, w)
            if mode == "out":
                out = torch.full((m, n), float("nan"), dtype=a.dtype)
                got = gemm_ar(a, b, method=method, out=out)
                assert got is out
            else:
                got = gemm_ar(a, b) if method == "auto" else gemm_ar(a, b, method=method)
            what = f"{method} {dtype_name} m={m} n={n} k={k} {mode} call {call}"
            assert torch.equal(a, As[me]) and torch.equal(b, Bs[me]), f"{what}: input was modified"
            assert got.shape == (m, n) and got.dtype == a.dtype, what
            assert torch.isfinite(got).all(), f"{what}: poison left in the output"
            tol = TOL[dtype_name]
            torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * ref.abs().mean().item(),
                                       msg=lambda s: f"{what}: {s}")
            digests[(ci, call)] = _digest(got)
    return digests, sorted(repr(key) for key in weft.world().contexts)


def _check_same_everywhere(results):
    for r, (digests, _) in enumerate(results[1:], 1):
        assert digests == results[0][0], f"rank {r} got other bits than rank 0"


# -- correctness ------------------------------------------------------------------------

FUSED_CASES = [("fused", d, m, 72, 40, "out") for d in ("float32", "bfloat16") for m in (1, 5, 17)]


def test_gemm_ar_2_ranks():
    """The fused kernel's row counts and stage dtypes; the race test of the family (tests/conftest.py RACE_TESTS:
    rank 1 stalls before every access to a peer, which is most of this test's time)."""
    _check_same_everywhere(run_ranks(_gemm_ar_cases, 2, FUSED_CASES, timeout=TIMEOUT, env=ENV))
    # bf16 partials staged in fp32 up to M = 8, in bf16 above.
    from weft.kernels.gemm_ar import stage_dtype

    import torch

    assert stage_dtype(5, torch.bfloat16) == torch.float32 and stage_dtype(17, torch.bfloat16) == torch.bfloat16


def test_gemm_ar_2_ranks_shapes_and_methods():
    """The other shape classes, the baseline and auto at 2 ranks, without the race test's stalls."""
    cases = [
        ("fused", "float16", 5, 72, 40, "none"),
        ("fused", "bfloat16", 17, 37, 8, "out"),   # N not 16-byte aligned in bf16, no whole K block
        ("fused", "float32", 3, 37, 8, "none"),    # same shape class with an fp32 stage
        ("fused", "bfloat16", 16, 64, 64, "out"),  # even: whole tiles, no ragged edge
        ("fused", "float32", 2, 40, 0, "out"),     # K = 0: zeros, still a collective call
        ("baseline", "bfloat16", 17, 72, 40, "out"),
        ("baseline", "float32", 1, 72, 40, "none"),
        ("auto", "bfloat16", 5, 72, 40, "none"),
    ]
    _check_same_everywhere(run_ranks(_gemm_ar_cases, 2, cases, timeout=TIMEOUT, env=ENV))


def test_gemm_ar_3_ranks():  # 4 ranks (world and groups): test_ag_gemm.py's test_family_on_group_layouts_4_ranks
    cases = FUSED_CASES[::2] + [("fused", "bfloat16", 17, 37, 8, "none"), ("baseline", "float32", 5, 72, 40, "out")]
    _check_same_everywhere(run_ranks(_gemm_ar_cases, 3, cases, timeout=TIMEOUT, env=ENV))


def test_gemm_ar_1_rank():
    cases = [("fused", "float32", 17, 72, 40, "out"), ("fused", "bfloat16", 1, 37, 8, "none"),
             ("baseline", "float32", 5, 72, 40, "out"), ("auto", "float32", 5, 72, 40, "out")]
    run_ranks(_gemm_ar_cases, 1, cases, timeout=TIMEOUT, env=ENV)


def test_one_rank_auto_and_baseline_are_a_plain_matmul():
    """Nothing to reduce on one rank: auto (at the fused kernel's sizes, too) and baseline are torch.matmul,
    with no workspace of the fused kernel and no all_reduce after the GEMM."""
    cases = [(method, dtype, m, 72, 40, mode) for method in ("auto", "baseline") for dtype in ("float32", "bfloat16")
             for m, mode in ((1, "out"), (5, "none"), (17, "out"))]
    [(_, contexts)] = run_ranks(_gemm_ar_cases, 1, cases, timeout=TIMEOUT, env=ENV)
    assert not any("gemm_ar" in c or "reduce" in c for c in contexts), contexts


def _stage_halves(calls):
    """After `calls` fused calls, half e % 2 of the stage holds call e's partials (slot q: rank q's a @ b)
    and the other half call e - 1's: the double buffer alternates, and epochs count every call per tile."""
    import torch

    import weft
    from weft.kernels.gemm_ar import gemm_ar

    me, w = weft.rank(), weft.world_size()
    m, n, k = 5, 72, 40
    partials = []
    for call in range(calls):
        As, Bs = _operands(500 + call, m, n, k, "float32", w)
        partials.append([a_r @ b_r for a_r, b_r in zip(As, Bs)])
        _skew(me, call, w)
        gemm_ar(As[me], Bs[me], method="fused")
    weft.world().barrier()
    ctx = weft.world().contexts["gemm_ar"]
    stage = ctx.stage.view(2, -1)[:, :w * m * n * 4].reshape(2, -1).view(torch.float32).view(2, w, m, n)
    for call in (calls - 1, calls - 2):
        epoch = call + 1
        for q in range(w):
            torch.testing.assert_close(stage[epoch % 2, q], partials[call][q], rtol=1e-5, atol=1e-5,
                                       msg=lambda s: f"half {epoch % 2} slot {q} after epoch {epoch}: {s}")
    tiles = len(ctx.flags) and int((ctx.flags.view(-1, w) > 0).any(1).sum())
    assert torch.equal(ctx.flags.view(-1, w)[:tiles], torch.full((tiles, w), calls, dtype=torch.int32)), ctx.flags
    assert int(ctx.counter[0]) >> 32 == calls  # one epoch per call


@pytest.mark.parametrize("w", [2, 3])
def test_stage_is_double_buffered_by_epoch(w):
    run_ranks(_stage_halves, w, 3, timeout=TIMEOUT, env=ENV)


def test_auto_switches_to_baseline_above_fused_max_m():
    """auto: fused up to gemm_ar.fused_max_m rows (a gemm_ar workspace appears), cuBLAS + all_reduce above (none)."""
    import torch

    from weft import tuning

    FUSED_MAX_M = tuning.value("gemm_ar.fused_max_m", torch.device("cpu"), 2)

    small = run_ranks(_gemm_ar_cases, 2, [("auto", "float32", FUSED_MAX_M, 8, 8, "out")], timeout=TIMEOUT,
                      env=ENV)
    assert any("gemm_ar" in c for c in small[0][1])
    big = run_ranks(_gemm_ar_cases, 2, [("auto", "float32", FUSED_MAX_M + 1, 8, 8, "out")], timeout=TIMEOUT,
                    env=ENV)
    assert not any("gemm_ar" in c for c in big[0][1]) and any("reduce" in c for c in big[0][1])


def test_gpu_config_table():
    """At the target shapes (N = 5120, K_local = 3200, M <= 128) one row block, unmasked b loads, and few
    enough tiles that every program of the grid is resident at once on an H200 (132 SMs): the shipped tables."""
    import torch
    import triton

    from weft import tuning
    from weft.kernels.gemm_ar import GemmArConfig, stage_dtype

    tables = tuning.shipped("gemm_ar.configs")
    assert tables
    for rows, m in ((rows, m) for rows in tables for m in (1, 8, 16, 17, 32, 64, 128)):
        cfg = next(GemmArConfig(**c) for max_m, c in rows if max_m is None or m <= max_m)
        assert triton.cdiv(m, cfg.block_m) == 1, (m, cfg)
        assert 5120 % cfg.block_n == 0 and 3200 % cfg.block_k == 0, (m, cfg)
        assert 5120 // cfg.block_n <= 132, (m, cfg)
    assert stage_dtype(8, torch.bfloat16) == torch.float32 and stage_dtype(9, torch.bfloat16) == torch.bfloat16


# -- bad inputs: rejected before anything is written --------------------------------------

def _bad_inputs():
    import torch

    import weft
    from weft.kernels.gemm_ar import gemm_ar

    world = weft.world()
    w = weft.world_size()
    a, b = torch.randn(5, 40), torch.randn(40, 72)
    out = torch.full((5, 72), float("nan"))
    used, contexts = world.heap.used, len(world.contexts)
    g = [a, b, out]
    for method in ("fused", "baseline", "auto"):
        rejects(lambda: gemm_ar([[1.0]], b, method=method, out=out), TypeError, "a", g)
        rejects(lambda: gemm_ar(a, "b", method=method, out=out), TypeError, "b_shard", g)
        rejects(lambda: gemm_ar(a.to(torch.int32), b, method=method, out=out), TypeError, "a", g)
        rejects(lambda: gemm_ar(a, b.to(torch.float64), method=method, out=out), TypeError, "b_shard", g)
        rejects(lambda: gemm_ar(a, b.to(torch.bfloat16), method=method, out=out), TypeError, "b_shard", g)
        rejects(lambda: gemm_ar(a.view(-1), b, method=method, out=out), ValueError, "a", g)
        rejects(lambda: gemm_ar(a, b.view(1, 40, 72), method=method, out=out), ValueError, "b_shard", g)
        rejects(lambda: gemm_ar(a, b[:39], method=method, out=out), ValueError, "b_shard", g)  # K mismatch
        rejects(lambda: gemm_ar(a, b, method=method, out=out[:4]), ValueError, "out", g)
        rejects(lambda: gemm_ar(a, b, method=method, out=out.double()), TypeError, "out", g)
        rejects(lambda: gemm_ar(a, b, method=method, out=[0.0]), TypeError, "out", g)
        big = torch.randn(5 * 72 + 100)
        rejects(lambda: gemm_ar(big[:200].view(5, 40), b, method=method, out=big[100:460].view(5, 72)),
                 ValueError, "out", g + [big])  # out overlaps a
    rejects(lambda: gemm_ar(a, b, method="split_k", out=out), ValueError, "method", g)
    rejects(lambda: gemm_ar(a.t().contiguous().t(), b, method="fused", out=out), ValueError, "contiguous", g)
    # Nothing was allocated by the rejected calls, and the op still works afterwards.
    assert world.heap.used == used and len(world.contexts) == contexts
    got = gemm_ar(torch.ones(5, 40), torch.ones(40, 72), method="fused", out=out)
    assert torch.equal(got, torch.full((5, 72), 40.0 * w))
    # Any layout through "auto": a transposed b and a strided out take the baseline.
    wide = torch.full((5, 144), float("nan"))
    got = gemm_ar(torch.ones(5, 40), torch.ones(72, 40).t(), out=wide[:, ::2])
    assert torch.equal(wide[:, ::2], torch.full((5, 72), 40.0 * w)) and wide[:, 1::2].isnan().all()


@pytest.mark.parametrize("w", [1, 2])
def test_bad_inputs_rejected_before_writing(w):
    run_ranks(_bad_inputs, w, timeout=TIMEOUT, env=ENV)
