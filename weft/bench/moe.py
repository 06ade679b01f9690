"""moe: expert-parallel dispatch + combine against torch.distributed.all_to_all_single with the permute and
unpermute around it, and the NVLink bound (DeepSeek-V3 sizes: hidden 7168, top-8 of 256 experts); the
tensor-parallel MoE ops and the MoE layers against the same work on torch collectives; in one run.

- LL (decode), 1 / 32 / 128 tokens per rank: weft ep_dispatch_ll + ep_combine_ll (one launch each), bf16
  and fp8 dispatch (the DeepSeek-V3 case: fp8 dispatch, bf16 combine), and the dispatch alone, bf16 and fp8;
- HT (prefill), 4096 tokens per rank: weft ep_dispatch + ep_combine, exact-size (one host sync) and with
  max_recv_tokens (capturable);
- baseline: the routing layout, all_to_all_single of the counts (the splits go to the host), permute,
  all_to_all_single of the rows and of their topk ids and weights, all_to_all_single back, unpermute
  (index_add): what a torch MoE layer does around its experts (no expert compute in any of them: y = recv);
- NVLink bound: the bf16 bytes each rank sends to other ranks (dispatch + combine, slowest rank: each token
  once to every other rank of its experts and one row back from each) over the per-rank bandwidth that
  weft's all_gather reaches in the same run.
- grouped GEMM (experts 32, capacity 256, 7168 -> 2048, random counts): weft grouped_gemm against a loop of
  torch.matmul over the experts' rows and, where it runs, torch._grouped_mm over the same rows packed; and
  weft's fp8 grouped_gemm (the rows per 128 channels, the weights per 128 x 128 block: DeepSeek-V3's scales)
  against torch._scaled_grouped_mm where it runs (fp8 with one scale per row of x and per column of w: coarser
  scales, the same bytes and MMA), both on the bf16 case's values quantized.
- TP-MoE ops (Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, moe inter 768; Mixtral-8x7B: hidden 4096, 8
  experts, top-2, inter 14336; 8192 tokens in all, sequence parallel): ag_group_gemm (gate and up side by
  side, 2 inter / W columns per rank) and group_gemm_rs (inter / W -> hidden), "weft overlap" (method
  overlap) and "weft no overlap" (method baseline: weft all_gather + the same grouped GEMM; the grouped GEMM,
  the weighted sum by a kernel, weft reduce_scatter) against the torch path: NCCL all_gather of the tokens and
  the routing, a sort by expert, torch's grouped GEMM (torch._grouped_mm where it runs, else a loop of
  torch.matmul); torch's grouped GEMM, the weighted sum (index_add), NCCL reduce_scatter.
- layers (Qwen3-30B-A3B's MoE block; random weights): EPMoE at 128 tokens per rank (decode: LL) and 4096
  (prefill: HT; also with max_recv_tokens, captured), also with fp8 experts (EPMoE(fp8=True): fp8 dispatch in
  decode), TPMoE at 8192 tokens in all
  (Qwen3 and Mixtral), against the same (bf16) layer on torch collectives (EP: all_to_all_single both ways
  around torch's grouped GEMMs; TP: the torch paths above).
Two views: every impl eagerly (host cost included), and the capturable ones (weft LL, weft HT with
max_recv_tokens, the TP-MoE ops both ways, TPMoE, EPMoE in decode and in prefill with max_recv_tokens; the TP
torch paths where torch's grouped GEMM runs) replayed from CUDA graphs (the EP baselines' splits go through the
host: they cannot be captured). Every weft result is checked against the baseline's before timing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import weft
from weft.kernels.moe import router_topk_torch, routing_layout
from weft.layers import EPMoE, TPMoE
from weft.testing.reference import all_gather_ref, reduce_scatter_ref

from .report import Row
from .timing import time_calls

SUITE = "moe"
# EP: all_to_all_single + permute; TP: NCCL all_gather / reduce_scatter + torch's grouped GEMM (module doc).
BASELINE = "torch collectives"
BANDWIDTH = "GB/s of bf16 rows sent to other ranks per rank"
# The HT case receives ~20K rows of 7168 bf16 per rank at 8 ranks, in two halves of the MoE workspace's quarter.
WORKSPACE_BYTES = str(4 << 30)
HIDDEN, K, EXPERTS = 7168, 8, 256


def add_arguments(p) -> None:
    p.add_argument("--ll-tokens", default="1,32,128", help="tokens per rank of the LL cases")
    p.add_argument("--ht-tokens", default="4096", help="tokens per rank of the HT cases")
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--experts", type=int, default=EXPERTS)
    p.add_argument("--topk", type=int, default=K)
    p.add_argument("--gemm", default="32,256,7168,2048",
                   help="experts,capacity,K,N of the grouped GEMM case ('' to skip)")
    p.add_argument("--tp", default="qwen3,mixtral", help="models of the TP-MoE op cases ('' to skip)")
    p.add_argument("--tp-tokens", type=int, default=8192, help="tokens in all (over the ranks) of the TP cases")
    p.add_argument("--layers", default="ep,tp", help="layer cases: ep (EPMoE, Qwen3), tp (TPMoE, --tp models)")
    p.add_argument("--ep-tokens", default="128,4096", help="tokens per rank of the EPMoE cases")
    p.add_argument("--samples", type=int, default=20)


def _routing(tokens, hidden, experts, k, dev):
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, device=dev).topk(k, dim=-1).indices
    wts = torch.rand(tokens, k, device=dev)
    return x, idx, wts


def _all_to_all(x, idx, wts, experts):
    """Dispatch and combine with torch.distributed: returns (received rows, combined output)."""
    w = weft.world()
    lay = routing_layout(idx, experts, w.world_size)
    tok, dest = lay.to_rank.nonzero(as_tuple=True)
    order = torch.argsort(dest, stable=True)
    tok = tok[order]  # my rows, by destination rank
    send_counts = lay.tokens_per_rank
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=w.group)
    ins, outs = send_counts.tolist(), recv_counts.tolist()
    rows = sum(outs)
    recv = torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, x[tok], outs, ins, group=w.group)
    meta = torch.cat([idx.int(), wts.view(torch.int32)], 1)[tok]
    recv_meta = torch.empty(rows, meta.shape[1], dtype=meta.dtype, device=x.device)
    dist.all_to_all_single(recv_meta, meta, outs, ins, group=w.group)
    back = torch.empty(tok.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(back, recv, ins, outs, group=w.group)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tok, back.float())
    return recv, out.to(x.dtype)


def _bytes_sent(idx, experts, hidden) -> int:
    """bf16 bytes this rank sends to other ranks in a dispatch + combine, the most of any rank: each token
    once to every other rank of its experts, and one row back from each (LL and HT combines both send a
    rank's weighted sum of its experts' outputs; one row per (token, expert), as DeepEP's LL combine sends,
    would be ~k / (ranks a token reaches) times the combine's bytes)."""
    w = weft.world()
    lay = routing_layout(idx, experts, w.world_size)
    rows = int(lay.to_rank.sum()) - int(lay.to_rank[:, w.rank].sum())  # token copies to other ranks
    t = torch.tensor([2 * rows * hidden * 2], dtype=torch.float64, device=idx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=w.group)
    return int(t.item())


def _link_bandwidth(samples) -> float:
    """Bytes per ms each rank sends in weft's all_gather of 64 MiB shards (64 KiB on the cpu backend) into a
    symmetric output: each rank pushes its shard straight into its peers' outputs, at what the links give."""
    w = weft.world()
    shard = torch.randn((32 << 20) if w.device.type == "cuda" else (32 << 10), device=w.device).to(torch.bfloat16)
    out = weft.empty((w.world_size * shard.numel(),), dtype=shard.dtype)
    ms = time_calls({"ag": lambda: weft.ops.all_gather(shard, out=out, method="push")}, calls=2,
                    samples=samples, graph=True)
    return (w.world_size - 1) * shard.numel() * 2 / next(iter(ms.values()))


def _timed(case, impls, capturable, nbytes, bandwidth, calls, samples):
    """Rows of both views: every impl eagerly, the capturable ones in CUDA graphs; the NVLink bound in each."""
    w = weft.world()
    rows = []
    views = {"eager": (impls, False), "graph": ({n: f for n, f in impls.items() if n in capturable}, True)}
    for view, (fns, graph) in views.items():
        times = time_calls(fns, calls=calls, samples=samples, graph=graph)
        if bandwidth:
            times["NVLink bound"] = nbytes / bandwidth
        rows += [Row(SUITE, case, name, ms, nbytes / ms / 1e6 if nbytes else 0.0, nbytes, w.world_size, view)
                 for name, ms in times.items()]
    return rows


def run(args) -> list[Row]:
    w = weft.world()
    dev = w.device
    torch.manual_seed(1 + w.rank)  # the same inputs run after run (routing, the grouped GEMM's counts)
    hidden, experts, k = args.hidden, args.experts, args.topk
    bandwidth = _link_bandwidth(args.samples) if w.world_size > 1 else 0.0
    rows = []
    for tokens in [int(t) for t in args.ll_tokens.split(",") if t]:
        x, idx, wts = _routing(tokens, hidden, experts, k, dev)
        ones = torch.ones_like(wts)

        def ll(x=x, idx=idx, ones=ones, tokens=tokens):
            recv, _, _, handle = weft.ops.ep_dispatch_ll(x, idx, experts, tokens)
            return recv, weft.ops.ep_combine_ll(recv, idx, ones, handle)

        recv, out = ll()
        # With y = recv and weights 1 the combine gives each token k times itself.
        if not torch.allclose(out.float(), x.float() * (idx >= 0).sum(1, keepdim=True), rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"LL combine mismatch at {tokens} tokens")
        fp8 = hidden % 128 == 0
        impls = {"weft LL dispatch+combine": ll,
                 "weft LL dispatch": lambda x=x, idx=idx, tokens=tokens: weft.ops.ep_dispatch_ll(x, idx, experts,
                                                                                                  tokens)}
        if fp8:
            impls["weft LL dispatch (fp8)"] = lambda x=x, idx=idx, tokens=tokens: weft.ops.ep_dispatch_ll(
                x, idx, experts, tokens, fp8=True)
            y = torch.randn(recv.shape, device=dev).to(recv.dtype)  # the experts' bf16 outputs

            def ll_fp8(x=x, idx=idx, ones=ones, tokens=tokens, y=y):
                _, _, _, handle = weft.ops.ep_dispatch_ll(x, idx, experts, tokens, fp8=True)
                return weft.ops.ep_combine_ll(y, idx, ones, handle)

            impls["weft LL dispatch (fp8)+combine"] = ll_fp8
        impls |= {
                 BASELINE: lambda x=x, idx=idx, wts=wts: _all_to_all(x, idx, wts, experts)}
        weft.ops.check_routing_values(idx, experts)
        nbytes = _bytes_sent(idx, experts, hidden)
        rows += _timed(f"LL {tokens} tok/rank", impls, {n for n in impls if n.startswith("weft")}, nbytes,
                       bandwidth, 10, args.samples)
    for tokens in [int(t) for t in args.ht_tokens.split(",") if t]:
        x, idx, wts = _routing(tokens, hidden, experts, k, dev)
        recv_ref, out_ref = _all_to_all(x, idx, wts, experts)
        rx, _, _, _, handle = weft.ops.ep_dispatch(x, idx, wts, experts)
        if not torch.equal(rx, recv_ref) or not torch.allclose(weft.ops.ep_combine(rx, handle).float(), out_ref.float(),
                                                               rtol=1e-2, atol=1e-2):
            raise RuntimeError(f"HT mismatch against {BASELINE} at {tokens} tokens")
        cap = w.world_size * tokens

        def ht(x=x, idx=idx, wts=wts, cap=None):
            rx, _, _, _, handle = weft.ops.ep_dispatch(x, idx, wts, experts, max_recv_tokens=cap)
            return weft.ops.ep_combine(rx, handle)

        impls = {"weft HT dispatch+combine": ht,
                 "weft HT dispatch+combine (max_recv_tokens)": lambda: ht(cap=cap),
                 BASELINE: lambda x=x, idx=idx, wts=wts: _all_to_all(x, idx, wts, experts)}
        nbytes = _bytes_sent(idx, experts, hidden)
        rows += _timed(f"HT {tokens} tok/rank", impls, {"weft HT dispatch+combine (max_recv_tokens)"}, nbytes,
                       bandwidth, 2, args.samples)
    if args.gemm:
        rows += _grouped_gemm(*[int(v) for v in args.gemm.split(",")], args.samples)
    models = [m for m in args.tp.split(",") if m]
    for model in models:
        rows += _tp_ops(MODELS[model], args.tp_tokens, args.samples)
    layers = args.layers.split(",")
    if "ep" in layers:
        rows += [r for t in args.ep_tokens.split(",") if t for r in _ep_layer(MODELS["qwen3"], int(t), args.samples)]
    if "tp" in layers:
        rows += [r for model in models for r in _tp_layer(MODELS[model], args.tp_tokens, args.samples)]
    return rows


def _grouped_gemm(experts, cap, k, n, samples) -> list[Row]:
    w = weft.world()
    x = torch.randn(experts, cap, k, device=w.device).to(torch.bfloat16)
    wt = (torch.randn(experts, k, n, device=w.device) / k ** 0.5).to(torch.bfloat16)
    counts = torch.randint(0, cap + 1, (experts,), device=w.device, dtype=torch.int32)
    sizes = counts.tolist()
    out = torch.empty(experts, cap, n, dtype=x.dtype, device=w.device)

    def loop():
        for e, m in enumerate(sizes):
            torch.matmul(x[e, :m], wt[e], out=out[e, :m])

    loop()
    got = weft.ops.grouped_gemm(x, wt, counts)
    for e, m in enumerate(sizes):
        if not torch.allclose(got[e, :m].float(), out[e, :m].float(), rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"grouped_gemm mismatch against torch.matmul (expert {e})")
    impls = {"weft grouped_gemm": lambda: weft.ops.grouped_gemm(x, wt, counts), "torch.matmul loop": loop}
    grouped = TorchGrouped(w.device)
    packed = torch.cat([x[e, :m] for e, m in enumerate(sizes)])  # the rows packed by expert (untimed)
    ends = counts.cumsum(0, dtype=torch.int32)
    if grouped.grouped:
        impls["torch._grouped_mm"] = lambda: grouped(packed, wt, ends)
    if k % 128 == 0:  # fp8 e4m3 with block scales, checked against the bf16 product
        xq, xs = weft.ops.fp8_rows(x)
        wq, ws = weft.ops.fp8_blocks(wt)
        got = weft.ops.grouped_gemm(xq, wq, counts, x_scales=xs, w_scales=ws)
        for e, m in enumerate(sizes):
            err = _relative_error(got[e, :m], out[e, :m])
            if err > 0.1:
                raise RuntimeError(f"fp8 grouped_gemm off the bf16 product by {err:.3f} (expert {e})")
        impls["weft grouped_gemm (fp8)"] = lambda: weft.ops.grouped_gemm(xq, wq, counts, x_scales=xs, w_scales=ws)
        scaled = torch_scaled_grouped(packed, wt, ends, out, sizes)
        if scaled is not None:
            impls["torch._scaled_grouped_mm (fp8 rowwise)"] = scaled
    case = f"grouped GEMM {experts}x{cap}x{k}x{n}"
    return [Row(SUITE, case, name, ms, 0.0, 0, w.world_size, view)
            for view, graph in (("eager", False), ("graph", True))
            for name, ms in time_calls(impls, calls=5, samples=samples, graph=graph).items()]


# -- tensor-parallel MoE ---------------------------------------------------------------------------

MODELS = {"qwen3": dict(name="Qwen3-30B-A3B", hidden=2048, experts=128, k=8, inter=768),
          "mixtral": dict(name="Mixtral-8x7B", hidden=4096, experts=8, k=2, inter=14336)}


def _relative_error(got, want) -> float:
    """|got - want| / |want| (Frobenius norms, fp32): how far a quantized result is from the bf16 one."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-6))


def torch_scaled_grouped(packed, wt, ends, want, sizes):
    """torch's fp8 grouped GEMM on rows packed by expert, as a call, where it runs and agrees with the bf16
    product `want` (E, C, N): x per row and w per column quantized to e4m3 (what torch._scaled_grouped_mm scales
    by), w column-major; else None."""
    if not hasattr(torch, "_scaled_grouped_mm") or packed.device.type != "cuda":
        return None
    fp8 = torch.float8_e4m3fn
    xs = packed.float().abs().amax(1).clamp(min=1e-4) / 448
    ws = wt.float().abs().amax(1).clamp(min=1e-4) / 448  # (E, N): per column
    xq = (packed.float() / xs[:, None]).to(fp8)
    wq = (wt.float() / ws[:, None, :]).to(fp8).transpose(1, 2).contiguous().transpose(1, 2)
    try:
        got = torch._scaled_grouped_mm(xq, wq, xs, ws, offs=ends, out_dtype=torch.bfloat16)
    except Exception:  # noqa: BLE001 - not on this GPU / torch
        return None
    lo = 0
    for e, m in enumerate(sizes):
        if _relative_error(got[lo:lo + m], want[e, :m]) > 0.1:
            return None
        lo += m
    return lambda: torch._scaled_grouped_mm(xq, wq, xs, ws, offs=ends, out_dtype=torch.bfloat16)


class TorchGrouped:
    """torch's grouped GEMM over rows sorted by expert: out[ends[e - 1]:ends[e]] = x[...] @ w[e]
    (torch._grouped_mm where it runs on this device, checked once against matmul; else a loop of
    torch.matmul, whose row ranges go to the host)."""

    def __init__(self, dev):
        self.name, self.grouped = "torch.matmul loop", False
        if hasattr(torch, "_grouped_mm") and dev.type == "cuda":
            try:
                x = torch.randn(64, 64, device=dev).to(torch.bfloat16)
                w = torch.randn(4, 64, 32, device=dev).to(torch.bfloat16)
                ends = torch.tensor([16, 16, 40, 64], dtype=torch.int32, device=dev)
                got = torch._grouped_mm(x, w, offs=ends)
                want = torch.cat([x[:16] @ w[0], x[16:40] @ w[2], x[40:] @ w[3]])
                self.grouped = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            except Exception:  # noqa: BLE001 - not on this GPU / torch: the loop
                self.grouped = False
            if self.grouped:
                self.name = "torch._grouped_mm"

    def __call__(self, x, w, ends):
        if self.grouped:
            return torch._grouped_mm(x, w, offs=ends)
        out = torch.empty((x.shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
        lo = 0
        for e, hi in enumerate(ends.tolist()):
            torch.matmul(x[lo:hi], w[e], out=out[lo:hi])
            lo = hi
        return out


def _sorted_pairs(idx, experts):
    """Every (token, slot) pair of idx (T, k) sorted by expert: (order: the pairs' flat indices, ends (E,)
    int32: where each expert's pairs end)."""
    key = idx.reshape(-1)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(1, experts + 1, dtype=sorted_key.dtype, device=idx.device)
    ends = torch.searchsorted(sorted_key, bounds).to(torch.int32)
    return order, ends


def _torch_ag(x, w_gu, idx, grouped):
    """all_gather + grouped GEMM on torch: the gathered pairs' rows, sorted by expert; and the order."""
    w = weft.world()
    gathered = torch.empty((w.world_size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    all_gather_ref(gathered, x, group=w.group)
    gidx = torch.empty((w.world_size * idx.shape[0], idx.shape[1]), dtype=idx.dtype, device=x.device)
    all_gather_ref(gidx, idx, group=w.group)
    order, ends = _sorted_pairs(gidx, w_gu.shape[0])
    return grouped(gathered[order // idx.shape[1]], w_gu, ends), order, ends


def _torch_rs(h, w_dn, wts, order, ends, grouped):
    """grouped GEMM + weighted sum + reduce_scatter on torch, h in _torch_ag's row order."""
    w = weft.world()
    k = wts.shape[1]
    y = grouped(h, w_dn, ends)
    gw = torch.empty((w.world_size * wts.shape[0], k), dtype=wts.dtype, device=wts.device)
    all_gather_ref(gw, wts, group=w.group)
    acc = torch.zeros((gw.shape[0], y.shape[1]), dtype=torch.float32, device=y.device)
    acc.index_add_(0, order // k, y.float() * gw.reshape(-1)[order, None])
    out = torch.empty((wts.shape[0], y.shape[1]), dtype=y.dtype, device=y.device)
    reduce_scatter_ref(out, acc.to(y.dtype), group=w.group)
    return out


def _routing_weights(tokens, experts, k, dev):
    idx = torch.rand(tokens, experts, device=dev).topk(k, dim=-1).indices
    return idx, torch.softmax(torch.rand(tokens, k, device=dev), dim=-1)


def _tp_ops(model, total, samples) -> list[Row]:
    """ag_group_gemm and group_gemm_rs of one model, overlapped and not, against the torch paths."""
    w = weft.world()
    dev, ws = w.device, w.world_size
    m, hidden, experts, k = total // ws, model["hidden"], model["experts"], model["k"]
    n = model["inter"] // ws
    grouped = TorchGrouped(dev)
    x = torch.randn(m, hidden, device=dev).to(torch.bfloat16)
    idx, wts = _routing_weights(m, experts, k, dev)
    w_gu = (torch.randn(experts, hidden, 2 * n, device=dev) / hidden ** 0.5).to(torch.bfloat16)
    w_dn = (torch.randn(experts, n, hidden, device=dev) / n ** 0.5).to(torch.bfloat16)
    # Both layouts hold the same pairs: compare them pair by pair.
    inter, layout = weft.ops.ag_group_gemm(x, w_gu, idx, method="overlap" if ws > 1 else "auto")
    ref, order, ends = _torch_ag(x, w_gu, idx, grouped)
    pair_of_row = (layout.pair_of_row + torch.arange(ws, device=dev)[:, None] * m * k).reshape(-1).long()
    if not torch.allclose(inter[layout.row_of_pair.reshape(-1).long()].float(),
                          ref[torch.argsort(order)].float(), rtol=2e-2, atol=2e-2):
        raise RuntimeError(f"ag_group_gemm mismatch against the torch path ({model['name']})")
    h_pairs = torch.randn(ws * m * k, n, device=dev).to(torch.bfloat16)  # a value per pair, both orders
    h_weft, h_torch = h_pairs[pair_of_row].contiguous(), h_pairs[order].contiguous()
    got = weft.ops.group_gemm_rs(h_weft, w_dn, idx, wts, layout, method="overlap" if ws > 1 else "auto")
    want = _torch_rs(h_torch, w_dn, wts, order, ends, grouped)
    if not torch.allclose(got.float(), want.float(), rtol=3e-2, atol=3e-2):
        raise RuntimeError(f"group_gemm_rs mismatch against the torch path ({model['name']})")

    def ag(method):
        return lambda: weft.ops.ag_group_gemm(x, w_gu, idx, method=method)

    def rs(method):
        return lambda: weft.ops.group_gemm_rs(h_weft, w_dn, idx, wts, layout, method=method)

    torch_name = f"{BASELINE} ({grouped.name})"
    capturable = {"weft overlap", "weft no overlap"} | ({torch_name} if grouped.grouped else set())
    rows = []
    for op, impls in (
            ("ag_group_gemm", {"weft overlap": ag("overlap"), "weft no overlap": ag("baseline"),
                               torch_name: lambda: _torch_ag(x, w_gu, idx, grouped)}),
            ("group_gemm_rs", {"weft overlap": rs("overlap"), "weft no overlap": rs("baseline"),
                               torch_name: lambda: _torch_rs(h_torch, w_dn, wts, order, ends, grouped)})):
        if ws == 1:
            impls.pop("weft overlap")
        case = f"{op} {model['name']} {total} tok"
        rows += [Row(SUITE, case, name, ms, 0.0, 0, ws, view)
                 for view, graph in (("eager", False), ("graph", True))
                 for name, ms in time_calls({n_: fn for n_, fn in impls.items() if not graph or n_ in capturable},
                                            calls=2, samples=samples, graph=graph).items()]
    return rows


# -- layers ----------------------------------------------------------------------------------------

def random_moe_weights(model, dev):
    """Random dense weights of a model's MoE block, nn.Linear layout: router, gate, up, down."""
    e, hidden, inter = model["experts"], model["hidden"], model["inter"]
    scale = lambda t, fan_in: (t / fan_in ** 0.5).to(torch.bfloat16)  # noqa: E731
    return (scale(torch.randn(e, hidden, device=dev), hidden), scale(torch.randn(e, inter, hidden, device=dev), hidden),
            scale(torch.randn(e, inter, hidden, device=dev), hidden),
            scale(torch.randn(e, hidden, inter, device=dev), inter))


def _torch_route(layer, x):
    """The layer's router in torch's own ops (softmax, topk, division): the baselines' routing."""
    return router_topk_torch(F.linear(x, layer.router_weight), layer.top_k, layer.norm_topk_prob)


def _torch_ep_layer(layer: EPMoE, x, grouped):
    """EPMoE's forward on torch collectives: all_to_all_single of the tokens and their routing to the ranks of
    their experts, torch's grouped GEMMs over the (token, local expert) pairs, all_to_all_single back, sum."""
    w = weft.world()
    k, local = layer.top_k, layer.local
    idx, wts = _torch_route(layer, x)
    lay = routing_layout(idx, layer.num_experts, w.world_size)
    tok, dest = lay.to_rank.nonzero(as_tuple=True)
    tok = tok[torch.argsort(dest, stable=True)]  # my rows, by destination rank
    recv_counts = torch.empty_like(lay.tokens_per_rank)
    dist.all_to_all_single(recv_counts, lay.tokens_per_rank, group=w.group)
    ins, outs = lay.tokens_per_rank.tolist(), recv_counts.tolist()
    recv = torch.empty((sum(outs), x.shape[1]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, x[tok], outs, ins, group=w.group)
    meta = torch.cat([idx.int(), wts.view(torch.int32)], 1)[tok]
    recv_meta = torch.empty((recv.shape[0], 2 * k), dtype=torch.int32, device=x.device)
    dist.all_to_all_single(recv_meta, meta, outs, ins, group=w.group)
    mine = recv_meta[:, :k] - w.rank * local
    mine = torch.where((mine >= 0) & (mine < local), mine, local)  # local: not here, sorted last
    order, ends = _sorted_pairs(mine, local)
    order = order[:int(ends[-1])]  # the pairs of my experts (the splits went through the host already)
    rows = order // k
    gate_up = grouped(recv[rows], layer.w_gate_up, ends)
    y = grouped(F.silu(gate_up[:, :layer.inter]) * gate_up[:, layer.inter:], layer.w_down, ends)
    weight = recv_meta[:, k:].reshape(-1).view(torch.float32)[order]
    part = torch.zeros((recv.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    part.index_add_(0, rows, y.float() * weight[:, None])
    back = torch.empty((tok.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(back, part.to(x.dtype), ins, outs, group=w.group)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tok, back.float())
    return out.to(x.dtype)


def _torch_tp_layer(layer: TPMoE, x, grouped):
    """TPMoE's forward on torch collectives: the torch paths of ag_group_gemm and group_gemm_rs."""
    idx, wts = _torch_route(layer, x)
    gate_up, order, ends = _torch_ag(x, layer.w_gate_up, idx, grouped)
    h = F.silu(gate_up[:, :layer.slice]) * gate_up[:, layer.slice:]
    return _torch_rs(h, layer.w_down, wts, order, ends, grouped)


def _layer_rows(case, impls, capturable, samples) -> list[Row]:
    w = weft.world()
    want = impls[BASELINE]()
    got = impls["weft layer"]()
    if not torch.allclose(got.float(), want.float(), rtol=5e-2, atol=5e-2):
        raise RuntimeError(f"{case}: weft layer mismatch against {BASELINE}")
    if "weft layer (fp8)" in impls:  # quantized: near the bf16 result, not equal to it
        err = _relative_error(impls["weft layer (fp8)"](), want)
        if err > 0.1:
            raise RuntimeError(f"{case}: the fp8 weft layer is off {BASELINE} by {err:.3f}")
    return [Row(SUITE, case, name, ms, 0.0, 0, w.world_size, view)
            for view, graph in (("eager", False), ("graph", True))
            for name, ms in time_calls({n: f for n, f in impls.items() if not graph or n in capturable},
                                       calls=2, samples=samples, graph=graph).items()]


def _ep_layer(model, tokens, samples) -> list[Row]:
    w = weft.world()
    grouped = TorchGrouped(w.device)
    dense = random_moe_weights(model, w.device)
    layer = EPMoE(*dense, model["k"], True, decode_tokens=128)
    layer_fp8 = EPMoE(*dense, model["k"], True, decode_tokens=128, fp8=True)
    x = torch.randn(tokens, model["hidden"], device=w.device).to(torch.bfloat16)
    mode = "LL" if tokens <= layer.decode_tokens else "HT"
    impls = {"weft layer": lambda: layer(x), "weft layer (fp8)": lambda: layer_fp8(x),
             BASELINE: lambda: _torch_ep_layer(layer, x, grouped)}
    if mode == "HT":  # the rows received bounded by every rank's tokens: no host sync, captured
        bounded = EPMoE(*dense, model["k"], True, decode_tokens=128, max_recv_tokens=tokens * w.world_size)
        impls["weft layer (max_recv_tokens)"] = lambda: bounded(x)
    return _layer_rows(f"EPMoE {model['name']} {tokens} tok/rank ({mode})", impls,
                       {"weft layer", "weft layer (fp8)"} if mode == "LL" else {"weft layer (max_recv_tokens)"},
                       samples)


def _tp_layer(model, total, samples) -> list[Row]:
    w = weft.world()
    grouped = TorchGrouped(w.device)
    layer = TPMoE(*random_moe_weights(model, w.device), model["k"], True)
    x = torch.randn(total // w.world_size, model["hidden"], device=w.device).to(torch.bfloat16)
    impls = {"weft layer": lambda: layer(x), BASELINE: lambda: _torch_tp_layer(layer, x, grouped)}
    return _layer_rows(f"TPMoE {model['name']} {total} tok", impls,
                       {"weft layer"} | ({BASELINE} if grouped.grouped else set()), samples)
