"""The EP dispatch / combine (high-throughput, low-latency, fp8) and gemm_ar on groups that span nodes: 4 cpu ranks as
2 simulated nodes of 2 (WEFT_LOCAL_WORLD_SIZE=2). Across nodes a kernel's symm_at to another node raises, so an op
that reached another node other than through the rail's exchange fails here.

Every rank builds every rank's routing from a shared seed and checks its own results against the torch reference
of test_moe (the single-node op's contract): the dispatch bit for bit, the combine within the dtype's tolerance.
The world (2 nodes of 2: rail and node hops), a group across nodes (2 nodes of 1: the rail hop alone) and a group
inside a node (the single-node kernels) in one program, calls of changing sizes back to back."""
import pytest

from weft.testing import run_ranks

TWO_NODES = {"WEFT_LOCAL_WORLD_SIZE": "2", "WEFT_WAIT_TIMEOUT_S": "60"}


def _took_nodes_path(group, spans: bool) -> None:
    """Every EP plan of the group is the across-nodes one exactly when the group spans nodes."""
    from weft.kernels.common import resolve

    g = resolve(group)
    ep = [key[0] for key in g.plans if isinstance(key, tuple) and str(key[0]).startswith("ep")]
    assert ep and all(name.endswith("_nodes") == spans for name in ep), (g, ep)


def _ht_case(seed, tokens, experts, k, hidden, mode, max_recv, dtype, strided, group):
    """One ep_dispatch + ep_combine over `group` against test_moe's reference: the dispatch bit for bit, the
    combine within the dtype's tolerance (across nodes the sum goes by node, not by rank)."""
    import torch

    import weft
    from test_moe import _bits, _members, _ref_dispatch, _routing, _strided, _weighted

    me, w = _members(group)
    local = experts // w
    inputs = _routing(seed, w, tokens, experts, k, hidden, mode, dtype)
    x, idx, wts = inputs[me]
    if strided:
        x, idx, wts = _strided(x, idx, wts)
    rx, ri, rw, counts, handle = weft.ops.ep_dispatch(x, idx, wts, experts, max_recv_tokens=max_recv, group=group)
    ex, ei, ew, ec = _ref_dispatch(inputs, me, experts, w)
    n = ex.shape[0]
    tag = f"seed {seed} mode {mode} k {k} max_recv {max_recv} {dtype} hidden {hidden} strided {strided}"
    if max_recv is None:
        assert rx.shape[0] == n, tag
    else:  # rows past max_recv dropped, rows past the received ones zero
        assert rx.shape[0] == max_recv, tag
        m = min(n, max_recv)
        ex, ei, ew, ec = ex[:m], ei[:m], ew[:m], torch.tensor([int((ei[:m] == e).sum()) for e in range(local)],
                                                              dtype=torch.int32)
        assert (ri[m:] == -1).all() and (rw[m:] == 0).all() and (rx[m:] == 0).all(), tag
        n = m
    assert torch.equal(_bits(rx[:n]), _bits(ex)), tag
    assert torch.equal(ri[:n], ei) and ri.dtype == idx.dtype, tag
    assert torch.equal(rw[:n], ew), tag
    assert torch.equal(counts, ec), tag
    y = _weighted(rx, ri, rw, me * local)
    if strided:
        y = _strided(y, idx, wts)[0]
    out = weft.ops.ep_combine(y, handle, group=group)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(w):
        mine = (idx >= 0) & (idx // local == r)
        part = _weighted(x, torch.where(mine, idx - r * local, -1), wts, r * local)
        goes = mine.any(1)
        if max_recv is not None:  # rank r keeps its first max_recv rows (by source rank, then token)
            before = sum(int(((i >= 0) & (i // local == r)).any(1).sum()) for _, i, _ in inputs[:me])
            goes &= before + goes.long().cumsum(0) - 1 < max_recv
        acc += torch.where(goes[:, None], part.float(), 0.0)
    torch.testing.assert_close(out.float(), acc.to(x.dtype).float(), rtol=1e-2, atol=1e-2, msg=tag)


def _ep_ops(cases):
    """cases: (experts, k, hidden, tokens per group member, mode, dtype, max_recv, max_tokens) per step; each
    step runs HT and LL (LL with its receive hooks: outputs poisoned between send and receive) on the world, a
    group across nodes and one inside a node, with gemm_ar on the node's group between them."""
    import torch
    import torch.distributed as dist

    import weft
    from test_moe import _ll_case
    from test_nodes import _node_groups

    w, across, inside = _node_groups()
    for step, (experts, k, hidden, tokens, mode, dtype, max_recv, max_tokens) in enumerate(cases):
        for i, group in enumerate((None, across, inside)):
            g = weft.get_group(group)
            size = g.size
            seed = 1000 * step + 10 * i
            counts = [tokens[r % len(tokens)] for r in range(size)]
            _ht_case(seed, counts, experts, k, hidden, mode, max_recv, dtype, step % 2 == 1, group)
            _ll_case(seed + 1, counts, experts, k, hidden, mode, max_tokens, step % 2 == 0, dtype, step % 2 == 1,
                     group)
            _took_nodes_path(group, g.topology.spans_nodes)
            # A TP op inside the node between the EP calls across nodes.
            tp = getattr(torch, dtype)
            a = torch.randn((3, 8), generator=torch.Generator().manual_seed(seed + inside.rank)).to(tp)
            b = torch.randn((8, 5), generator=torch.Generator().manual_seed(seed + 7 + inside.rank)).to(tp)
            got = weft.ops.gemm_ar(a, b, group=inside)
            ref = (a.float() @ b.float()).to(tp)
            dist.all_reduce(ref, group=inside.process_group)
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=5e-2)
        if step == 0:
            heap_used = {h: h.heap.used for h in w.groups.values() if h._heap is not None}
        dist.barrier()
    # Heap bounded: later calls of every size allocate nothing more in any group's heap.
    assert {h: h.heap.used for h in heap_used} == heap_used
    return True


def _ep_cases():
    """Odd token counts, a member with none, tokens to every node ("random"), to the first node only ("half": the
    other node's members receive nothing), slots without an expert ("masked"), max_recv_tokens dropping rows (5) or
not; sizes changing every step."""
    return [(8, 3, 12, [5, 0, 7, 3], "random", "bfloat16", None, 8),
            (8, 2, 7, [3, 4, 1, 6], "half", "bfloat16", 5, 6),
            (16, 4, 10, [9, 2, 0, 5], "masked", "float32", None, 9),
            (8, 8, 12, [2, 6, 3, 1], "random", "float16", 13, 7)]


def test_ep_ops_on_two_nodes_of_two():
    assert all(run_ranks(_ep_ops, 4, _ep_cases(), env=TWO_NODES, timeout=400))


def _ep_fp8_and_errors(seeds):
    """The fp8 dispatch across nodes bit for bit fp8_rows' bits (test_moe's check), then what a bad call raises."""
    import torch

    import weft
    from test_moe import _ll_fp8_case, _routing

    for seed in seeds:
        _ll_fp8_case(seed, [3, 5, 0, 4], 8, 3, 6)
    me = weft.rank()
    x, idx, wts = _routing(5, 4, 4, 8, 4, 12)[me]
    # A bad row on rank 1 (an expert out of range): every member raises before anything is sent.
    bad = idx.clone()
    if me == 1:
        bad[2, 0] = 8
    with pytest.raises(ValueError, match="another rank" if me != 1 else "names an expert twice or one outside"):
        weft.ops.ep_dispatch(x, bad, wts, 8)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        weft.ops.ep_dispatch_ll(x, idx, 8, 3)
    with pytest.raises(ValueError, match="eagerly only"):
        torch.ops.weft.ep_dispatch(x, idx, wts, 8, weft.world().name)
    # The calls after those work.
    recv, counts, _, handle = weft.ops.ep_dispatch_ll(x, idx, 8, 4)
    # Each token crosses to a node once, however many of that node's experts (4 a node) it names: with k = 4 of
    # 8 experts every token names at least two of one node's.
    for node in range(2):
        once = int(((idx >= 0) & (idx // 4 == node)).any(1).sum())
        assert int((handle.routes.rail_src[node] < x.shape[0]).sum()) == once
    with pytest.raises(TypeError, match="ep_dispatch returned"):
        weft.ops.ep_combine(recv[0], handle)
    with pytest.raises(ValueError, match="expected"):
        weft.ops.ep_combine_ll(recv[:1], idx, wts, handle)
    out = weft.ops.ep_combine_ll(recv, idx, wts, handle)
    assert out.shape == x.shape
    return True


def test_ep_fp8_and_errors_on_two_nodes_of_two():
    assert all(run_ranks(_ep_fp8_and_errors, 4, [3, 4], env=TWO_NODES, timeout=300))


def _gemm_ar(cases):
    """gemm_ar on the world and a group across nodes (hierarchical) and inside a node (flat), every method, the
    output poisoned, against torch; the same bits on every member."""
    import torch
    import torch.distributed as dist

    import weft
    from test_nodes import _node_groups

    w, across, inside = _node_groups()
    for step, (m, k, n, dtype) in enumerate(cases):
        tol = dict(rtol=2e-2, atol=5e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
        for i, group in enumerate((None, across, inside)):
            g = weft.get_group(group)
            gen = torch.Generator().manual_seed(100 * step + i)
            a = torch.randn((g.size, m, k), generator=gen).to(dtype)
            b = torch.randn((g.size, k, n), generator=gen).to(dtype)
            want = sum(a[q].double() @ b[q].double() for q in range(g.size))
            for method in ("auto", "fused", "baseline"):
                out = torch.full((m, n), float("nan"), dtype=dtype)
                got = weft.ops.gemm_ar(a[g.rank], b[g.rank], method=method, out=out, group=group)
                assert got is out
                torch.testing.assert_close(got.double(), want, **tol)
                everyone = [torch.empty_like(got) for _ in range(g.size)]
                dist.all_gather(everyone, got, group=g.process_group)
                assert all(torch.equal(e, got) for e in everyone), (method, g)
            kinds = {type(p.run.__self__).__name__ for key, p in g.plans.items() if key[0] == "gemm_ar"}
            assert ("GemmAr" in kinds) == g.topology.spans_nodes, kinds
    return True


def test_gemm_ar_on_two_nodes_of_two():
    import torch

    cases = [(3, 16, 8, torch.float32), (5, 8, 12, torch.bfloat16), (1, 24, 16, torch.float16)]
    assert all(run_ranks(_gemm_ar, 4, cases, env=TWO_NODES, timeout=300))


@pytest.mark.long  # CI runs the 2 x 2 forms
def test_ep_ops_on_three_nodes_of_two():
    cases = [(12, 3, 10, [4, 0, 5, 3, 2, 6], "random", "bfloat16", None, 6),
             (6, 2, 7, [3, 1, 2, 5, 0, 4], "half", "float32", 31, 5)]
    assert all(run_ranks(_ep_ops, 6, cases, env=TWO_NODES, timeout=600))
