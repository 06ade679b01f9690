"""moe: expert-parallel dispatch + combine against torch.distributed.all_to_all_single with the permute and
unpermute around it, and the NVLink bound, in one run (DeepSeek-V3 sizes: hidden 7168, top-8 of 256 experts).

- LL (decode), 1 / 32 / 128 tokens per rank: weft ep_dispatch_ll + ep_combine_ll (one launch each), and
  the dispatch alone, bf16 and fp8;
- HT (prefill), 4096 tokens per rank: weft ep_dispatch + ep_combine, exact-size (one host sync) and with
  max_recv_tokens (capturable);
- baseline: the routing layout, all_to_all_single of the counts (the splits go to the host), permute,
  all_to_all_single of the rows and of their topk ids and weights, all_to_all_single back, unpermute
  (index_add): what a torch MoE layer does around its experts (no expert compute in any of them: y = recv);
- NVLink bound: the bf16 bytes each rank sends to other ranks (dispatch + combine, slowest rank) over the
  per-rank bandwidth that weft's all_gather reaches in the same run.
- grouped GEMM (experts 32, capacity 256, 7168 -> 2048, random counts): weft grouped_gemm against a loop of
  torch.matmul over the experts' rows.
Two views: every impl eagerly (host cost included), and the capturable ones (weft LL, weft HT with
max_recv_tokens) replayed from CUDA graphs (the baseline's splits go through the host: it cannot be
captured). Every weft result is checked against the baseline's before timing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft.kernels.moe import routing_layout

from .report import Row
from .timing import time_calls

SUITE = "moe"
BASELINE = "all_to_all_single + permute"
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


def _bytes_sent(idx, experts, hidden, ll: bool) -> int:
    """bf16 bytes this rank sends to other ranks in a dispatch + combine, the most of any rank."""
    w = weft.world()
    local = experts // w.world_size
    other = (idx // local) != w.rank
    lay = routing_layout(idx, experts, w.world_size)
    rows = int(lay.to_rank.sum()) - int(lay.to_rank[:, w.rank].sum())  # token copies to other ranks
    back = int(other.sum()) if ll else rows  # LL returns one row per (token, expert); HT one per rank
    t = torch.tensor([(rows + back) * hidden * 2], dtype=torch.float64, device=idx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=w.group)
    return int(t.item())


def _link_bandwidth(samples) -> float:
    """Bytes per ms each rank sends in weft's all_gather of 64 MiB shards (64 KiB on the cpu backend)."""
    w = weft.world()
    shard = torch.randn((32 << 20) if w.device.type == "cuda" else (32 << 10), device=w.device).to(torch.bfloat16)
    out = torch.empty(w.world_size * shard.numel(), dtype=shard.dtype, device=w.device)
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
        impls |= {
                 BASELINE: lambda x=x, idx=idx, wts=wts: _all_to_all(x, idx, wts, experts)}
        weft.ops.check_routing_values(idx, experts)
        nbytes = _bytes_sent(idx, experts, hidden, True)
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
        nbytes = _bytes_sent(idx, experts, hidden, False)
        rows += _timed(f"HT {tokens} tok/rank", impls, {"weft HT dispatch+combine (max_recv_tokens)"}, nbytes,
                       bandwidth, 2, args.samples)
    if args.gemm:
        rows += _grouped_gemm(*[int(v) for v in args.gemm.split(",")], args.samples)
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
    case = f"grouped GEMM {experts}x{cap}x{k}x{n}"
    return [Row(SUITE, case, name, ms, 0.0, 0, w.world_size, view)
            for view, graph in (("eager", False), ("graph", True))
            for name, ms in time_calls(impls, calls=5, samples=samples, graph=graph).items()]
