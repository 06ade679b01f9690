"""ag_gemm on cpu ranks: all_gather(a_shard) @ b against a torch reference, every method; and the whole
overlapped-GEMM family (ag_gemm, gemm_rs, gemm_ar) over process groups.

Each rank builds every rank's shard from a seed, so it knows the gathered A
without a collective. Outputs are poisoned; calls follow each other with fresh
data and skewed ranks, so the barrier epoch and the ready flags are exercised.
The group tests run the three ops on every layout of weft.testing.groups (4
ranks) and beside a rank outside the group (3 ranks), against references
computed by the group's process group.
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


@pytest.mark.parametrize("w", [1, 2])  # 4 ranks: test_family_on_group_layouts_4_ranks
def test_ag_gemm_matches_reference(w):
    cases = [
        ("overlap", "float32", 32, 64, 64, False),     # whole blocks (2-D descriptors)
        ("overlap", "bfloat16", 37, 40, 24, True),     # ragged chunks (3-D descriptors), odd N and K
        ("overlap", "float32", 5, 72, 40, False),      # chunk smaller than a block
        ("baseline", "bfloat16", 7, 24, 16, True),
        ("auto", "float32", 16, 8, 8, False),
    ]
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


# -- groups: the whole family (ag_gemm, gemm_rs, gemm_ar) over every layout of weft.testing.groups --------------------
# One rank launch per test: ranks are the interpreter's costliest setup.

FAMILY = (("ag_gemm", "overlap"), ("gemm_rs", "overlap"), ("gemm_ar", "fused"))  # each op's own kernel


def _family_call(op_name, method, group, dtype_name, seed, with_out):
    """One call of `op_name` over `group` on fresh random inputs (this rank's own: the seed takes the world rank),
    checked against the torch reference computed over the group's process group. Rows per member 5, N 40, K 24:
    none a multiple of the cpu tiles (32, and gemm_ar's 16 x 32 x 32). With `with_out`, out is poisoned with NaN."""
    import torch
    import torch.distributed as dist

    import weft
    from weft.kernels.common import resolve
    from weft.ops import ag_gemm, gemm_ar, gemm_rs
    from weft.testing.reference import all_gather_ref, reduce_scatter_ref

    g = resolve(group)
    pg, w = g.process_group, g.size
    dtype = getattr(torch, dtype_name)
    m, n, k = 5, 40, 24
    gen = torch.Generator().manual_seed(seed * 16 + weft.rank())
    rows = w * m if op_name == "gemm_rs" else m  # gemm_rs: a holds every member's rows
    a, b = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
    shape = {"ag_gemm": (w * m, n), "gemm_rs": (m, n), "gemm_ar": (m, n)}[op_name]
    out = torch.full(shape, float("nan"), dtype=dtype) if with_out else None
    what = f"{op_name} {method} {dtype_name} on {g!r} (seed {seed})"
    if op_name == "ag_gemm":
        gathered = torch.empty(w * m, k, dtype=dtype)
        all_gather_ref(gathered, a, pg)
        ref = gathered.float() @ b.float()
        got, got_gathered = ag_gemm(a, b, method=method, out=out, return_gathered=True, group=group)
        assert torch.equal(got_gathered, gathered), f"{what}: gathered A differs"
    elif op_name == "gemm_rs":
        ref = torch.empty(m, n)
        reduce_scatter_ref(ref, a.float() @ b.float(), pg)
        got = gemm_rs(a, b, method=method, out=out, group=group)
    else:
        ref = a.float() @ b.float()
        dist.all_reduce(ref, group=pg)
        got = gemm_ar(a, b, method=method, out=out, group=group)
        every = torch.empty(w * m, n, dtype=dtype)
        all_gather_ref(every, got, pg)
        assert all(torch.equal(every[i * m:(i + 1) * m], got) for i in range(w)), f"{what}: members' bits differ"
    if with_out:
        assert got is out, what
    assert got.shape == shape and got.dtype == dtype, what
    assert not got.isnan().any(), f"{what}: poison left in the output"
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype_name], f"{what}: rel err {err:.2e}"


def _family_on_layouts(iterations):
    """Every op of the family, its kernel and baseline / auto, on every layout, in an order shuffled per iteration
    (the same on every rank), fp32 then bf16. A group of one is a plain GEMM: no ag_gemm / gemm_rs workspace, no
    collective's."""
    import random

    from weft.testing.groups import layouts

    groups = layouts()
    for it in range(iterations):
        other = "baseline" if it % 2 == 0 else "auto"
        calls = [(name, op, method) for name in groups for op, kernel in FAMILY for method in (kernel, other)]
        random.Random(it).shuffle(calls)
        for i, (name, op, method) in enumerate(calls):
            _family_call(op, method, groups[name], ("float32", "bfloat16")[it % 2], it * 1000 + i, i % 2 == 0)
    # gemm_ar's "fused" keeps its kernel, whose workspace makes the group's signature word (host-side, 4 words).
    assert set(groups["one"].contexts) <= {"gemm_ar", "signatures"}, groups["one"].contexts
    return sorted(groups)


def test_family_on_group_layouts_4_ranks():
    names = run_ranks(_family_on_layouts, 4, 2, timeout=TIMEOUT, env=ENV)
    assert names[0] == ["one", "pairs", "process_group", "strided", "world"]


def _family_beside_a_leftover_rank(iterations):
    """Ranks 0 and 1 run the family on their group while rank 2 runs it on its group of one, then waits for rank 0
    to say the pair is done: no op of the pair waits on the non-member. The pair also runs gemm_ar under
    torch.compile(fullgraph=True) with group= (the operator takes the group's name) and ag_gemm's backward."""
    import torch
    import torch.distributed as dist

    import weft
    from weft.ops import gemm_ar

    pair = weft.new_group([0, 1])
    one = weft.new_subgroups(1)
    mine = pair if pair is not None else one
    for it in range(iterations):
        for i, (op, kernel) in enumerate(FAMILY):
            for j, method in enumerate((kernel, "baseline")):
                _family_call(op, method, mine, "float32", it * 100 + i * 10 + j, j == 0)
    done = torch.zeros(1)
    if pair is None:
        dist.recv(done, src=0)
        return float(done)
    gen = torch.Generator().manual_seed(77 + weft.rank())
    a, b = torch.randn(5, 24, generator=gen), torch.randn(24, 40, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: gemm_ar(a, b, method="fused", group=pair), fullgraph=True,
                             backend="aot_eager")(a, b)
    assert torch.equal(compiled, gemm_ar(a, b, method="fused", group=pair))
    _backward_over(pair)
    if weft.rank() == 0:
        dist.send(done + 1, dst=2)
    return 1.0


def _backward_over(group):
    """ag_gemm's backward (gemm_rs of the gradient, then the gathered A's product) over the forward's group,
    against torch's gradients computed from the group's collectives."""
    import torch

    import weft
    from weft.kernels.common import resolve
    from weft.ops import ag_gemm
    from weft.testing.reference import all_gather_ref, reduce_scatter_ref

    g = resolve(group)
    m, n, k = 5, 40, 24
    gen = torch.Generator().manual_seed(900 + weft.rank())
    a, b = torch.randn(m, k, generator=gen).requires_grad_(), torch.randn(k, n, generator=gen).requires_grad_()
    grad_c = torch.randn(g.size * m, n, generator=gen)
    (ag_gemm(a, b, group=group) * grad_c).sum().backward()
    gathered, want_a = torch.empty(g.size * m, k), torch.empty(m, k)
    all_gather_ref(gathered, a.detach(), g.process_group)
    reduce_scatter_ref(want_a, grad_c @ b.detach().t(), g.process_group)
    torch.testing.assert_close(a.grad, want_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, gathered.t() @ grad_c, rtol=1e-5, atol=1e-5)


def test_family_beside_a_leftover_rank_3_ranks():
    assert run_ranks(_family_beside_a_leftover_rank, 3, 2, timeout=TIMEOUT, env=ENV) == [1.0, 1.0, 1.0]
