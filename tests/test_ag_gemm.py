"""ag_gemm on cpu ranks: all_gather(a_shard) @ b against a torch reference, every method.

Each rank builds every rank's shard from a seed, so it knows the gathered A
without a collective. Outputs are poisoned; calls follow each other with fresh
data and skewed ranks, so the barrier epoch and the ready flags are exercised.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 240
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


def _ag_gemm_cases(cases, calls):
    """cases: (method, dtype name, m rows per rank, n, k, return_gathered)."""
    import time

    import torch

    import weft
    from weft.ops import ag_gemm

    me, w = weft.rank(), weft.world_size()
    for ci, (method, dtype_name, m, n, k, gathered) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        for call in range(calls):
            g = torch.Generator().manual_seed(ci * 100 + call)
            shards = [torch.randn(m, k, generator=g).to(dtype) for _ in range(w)]
            b = torch.randn(k, n, generator=g).to(dtype)
            ref = torch.cat(shards).float() @ b.float()
            out = torch.full((w * m, n), float("nan"), dtype=dtype)
            if me == call % w:
                time.sleep(0.02)  # a different rank late each call
            got = ag_gemm(shards[me].clone(), b, out=out, method=method, return_gathered=gathered)
            if gathered:
                got, a_all = got
                assert torch.equal(a_all, torch.cat(shards)), "gathered A differs"
            assert got is out
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < TOL[dtype_name], f"{method} {dtype_name} m={m} n={n} k={k} call {call}: rel err {err:.2e}"
    return True


@pytest.mark.parametrize("w", [1, 2, 4])
def test_ag_gemm_matches_reference(w):
    cases = [
        ("overlap", "float32", 32, 64, 64, False),     # whole blocks (2-D descriptors)
        ("overlap", "bfloat16", 37, 40, 24, True),     # ragged chunks (3-D descriptors), odd N and K
        ("overlap", "float32", 5, 72, 40, False),      # chunk smaller than a block
        ("baseline", "bfloat16", 7, 24, 16, True),
        ("auto", "float32", 16, 8, 8, False),
    ]
    if w == 4:
        cases = cases[:3]
    assert all(run_ranks(_ag_gemm_cases, w, cases, 2, timeout=TIMEOUT, env=ENV))


def _bad_inputs():
    import pytest
    import torch

    import weft
    from weft.ops import ag_gemm

    w = weft.world_size()
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    out = torch.full((w * 4, 16), 7.0)
    bad = [
        (dict(a_shard=a.numpy(), b=b), TypeError, "a_shard must be a torch.Tensor"),
        (dict(a_shard=a, b=b.half()), TypeError, "same dtype"),
        (dict(a_shard=a, b=torch.randn(4, 16)), ValueError, "columns but b has 4 rows"),
        (dict(a_shard=torch.randn(4, 6), b=torch.randn(6, 16), method="overlap"), ValueError, "K = 6 is not a multiple"),
        (dict(a_shard=a.t().contiguous().t(), b=b, method="overlap"), ValueError, "a_shard must be contiguous"),
        (dict(a_shard=a, b=b, out=torch.empty(w * 4, 8)), ValueError, "out has shape"),
        (dict(a_shard=a, b=b, method="ring"), ValueError, "method must be one of"),
    ]
    for kwargs, exc, words in bad:
        kwargs.setdefault("out", out)
        with pytest.raises(exc, match=words):
            ag_gemm(**kwargs)
        assert torch.equal(out, torch.full_like(out, 7.0)), "out written before the error"
    return True


def test_ag_gemm_rejects_bad_inputs():
    assert all(run_ranks(_bad_inputs, 2, timeout=TIMEOUT, env=ENV))
