"""The EP dispatch / combine (HT, LL, fp8) and gemm_ar on GPUs over simulated nodes: the rail's all-to-all on NCCL
between nodes (once per target node), the node's all-to-all on NCCL inside it. Run: `weft run -n 4
--local-world-size 2 -m pytest tests/test_gpu_nodes_ep.py -m gpu` (2 nodes of 2), or `-n 2 --local-world-size 1`
(2 nodes of 1: the rail hop alone)."""
import pytest
import torch
import torch.distributed as dist

import weft
from weft.kernels.pointwise import fp8_rows_torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world(gpu_world):
    return gpu_world


def _inputs(seed, tokens, experts, k, hidden, dtype):
    """Every member's (x, topk_idx, topk_weights), the same on every rank: k distinct experts a token, some slots
    -1; tokens[r] tokens on member r."""
    gen = torch.Generator("cuda").manual_seed(seed)
    out = []
    for t in tokens:
        x = torch.randn((t, hidden), generator=gen, device="cuda").to(dtype)
        idx = torch.rand((t, experts), generator=gen, device="cuda").argsort(dim=1)[:, :k]
        idx[torch.rand((t, k), generator=gen, device="cuda") < 0.2] = -1
        out.append((x, idx, torch.rand((t, k), generator=gen, device="cuda")))
    return out


def _received(inputs, me, local):
    """What member `me` receives, by source rank then token: (x, topk_idx as my local experts, weights)."""
    xs, idxs, ws = [], [], []
    for x, idx, wts in inputs:
        mine = (idx >= 0) & (idx // local == me)
        keep = mine.any(1)
        xs.append(x[keep])
        idxs.append(torch.where(mine, idx - me * local, -1)[keep])
        ws.append(wts[keep])
    return torch.cat(xs), torch.cat(idxs), torch.cat(ws)


def _expert(x, e):
    """Expert e's output for rows x: a scale (any row alone gives the same bits)."""
    return (x.float() * ((e + 1) / 8)).to(x.dtype)


def _combined(x, idx, wts):
    """sum_j w_j * expert(idx_j)(x) in fp32."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(idx.shape[1]):
        e = idx[:, j]
        acc += torch.where((e >= 0)[:, None], wts[:, j, None] * x.float() * ((e.clamp(min=0) + 1) / 8)[:, None], 0.0)
    return acc


def _ll_round(world, seed, tokens, experts, k, hidden, max_tokens, fp8=False, check_dispatch=True):
    """One ep_dispatch_ll + ep_combine_ll on the world; returns (out, the reference) after the dispatch's checks."""
    me, local = world.rank, experts // world.world_size
    inputs = _inputs(seed, tokens, experts, k, hidden, torch.bfloat16)
    x, idx, wts = inputs[me]
    recv, counts, scales, handle = weft.ops.ep_dispatch_ll(x, idx, experts, max_tokens, fp8=fp8)
    if check_dispatch:
        ex, ei, _ = _received(inputs, me, local)
        want = torch.tensor([int((ei == e).any(1).sum()) for e in range(local)], dtype=torch.int32, device="cuda")
        assert torch.equal(counts, want)
        for e in range(local):
            rows = ex[(ei == e).any(1)]
            n = rows.shape[0]
            if fp8:
                q, s = fp8_rows_torch(rows)
                assert torch.equal(recv[e, :n].view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(scales[e, :n], s)
            else:
                assert torch.equal(recv[e, :n], rows)
    if fp8:
        recv = (recv.float().reshape(local, -1, hidden // 128, 128) * scales[..., None]).reshape(recv.shape)
        recv = recv.to(torch.bfloat16)
    y = torch.stack([_expert(recv[e], me * local + e) for e in range(local)])
    return weft.ops.ep_combine_ll(y, idx, wts, handle), _combined(x, idx, wts)


def test_ep_ll_across_simulated_nodes(world):
    assert world.topology.spans_nodes, "run with --local-world-size smaller than -n"
    size = world.world_size
    for step, (tokens, experts, k, hidden, max_tokens) in enumerate((
            ([5, 0, 7, 3, 1, 4, 2, 6][:size], 8 * size, 4, 7168, 8),   # DeepSeek-V3's hidden, a member with none
            ([64] * size, 4 * size, 8, 1024, 64),
            ([1, 3, 2, 5, 4, 6, 7, 8][:size], 2 * size, 2, 129, 9))):   # an odd hidden
        out, want = _ll_round(world, 100 + step, tokens, experts, k, hidden, max_tokens)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    out, want = _ll_round(world, 7, [16] * size, 4 * size, 4, 512, 16, fp8=True)
    torch.testing.assert_close(out.float(), want, rtol=0.15, atol=0.15)
    plans = [key[0] for key in world.plans if str(key[0]).startswith("ep")]
    assert plans and all(name.endswith("_nodes") for name in plans)


def test_ep_ht_across_simulated_nodes(world):
    size, me = world.world_size, world.rank
    for step, (tokens, experts, k, hidden, max_recv) in enumerate((
            ([300, 0, 257, 31, 8, 99, 1, 64][:size], 8 * size, 8, 7168, None),
            ([33] * size, 2 * size, 2, 130, 40))):   # max_recv_tokens dropping rows on some members
        local = experts // size
        inputs = _inputs(200 + step, tokens, experts, k, hidden, torch.bfloat16)
        x, idx, wts = inputs[me]
        rx, ri, rw, counts, handle = weft.ops.ep_dispatch(x, idx, wts, experts, max_recv_tokens=max_recv)
        ex, ei, ew = _received(inputs, me, local)
        n = ex.shape[0] if max_recv is None else min(ex.shape[0], max_recv)
        assert rx.shape[0] == (ex.shape[0] if max_recv is None else max_recv)
        assert torch.equal(rx[:n], ex[:n]) and torch.equal(ri[:n], ei[:n]) and torch.equal(rw[:n], ew[:n])
        want_counts = torch.stack([(ei[:n] == e).sum() for e in range(local)]).to(torch.int32)
        assert torch.equal(counts, want_counts)
        acc = torch.zeros(rx.shape, dtype=torch.float32, device="cuda")
        for e in range(local):  # each received row's weighted sum over my experts
            acc += (rw * (ri == e)).sum(1, keepdim=True) * _expert(rx, me * local + e).float()
        y = acc.to(rx.dtype)
        out = weft.ops.ep_combine(y, handle)
        if max_recv is None:
            torch.testing.assert_close(out.float(), _combined(x, idx, wts), rtol=3e-2, atol=3e-2)
        else:
            assert out.shape == x.shape and torch.isfinite(out).all()


def test_ep_ll_many_calls(world):
    """~1000 LL dispatch + combine calls back to back, sizes changing, every result checked (on the device, read
    every 100 calls)."""
    size = world.world_size
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for call in range(1000):
        tokens = [(call * 7 + 3 * r) % 13 for r in range(size)]
        out, want = _ll_round(world, 1000 + call, tokens, 4 * size, 3, 256, 16, check_dispatch=call % 100 == 0)
        bad += (~torch.isclose(out.float(), want, rtol=2e-2, atol=2e-2)).sum()
        if call % 100 == 99:
            assert bad.item() == 0, f"wrong elements by call {call}"
    dist.barrier()


def test_gemm_ar_across_simulated_nodes(world):
    size, me = world.world_size, world.rank
    gen = torch.Generator("cuda").manual_seed(31)
    for m, k, n in ((1, 1024, 4096), (7, 512, 1000), (128, 256, 512)):
        a = torch.randn((size, m, k), generator=gen, device="cuda").to(torch.bfloat16)
        b = torch.randn((size, k, n), generator=gen, device="cuda").to(torch.bfloat16)
        partials = [a[q].float() @ b[q].float() for q in range(size)]
        ulp = max(p.abs().max() for p in partials).item() * 2.0 ** -8
        for method in ("auto", "fused", "baseline"):
            got = weft.ops.gemm_ar(a[me], b[me], method=method)
            torch.testing.assert_close(got.float(), sum(partials), rtol=2e-2, atol=size * ulp)
            everyone = [torch.empty_like(got) for _ in range(size)]
            dist.all_gather(everyone, got)
            assert all(torch.equal(e, got) for e in everyone), method
