"""MoE on GPUs at DeepSeek-V3 decode/prefill sizes (hidden 7168, 128 tokens per rank, top-8 of 256 experts),
the TP-MoE ops at Qwen3-30B-A3B sizes and the MoE layers against a Hugging Face block,
against the torch reference of the routing: `WEFT_WORKSPACE_BYTES=1GiB weft run -n N -m pytest
tests/test_gpu_moe.py -m gpu` (scripts/gpu_suite.sh moe)."""
import os

import pytest
import torch

import weft
from weft.testing.graphs import capture

pytestmark = pytest.mark.gpu

HIDDEN, TOKENS, K, EXPERTS = 7168, 128, 8, 256


@pytest.fixture(scope="module", autouse=True)
def world():
    os.environ.setdefault("WEFT_WORKSPACE_BYTES", str(1 << 30))  # LL at 8 ranks needs ~160 MiB of it
    # Every family used here takes a 1 GiB workspace (EP, TP-MoE, and the TP-MoE baseline's all_gather and
    # reduce_scatter), with their flags and error words: what scripts/gpu_suite.sh gives it, 8 GiB.
    os.environ.setdefault("WEFT_HEAP_SIZE", str(8 << 30))
    weft.init()
    yield weft.world()


def _routing(seed, tokens=TOKENS):
    """Every rank's (x, topk_idx, topk_weights), the same on every rank."""
    w = weft.world()
    g = torch.Generator(device=w.device).manual_seed(seed)
    x = torch.randn(w.world_size, tokens, HIDDEN, device=w.device, generator=g).to(torch.bfloat16)
    idx = torch.rand(w.world_size, tokens, EXPERTS, device=w.device, generator=g).topk(K, dim=-1).indices
    wts = torch.rand(w.world_size, tokens, K, device=w.device, generator=g)
    return x, idx, wts


def _expert_out(x, e):
    return (x.float() * ((e + 1) / 64)).to(torch.bfloat16)


def _reference(x, idx, wts):
    """Rows this rank receives (by source, then token): x, local idx (-1 elsewhere), weights; counts."""
    w = weft.world()
    local = EXPERTS // w.world_size
    xa, ia, wa = x.reshape(-1, HIDDEN), idx.reshape(-1, K), wts.reshape(-1, K)
    mine = ia // local == w.rank
    rows = mine.any(1)
    ri = torch.where(mine, ia - w.rank * local, -1)[rows]
    counts = torch.stack([(ri == e).any(1).sum() for e in range(local)]).int()
    return xa[rows], ri, wa[rows], counts


def _weighted(x, idx, wts, first):
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(idx.shape[1]):
        for e in idx[:, j].unique().tolist():
            if e >= 0:
                sel = idx[:, j] == e
                acc[sel] += wts[sel, j:j + 1] * _expert_out(x[sel], first + e).float()
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("max_recv", [None, "fixed"])
def test_ep_dispatch_combine(max_recv):
    w = weft.world()
    local = EXPERTS // w.world_size
    for seed in range(3):
        x, idx, wts = _routing(seed)
        me = w.rank
        cap = w.world_size * TOKENS if max_recv else None
        rx, ri, rw, counts, handle = weft.ops.ep_dispatch(x[me], idx[me], wts[me], EXPERTS, max_recv_tokens=cap)
        out = weft.ops.ep_combine(_weighted(rx, ri, rw, me * local), handle)
        _check_ht(x, idx, wts, rx, ri, rw, counts, out, seed)


def _check_ht(x, idx, wts, rx, ri, rw, counts, out, note):
    """An HT dispatch's received rows, routing and counts bit-exact against the reference, and its combine
    (of each rank's weighted local-expert outputs) against the sum over the token's ranks."""
    w = weft.world()
    me, local = w.rank, EXPERTS // w.world_size
    ex, ei, ew, ec = _reference(x, idx, wts)
    n = ex.shape[0]
    assert torch.equal(rx[:n], ex) and torch.equal(ri[:n], ei) and torch.equal(rw[:n], ew), note
    assert torch.equal(counts, ec), note
    acc = torch.zeros(x.shape[1], HIDDEN, device=w.device)
    for r in range(w.world_size):
        on_r = idx[me] // local == r
        part = _weighted(x[me], torch.where(on_r, idx[me] - r * local, -1), wts[me], r * local)
        acc += torch.where(on_r.any(1, keepdim=True), part.float(), 0.0)
    assert torch.equal(out, acc.to(torch.bfloat16)), note


def _check_ll(x, idx, wts, recv, counts, out):
    w = weft.world()
    local = EXPERTS // w.world_size
    ex, ei, _, ec = _reference(x, idx, wts)
    assert torch.equal(counts, ec)
    for e in range(local):
        want = ex[(ei == e).any(1)]
        assert torch.equal(recv[e, :want.shape[0]], want), e
    want = _weighted(x[w.rank], idx[w.rank], wts[w.rank], 0)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)


def _ll_expert_outputs(recv):
    w = weft.world()
    local = EXPERTS // w.world_size
    scale = ((w.rank * local + torch.arange(local, device=w.device) + 1) / 64).view(-1, 1, 1)
    return (recv.float() * scale).to(torch.bfloat16)


def test_ep_any_layout():
    """The EP ops on what torch takes beyond the fast path: 16-bit rows of odd length given as a strided view,
    fp32 rows; bit for bit against the same calls on the contiguous bf16 rows (checked against torch above)."""
    w = weft.world()
    me = w.rank
    x, idx, wts = _routing(50)
    odd = x[me][:, :HIDDEN - 1]  # not contiguous, rows of 7167 bf16: not whole 4-byte words
    recv, counts, _, handle = weft.ops.ep_dispatch_ll(x[me], idx[me], EXPERTS, TOKENS)
    out = weft.ops.ep_combine_ll(_ll_expert_outputs(recv), idx[me], wts[me], handle)
    for rows in (odd, x[me].float()):
        got, got_counts, _, h = weft.ops.ep_dispatch_ll(rows, idx[me], EXPERTS, TOKENS)
        assert torch.equal(got_counts, counts)
        for e, m in enumerate(counts.tolist()):
            assert torch.equal(got[e, :m], recv[e, :m, :rows.shape[1]].to(rows.dtype)), e
        y = (_ll_expert_outputs(got.to(torch.bfloat16)) if rows.dtype == torch.bfloat16
             else _ll_expert_outputs(got).float())
        back = weft.ops.ep_combine_ll(y, idx[me], wts[me], h)
        if rows.dtype == torch.bfloat16:
            assert torch.equal(back, out[:, :rows.shape[1]])
        else:
            torch.testing.assert_close(back, out.float(), rtol=1e-2, atol=1e-2)
    rx, ri, rw, counts, handle = weft.ops.ep_dispatch(x[me], idx[me], wts[me], EXPERTS)
    out = weft.ops.ep_combine(_weighted(rx, ri, rw, me * EXPERTS // w.world_size), handle)
    got, gi, gw, got_counts, h = weft.ops.ep_dispatch(odd, idx[me].t().contiguous().t(), wts[me], EXPERTS)
    assert torch.equal(got, rx[:, :HIDDEN - 1]) and torch.equal(gi, ri) and torch.equal(gw, rw)
    assert torch.equal(got_counts, counts)
    back = weft.ops.ep_combine(_weighted(got, gi, gw, me * EXPERTS // w.world_size), h)
    assert torch.equal(back, out[:, :HIDDEN - 1])


def test_ep_ll():
    w = weft.world()
    for seed in range(4):
        x, idx, wts = _routing(10 + seed)
        me = w.rank
        recv, counts, _, handle = weft.ops.ep_dispatch_ll(x[me], idx[me], EXPERTS, TOKENS)
        out = weft.ops.ep_combine_ll(_ll_expert_outputs(recv), idx[me], wts[me], handle)
        _check_ll(x, idx, wts, recv, counts, out)


def test_ep_ll_fp8():
    from weft.testing.reference import fp8_rows_ref

    w = weft.world()
    local = EXPERTS // w.world_size
    for seed in range(2):
        x, idx, wts = _routing(30 + seed)
        me = w.rank
        recv, counts, scales, handle = weft.ops.ep_dispatch_ll(x[me], idx[me], EXPERTS, TOKENS, fp8=True)
        ex, ei, _, ec = _reference(x, idx, wts)
        assert torch.equal(counts, ec)
        for e in range(local):
            want = ex[(ei == e).any(1)]
            q, scale = fp8_rows_ref(want)  # the same quantization, bit for bit
            n = want.shape[0]
            assert torch.equal(scales[e, :n], scale), e
            assert torch.equal(recv[e, :n].view(torch.uint8), q.view(torch.uint8)), e


def test_ep_ll_cuda_graph():
    w = weft.world()
    me = w.rank
    x, idx, wts = _routing(20)
    sx, si, sw = x[me].clone(), idx[me].clone(), wts[me].clone()
    weft.ops.check_routing_values(si, EXPERTS)
    res = {}

    def step():
        recv, counts, _, handle = weft.ops.ep_dispatch_ll(sx, si, EXPERTS, TOKENS)
        res.update(recv=recv, counts=counts, out=weft.ops.ep_combine_ll(_ll_expert_outputs(recv), si, sw, handle))

    step()  # workspace and plans outside capture
    g = capture(step)
    for seed in range(21, 25):
        x, idx, wts = _routing(seed)
        sx.copy_(x[me])
        si.copy_(idx[me])
        sw.copy_(wts[me])
        g.replay()
        _check_ll(x, idx, wts, res["recv"], res["counts"], res["out"])


@pytest.mark.parametrize("graph", [False, True])
def test_ep_ll_recv_hook(graph):
    """return_recv_hook: each op's send, a GEMM queued while the rows travel, then its receive; eagerly and
    replayed from a CUDA graph, outputs poisoned before each run."""
    w = weft.world()
    me = w.rank
    x, idx, wts = _routing(40)
    sx, si, sw = x[me].clone(), idx[me].clone(), wts[me].clone()
    a = torch.randn(2048, 2048, device=w.device, dtype=torch.bfloat16)
    res = {}

    def step():
        recv, counts, _, handle, receive = weft.ops.ep_dispatch_ll(sx, si, EXPERTS, TOKENS, return_recv_hook=True)
        res["busy"] = a @ a
        receive()
        out, receive = weft.ops.ep_combine_ll(_ll_expert_outputs(recv), si, sw, handle, return_recv_hook=True)
        res["busy"] = a @ a
        receive()
        res.update(recv=recv, counts=counts, out=out)

    step()  # workspace and plans outside capture
    g = capture(step) if graph else None
    for seed in range(41, 45):
        x, idx, wts = _routing(seed)
        sx.copy_(x[me])
        si.copy_(idx[me])
        sw.copy_(wts[me])
        if g is None:
            step()
        else:
            for t in ("recv", "out"):
                res[t].fill_(float("nan"))
            res["counts"].fill_(-1)
            g.replay()
        _check_ll(x, idx, wts, res["recv"], res["counts"], res["out"])


def test_bad_row_raises_at_the_next_call():
    """A row naming an expert twice, on rank 0: the LL dispatch records it on the device with no sync, and rank
    0's next EP call (once the kernel has run) raises naming topk_idx, the row and the expert; the exact-size
    HT dispatch raises on every rank before pushing; valid calls work after both."""
    w = weft.world()
    me = w.rank
    x, idx, wts = _routing(70)
    bad = idx[me].clone()
    bad[5, 3] = bad[5, 0]
    want = f"topk_idx row 5 names expert {int(bad[5, 0])} twice"
    raised = None
    try:
        weft.ops.ep_dispatch_ll(x[me], bad if me == 0 else idx[me], EXPERTS, TOKENS)
        torch.cuda.synchronize()
        if me == 0:
            weft.ops.ep_dispatch_ll(x[me], idx[me], EXPERTS, TOKENS)  # raises on entry: nothing launched
    except ValueError as e:
        raised = str(e)
    assert (raised is not None) == (me == 0) and (raised is None or want in raised), raised
    weft.barrier()
    with pytest.raises(ValueError, match=want if me == 0 else "topk_idx on another rank"):
        weft.ops.ep_dispatch(x[me], bad if me == 0 else idx[me], wts[me], EXPERTS)
    recv, counts, _, handle = weft.ops.ep_dispatch_ll(x[me], idx[me], EXPERTS, TOKENS)
    out = weft.ops.ep_combine_ll(_ll_expert_outputs(recv), idx[me], wts[me], handle)
    _check_ll(x, idx, wts, recv, counts, out)


def test_eager_calls_changing_sizes():
    """Back-to-back eager calls with new routing and token counts each time (LL, HT exact and fixed-size): right
    results, and no heap allocation or host barrier once the workspace exists."""
    w = weft.world()
    me = w.rank
    local = EXPERTS // w.world_size
    used, barriers = None, None
    for seed, tokens in enumerate((128, 1, 77, 128, 3, 64)):
        x, idx, wts = _routing(80 + seed, tokens)
        recv, counts, _, handle = weft.ops.ep_dispatch_ll(x[me], idx[me], EXPERTS, TOKENS)
        out = weft.ops.ep_combine_ll(_ll_expert_outputs(recv), idx[me], wts[me], handle)
        cap = w.world_size * tokens if seed % 2 else None
        rx, ri, rw, ht_counts, ht_handle = weft.ops.ep_dispatch(x[me], idx[me], wts[me], EXPERTS, max_recv_tokens=cap)
        ht_out = weft.ops.ep_combine(_weighted(rx, ri, rw, me * local), ht_handle)
        _check_ll(x, idx, wts, recv, counts, out)
        _check_ht(x, idx, wts, rx, ri, rw, ht_counts, ht_out, seed)
        if used is None:
            used, barriers = w.heap.used, w.barriers
        assert (w.heap.used, w.barriers) == (used, barriers), seed


@pytest.mark.parametrize("experts,cap,k,n,dtype,tma", [
    (32, 256, HIDDEN, 2048, torch.bfloat16, True),  # the bench shape
    (6, 200, 768, 2048, torch.bfloat16, True),  # row blocks that reach into the next expert
    (8, 96, 512, 384, torch.float16, True),  # "skinny" tiles; N not whole 256-column blocks
    (4, 130, 256, 200, torch.float32, True),  # tf32
    (5, 100, 520, 256, torch.bfloat16, False),  # K not whole 64-row blocks: pointer kernel
    (5, 100, 256, 2047, torch.bfloat16, False),  # N rows not whole 16 bytes: pointer kernel
])
def test_grouped_gemm_against_matmul(experts, cap, k, n, dtype, tma):
    """Both kernels against torch.matmul over empty, one-row, partial and full experts, with NaN in the rows
    past the counts (must not leak into the rows under them), a call per fresh input and one graph replay."""
    from weft.kernels.moe.grouped_gemm import grouped_config, tma_refusal

    w = weft.world()
    g = torch.Generator(device=w.device).manual_seed(experts * cap + n)
    x = torch.randn(experts, cap, k, device=w.device, generator=g).to(dtype)
    wt = (torch.randn(experts, k, n, device=w.device, generator=g) / k ** 0.5).to(dtype)
    assert (tma_refusal(x, wt, grouped_config(cap, dtype, w.device, True).block_k) is None) == tma
    res = {}
    for call in range(3):
        counts = torch.randint(0, cap + 1, (experts,), device=w.device, dtype=torch.int32, generator=g)
        counts[0], counts[1], counts[-1] = 0, 1, cap if call else cap - 1
        xs = x.clone()
        for e, m in enumerate(counts.tolist()):
            xs[e, m:] = float("nan")
        if call < 2:
            out = weft.ops.grouped_gemm(xs, wt, counts)
        else:  # a graph replayed on new inputs in the same buffers
            sx, sc = xs.clone(), counts.clone()
            graph = capture(lambda: res.update(out=weft.ops.grouped_gemm(sx, wt, sc)))
            sx.copy_(xs)
            sc.copy_(counts)
            graph.replay()
            out = res["out"]
        for e, m in enumerate(counts.tolist()):
            torch.testing.assert_close(out[e, :m], torch.matmul(xs[e, :m], wt[e]), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("experts,cap,k,n,config", [
    (32, 256, HIDDEN, 2048, None),  # the bench shape
    (6, 200, 768, 2048, None),  # row blocks that reach into the next expert
    (8, 96, 2048, 200, None),  # N past one scale block and not whole tiles
    (5, 100, 512, 384, (128, 128, 64, 8, 4, 8, False)),  # two K slices per scale block
    (4, 64, 256, 300, None),  # output rows not whole 16 bytes: pointer stores
    (7, 300, 1024, 640, (128, 128, 128, 8, 4, 8, True)),  # 8 warps, flattened, a program per SM
])
def test_fp8_grouped_gemm_against_dequantized(experts, cap, k, n, config):
    """fp8 with block scales against the product of the dequantized operands, NaN past the counts, the weight
    scales as a transposed view (DeepSeek-V3's layout), a call per fresh input and one graph replay."""
    from weft.kernels.gemm import GemmConfig

    w = weft.world()
    g = torch.Generator(device=w.device).manual_seed(experts * cap + n + 1)
    cfg = None if config is None else GemmConfig(*config)
    wq, ws = weft.ops.fp8_blocks((torch.randn(experts, k, n, device=w.device, generator=g) / k ** 0.5)
                                 .to(torch.bfloat16))
    ws = ws.transpose(1, 2).contiguous().transpose(1, 2)
    wd = wq.float() * ws.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :, :n]
    res = {}
    for call in range(3):
        xq, xs = weft.ops.fp8_rows(torch.randn(experts, cap, k, device=w.device, generator=g).to(torch.bfloat16))
        counts = torch.randint(0, cap + 1, (experts,), device=w.device, dtype=torch.int32, generator=g)
        counts[0], counts[1], counts[-1] = 0, 1, cap if call else cap - 1
        xd = xq.float() * xs.repeat_interleave(128, -1)
        for e, m in enumerate(counts.tolist()):
            xq[e, m:] = float("nan")
            xs[e, m:] = float("nan")
        if call < 2:
            out = weft.ops.grouped_gemm(xq, wq, counts, cfg, xs, ws)
        else:  # a graph replayed on new inputs in the same buffers
            sx, ss, sc = xq.clone(), xs.clone(), counts.clone()
            graph = capture(lambda: res.update(out=weft.ops.grouped_gemm(sx, wq, sc, cfg, ss, ws)))
            sx.copy_(xq)
            ss.copy_(xs)
            sc.copy_(counts)
            graph.replay()
            out = res["out"]
        for e, m in enumerate(counts.tolist()):
            torch.testing.assert_close(out[e, :m].float(), xd[e, :m] @ wd[e], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens, experts, k", [(128, 128, 8), (8192, 128, 8), (4096, 256, 8), (333, 8, 2)])
def test_router_topk_matches_torch(tokens, experts, k):
    """router_topk against torch's softmax, topk and division: fp32 logits the same experts in the same order;
    bf16 logits (which tie) the same weights in order; one call replayed from a CUDA graph."""
    from weft.kernels.moe import router_topk_torch

    w = weft.world()
    g = torch.Generator(device=w.device).manual_seed(41)
    logits = torch.randn(tokens, experts, device=w.device, generator=g) * 2
    idx, wts = weft.ops.router_topk(logits, k)
    ref_idx, ref_wts = router_topk_torch(logits, k)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(wts, ref_wts, rtol=1e-5, atol=1e-6)
    half = logits.to(torch.bfloat16)
    res = {}
    graph = capture(lambda: res.update(got=weft.ops.router_topk(half, k, False)))
    half.copy_((logits * 1.5).to(torch.bfloat16))
    graph.replay()
    ref_idx, ref_wts = router_topk_torch(half, k, False)
    torch.testing.assert_close(res["got"][1], ref_wts, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.gather(half.float(), 1, res["got"][0]), torch.gather(half.float(), 1, ref_idx))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_and_fp8_rows_match_torch(dtype):
    """silu_mul (whole, over each expert's counts, fused with fp8) and fp8_rows against their torch forms (the fp8
    conversions bit for bit), at EPMoE's decode buffer (experts x W 128 rows x 2 inter); rows past the counts
    hold NaN, which must not reach a valid row; one call replayed from a CUDA graph on new values."""
    from weft.kernels.pointwise import fp8_rows_torch, silu_mul_torch

    w = weft.world()
    g = torch.Generator(device=w.device).manual_seed(40)
    e, cap, n = 64, 128 * w.world_size, 768
    res = {}
    for call in range(3):
        h = (torch.randn(e, cap, 2 * n, device=w.device, generator=g) * 3).to(dtype)
        counts = torch.randint(0, 40, (e,), device=w.device, dtype=torch.int32, generator=g)
        counts[0], counts[1] = 0, cap
        for i, m in enumerate(counts.tolist()):
            h[i, m:] = float("nan")
        if call < 2:
            got = (weft.ops.silu_mul(h, counts), *weft.ops.silu_mul(h, counts, fp8=True), *weft.ops.fp8_rows(h, counts))
        else:
            sh, sc = h.clone(), counts.clone()
            graph = capture(lambda: res.update(got=(weft.ops.silu_mul(sh, sc), *weft.ops.silu_mul(sh, sc, fp8=True),
                                                    *weft.ops.fp8_rows(sh, sc))))
            sh.copy_(h)
            sc.copy_(counts)
            graph.replay()
            got = res["got"]
        whole = weft.ops.silu_mul(h)
        for i, m in enumerate(counts.tolist()):
            # SiLU's exp differs from torch's in the last bits of fp32: close; the quantization bit for bit.
            torch.testing.assert_close(whole[i, :m], silu_mul_torch(h[i, :m]), rtol=1e-5 if dtype == torch.float32
                                       else 1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2)
            want = (whole[i, :m], *fp8_rows_torch(whole[i, :m]), *fp8_rows_torch(h[i, :m]))
            for a, b in zip(got, want):
                a = a[i, :m]
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                   b.view(torch.uint8) if b.element_size() == 1 else b), (call, i)


def test_ep_ll_fp8_into_grouped_gemm():
    """The fp8 dispatch's rows and scales straight into the fp8 grouped GEMM, against the dequantized product
    of the reference rows (DeepSeek-V3's decode: fp8 dispatch, fp8 experts)."""
    w = weft.world()
    local = EXPERTS // w.world_size
    x, idx, wts = _routing(35)
    me = w.rank
    g = torch.Generator(device=w.device).manual_seed(36 + me)
    wq, ws = weft.ops.fp8_blocks((torch.randn(local, HIDDEN, 512, device=w.device, generator=g) / 85)
                                 .to(torch.bfloat16))
    wd = wq.float() * ws.repeat_interleave(128, 1).repeat_interleave(128, 2)
    recv, counts, scales, _ = weft.ops.ep_dispatch_ll(x[me], idx[me], EXPERTS, TOKENS, fp8=True)
    out = weft.ops.grouped_gemm(recv, wq, counts, x_scales=scales, w_scales=ws)
    ex, ei, _, _ = _reference(x, idx, wts)
    for e in range(local):
        q, s = weft.ops.fp8_rows(ex[(ei == e).any(1)])
        want = (q.float() * s.repeat_interleave(128, -1)) @ wd[e]
        torch.testing.assert_close(out[e, :want.shape[0]].float(), want, rtol=2e-2, atol=2e-2)


# -- tensor-parallel MoE -------------------------------------------------------------------------------

TP_HIDDEN, TP_EXPERTS, TP_K, TP_INTER = 2048, 128, 8, 768  # Qwen3-30B-A3B's MoE block


def _tp_case(seed, m):
    """Every rank's tokens, routing and weights (the same on every rank); this rank's weight slices."""
    w = weft.world()
    g = torch.Generator(device=w.device).manual_seed(seed)
    ws, n = w.world_size, TP_INTER // w.world_size
    x = torch.randn(ws, m, TP_HIDDEN, device=w.device, generator=g).to(torch.bfloat16)
    idx = torch.rand(ws, m, TP_EXPERTS, device=w.device, generator=g).topk(TP_K, dim=-1).indices
    wts = torch.rand(ws, m, TP_K, device=w.device, generator=g)
    w_gu = (torch.randn(TP_EXPERTS, TP_HIDDEN, 2 * n, device=w.device, generator=g) / 45).to(torch.bfloat16)
    w_dn = (torch.randn(ws, TP_EXPERTS, n, TP_HIDDEN, device=w.device, generator=g) / 20).to(torch.bfloat16)
    h = torch.randn(ws, ws * m * TP_K, n, device=w.device, generator=g).to(torch.bfloat16)
    return x, idx, wts, w_gu, w_dn, h


def _tp_reference(x, idx, wts, w_gu, w_dn, h, layout):
    """(inter of every pair, by global pair index; my tokens' group_gemm_rs output), by expert in torch."""
    w = weft.world()
    ws, m = x.shape[0], x.shape[1]
    xa, ia = x.reshape(-1, TP_HIDDEN), idx.reshape(-1)
    inter = torch.empty(ia.shape[0], w_gu.shape[2], dtype=torch.bfloat16, device=w.device)
    for e in range(TP_EXPERTS):
        sel = (ia == e).nonzero().squeeze(1)
        inter[sel] = xa[sel // TP_K] @ w_gu[e]
    rows = layout.row_of_pair.reshape(-1).long()  # pair -> row of h
    total = torch.zeros(m, TP_HIDDEN, device=w.device)
    mine = torch.arange(w.rank * m * TP_K, (w.rank + 1) * m * TP_K, device=w.device)
    for q in range(ws):
        y = torch.empty(mine.shape[0], TP_HIDDEN, dtype=torch.bfloat16, device=w.device)
        for e in range(TP_EXPERTS):
            sel = (ia[mine] == e).nonzero().squeeze(1)
            y[sel] = h[q][rows[mine[sel]]] @ w_dn[q, e]
        part = (y.float() * wts[w.rank].reshape(-1, 1)).reshape(m, TP_K, TP_HIDDEN).sum(1)
        total += part.to(torch.bfloat16).float()
    return inter, total


@pytest.mark.parametrize("method", ["overlap", "baseline"])
def test_ag_group_gemm_and_group_gemm_rs(method):
    w = weft.world()
    me = w.rank
    for seed, m in ((40, 512), (41, 300)):  # 300: segments that end mid-block
        x, idx, wts, w_gu, w_dn, h = _tp_case(seed, m)
        inter, layout = weft.ops.ag_group_gemm(x[me], w_gu, idx[me], method=method)
        out = weft.ops.group_gemm_rs(h[me], w_dn[me], idx[me], wts[me], layout, method=method)
        want_inter, want_out = _tp_reference(x, idx, wts, w_gu, w_dn, h, layout)
        got_inter = inter[layout.row_of_pair.reshape(-1).long()]
        torch.testing.assert_close(got_inter.float(), want_inter.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.float(), want_out, rtol=3e-2, atol=3e-2)


def test_moe_tp_cuda_graph():
    w = weft.world()
    me = w.rank
    x, idx, wts, w_gu, w_dn, h = _tp_case(50, 256)
    sx, si, sw, sh = x[me].clone(), idx[me].clone(), wts[me].clone(), h[me].clone()
    weft.ops.check_routing_values(si, TP_EXPERTS)
    res = {}

    def step():
        inter, layout = weft.ops.ag_group_gemm(sx, w_gu, si)
        res.update(inter=inter, layout=layout, out=weft.ops.group_gemm_rs(sh, w_dn[me], si, sw, layout))

    step()  # workspace and plans outside capture
    g = capture(step)
    for seed in range(51, 54):
        x, idx, wts, _, _, h = _tp_case(seed, 256)
        sx.copy_(x[me])
        si.copy_(idx[me])
        sw.copy_(wts[me])
        sh.copy_(h[me])
        g.replay()
        want_inter, want_out = _tp_reference(x, idx, wts, w_gu, w_dn, h, res["layout"])
        got_inter = res["inter"][res["layout"].row_of_pair.reshape(-1).long()]
        torch.testing.assert_close(got_inter.float(), want_inter.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(res["out"].float(), want_out, rtol=3e-2, atol=3e-2)


def test_moe_tp_bad_row_raises_at_the_next_call():
    """A row naming an expert twice, on rank 0: ag_group_gemm checks it on the device with no sync, and rank 0's
    call raises (once the check has run: that call's end, or its next call of the family, on entry, before
    launching anything) naming topk_idx, the row and the expert; no other rank raises; valid calls work after."""
    w = weft.world()
    me = w.rank
    x, idx, wts, w_gu, w_dn, h = _tp_case(45, 128)
    bad = idx[me].clone()
    bad[5, 3] = bad[5, 0]
    want = f"topk_idx row 5 names expert {int(bad[5, 0])} twice"
    raised = None
    try:
        weft.ops.ag_group_gemm(x[me], w_gu, bad if me == 0 else idx[me], method="overlap")
        torch.cuda.synchronize()
        if me == 0:
            weft.ops.group_gemm_rs(h[me], w_dn[me], idx[me], wts[me], method="overlap")  # raises on entry
    except ValueError as e:
        raised = str(e)
    assert (raised is not None) == (me == 0) and (raised is None or want in raised), raised
    weft.barrier()  # every rank launched one call: in step
    for method in ("overlap", "baseline"):
        inter, layout = weft.ops.ag_group_gemm(x[me], w_gu, idx[me], method=method)
        out = weft.ops.group_gemm_rs(h[me], w_dn[me], idx[me], wts[me], layout, method=method)
        want_inter, want_out = _tp_reference(x, idx, wts, w_gu, w_dn, h, layout)
        torch.testing.assert_close(inter[layout.row_of_pair.reshape(-1).long()].float(), want_inter.float(),
                                   rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.float(), want_out, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("method", ["overlap", "baseline"])
def test_moe_tp_eager_calls_queue_without_sync(method):
    """Eager calls of both ops (group_gemm_rs with and without a layout) make no host sync: none that torch
    sees (sync debug mode "error"), and they return while the GPU is still busy with work queued before them."""
    w = weft.world()
    me = w.rank
    x, idx, wts, w_gu, w_dn, h = _tp_case(46, 256)
    inter, layout = weft.ops.ag_group_gemm(x[me], w_gu, idx[me], method=method)  # plans made outside the check
    weft.ops.group_gemm_rs(h[me], w_dn[me], idx[me], wts[me], layout, method=method)
    weft.ops.group_gemm_rs(h[me], w_dn[me], idx[me], wts[me], method=method)
    torch.cuda.synchronize()
    weft.barrier()
    torch.cuda._sleep(1 << 30)  # ~0.5 s of GPU time queued first: the calls must return before it ends
    queued = torch.cuda.Event()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inter, layout = weft.ops.ag_group_gemm(x[me], w_gu, idx[me], method=method)
        out = weft.ops.group_gemm_rs(h[me], w_dn[me], idx[me], wts[me], layout, method=method)
        again = weft.ops.group_gemm_rs(h[me], w_dn[me], idx[me], wts[me], method=method)
        queued.record()
        still_busy = not queued.query()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert still_busy, "the calls waited for the GPU"
    want_inter, want_out = _tp_reference(x, idx, wts, w_gu, w_dn, h, layout)
    torch.testing.assert_close(inter[layout.row_of_pair.reshape(-1).long()].float(), want_inter.float(), rtol=2e-2,
                               atol=2e-2)
    torch.testing.assert_close(out.float(), want_out, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(again.float(), want_out, rtol=3e-2, atol=3e-2)


def test_routed_gemm_local_and_without_sync():
    """routed_gemm + routed_gemm_sum on this rank's own rows (a count per rank; k = 8 over 8 local experts of
    16, the others' entries -1, as an EP rank receives them) against torch by expert; an eager call makes no
    host sync; a CUDA graph of both replays new rows."""
    w = weft.world()
    g = torch.Generator(device=w.device).manual_seed(70 + w.rank)
    experts, k, hidden, n = 8, 8, 1024, 384
    w_gu = (torch.randn(experts, hidden, 2 * n, device=w.device, generator=g) / 32).to(torch.bfloat16)
    w_dn = (torch.randn(experts, n, hidden, device=w.device, generator=g) / 20).to(torch.bfloat16)

    def reference(x, idx, wts):
        ia = idx.reshape(-1)
        y = torch.zeros(ia.shape[0], hidden, dtype=torch.bfloat16, device=w.device)
        for e in range(experts):
            sel = (ia == e).nonzero().squeeze(1)
            gate, up = (x[sel // k] @ w_gu[e]).float().chunk(2, dim=1)
            y[sel] = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16) @ w_dn[e]
        return (y.float() * wts.reshape(-1, 1)).reshape(-1, k, hidden).sum(1)

    def step(x, idx, wts):
        inter, layout = weft.ops.routed_gemm(x, w_gu, idx)
        return weft.ops.routed_gemm_sum(weft.ops.silu_mul(inter), w_dn, idx, wts, layout)

    _routed_checks(step, reference, lambda got, want: torch.testing.assert_close(got.float(), want, rtol=3e-2,
                                                                                 atol=3e-2), g, hidden, experts, k)


def _routed_checks(step, reference, check, g, hidden, experts, k):
    """step(x, idx, wts) on rows routed as an EP rank receives them (k of 2 E experts, this rank's E first, the
    others -1), a count per rank and 1024, against reference; an eager call without host sync; a CUDA graph of
    step replayed on new rows."""
    w = weft.world()

    def rows(m):
        x = torch.randn(m, hidden, device=w.device, generator=g).to(torch.bfloat16)
        idx = torch.rand(m, 2 * experts, device=w.device, generator=g).topk(k, dim=-1).indices
        idx = torch.where(idx < experts, idx, -1)
        return x, idx, torch.rand(m, k, device=w.device, generator=g)

    for m in (300 + 37 * w.rank, 1024):
        x, idx, wts = rows(m)
        check(step(x, idx, wts), reference(x, idx, wts))
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(x, idx, wts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sx, si, sw = x.clone(), idx.clone(), wts.clone()
    res = {}
    graph = capture(lambda: res.update(out=step(sx, si, sw)))
    x, idx, wts = rows(1024)
    sx.copy_(x), si.copy_(idx), sw.copy_(wts)
    graph.replay()
    check(res["out"], reference(x, idx, wts))


def test_routed_gemm_fp8_local_and_without_sync():
    """The fp8 routed ops (rows quantized per 128 channels, weights per 128 x 128 block) against torch on the
    dequantized operands, the activation quantized as silu_mul(fp8=True) does; eager without host sync; a CUDA
    graph of the step replays new rows."""
    w = weft.world()
    g = torch.Generator(device=w.device).manual_seed(80 + w.rank)
    experts, k, hidden, n = 8, 8, 1024, 384
    w_gu, s_gu = weft.ops.fp8_blocks(torch.randn(experts, hidden, 2 * n, device=w.device, generator=g) / 32)
    w_dn, s_dn = weft.ops.fp8_blocks(torch.randn(experts, n, hidden, device=w.device, generator=g) / 20)

    def values(q, scales, blocks):
        if blocks:
            return q.float() * scales.repeat_interleave(128, 1).repeat_interleave(128, 2)[..., :q.shape[2]]
        return q.float() * scales.repeat_interleave(128, -1)

    def reference(x, idx, wts):
        xv, gu, dn = values(*weft.ops.fp8_rows(x), False), values(w_gu, s_gu, True), values(w_dn, s_dn, True)
        ia = idx.reshape(-1)
        y = torch.zeros(ia.shape[0], hidden, device=w.device)
        for e in range(experts):
            sel = (ia == e).nonzero().squeeze(1)
            h = weft.ops.silu_mul((xv[sel // k] @ gu[e]).to(torch.bfloat16), fp8=True)
            y[sel] = (values(*h, False) @ dn[e]).to(torch.bfloat16).float()
        return (y * wts.reshape(-1, 1)).reshape(-1, k, hidden).sum(1)

    def step(x, idx, wts):
        q, q_scales = weft.ops.fp8_rows(x)
        inter, layout = weft.ops.routed_gemm(q, w_gu, idx, x_scales=q_scales, w_scales=s_gu)
        h, h_scales = weft.ops.silu_mul(inter, fp8=True)
        return weft.ops.routed_gemm_sum(h, w_dn, idx, wts, layout, x_scales=h_scales, w_scales=s_dn)

    def check(got, want):
        assert got.dtype == torch.bfloat16
        err = (got.float() - want).norm() / want.norm()
        assert err < 2e-2, f"relative error {float(err)}"

    _routed_checks(step, reference, check, g, hidden, experts, k)


# -- layers ------------------------------------------------------------------------------------------------

def _qwen3_block(seed):
    config = pytest.importorskip("transformers.models.qwen3_moe.configuration_qwen3_moe")
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    w = weft.world()
    block = modeling.Qwen3MoeSparseMoeBlock(config.Qwen3MoeConfig(
        hidden_size=1024, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True))
    g = torch.Generator(device=w.device).manual_seed(seed)
    block = block.to(w.device)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, device=w.device, generator=g) / p.shape[-1] ** 0.5)
    return block.to(torch.bfloat16).eval()


@pytest.mark.parametrize("layer", ["tp", "ep-ll", "ep-ht", "ep-ll-fp8", "ep-ht-fp8"])
def test_moe_layers_match_dense_block(layer):
    from weft.layers import EPMoE, TPMoE

    w = weft.world()
    block = _qwen3_block(60)
    g = torch.Generator(device=w.device).manual_seed(61 + w.rank)
    x = torch.randn(1, 96, 1024, device=w.device, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        want = block(x)
    want = (want[0] if isinstance(want, tuple) else want).float()  # transformers 4 adds the router logits
    if layer == "tp":
        moe = TPMoE.from_dense(block)
        got = moe(x)
    else:
        moe = EPMoE.from_dense(block, decode_tokens=128, fp8=layer.endswith("fp8"))
        got = moe(x, mode=layer[3:5])
    if layer.endswith("fp8"):  # quantized: near the block's result (tests/test_moe_layers.py checks the math)
        assert (got.float() - want).norm() / want.norm() < 0.1
    else:
        torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_ep_moe_prefill_cuda_graph(fp8):
    """EPMoE's prefill with max_recv_tokens: no host sync, so the step is captured; replays match the block (fp8:
    within 10 % in norm, the quantization's error)."""
    from weft.layers import EPMoE

    w = weft.world()
    block = _qwen3_block(62)
    moe = EPMoE.from_dense(block, decode_tokens=16, max_recv_tokens=96 * w.world_size, fp8=fp8)
    g = torch.Generator(device=w.device).manual_seed(63 + w.rank)
    x = torch.randn(1, 96, 1024, device=w.device, generator=g).to(torch.bfloat16)
    moe(x, mode="ht")  # plans and workspaces outside capture
    res = {}
    graph = capture(lambda: res.update(out=moe(x, mode="ht")))
    for _ in range(2):
        x.copy_(torch.randn(1, 96, 1024, device=w.device, generator=g))
        graph.replay()
        with torch.no_grad():
            want = block(x)
        want = (want[0] if isinstance(want, tuple) else want).float()
        if fp8:
            assert (res["out"].float() - want).norm() / want.norm() < 0.1
        else:
            torch.testing.assert_close(res["out"].float(), want, rtol=3e-2, atol=3e-2)
