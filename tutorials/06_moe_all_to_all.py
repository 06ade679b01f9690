"""Tutorial 06 — mixture-of-experts all-to-all: dispatch tokens to their experts' ranks, combine them back.

    weft run -n 4 tutorials/06_moe_all_to_all.py

In expert parallelism each rank holds E / W of the experts (rank r: experts [r * E / W, (r + 1) * E / W)),
and each token, routed to its top-k experts, has to travel to the ranks that hold them and back. weft has
two forms of this all-to-all, both pushing through the symmetric heap:

high throughput (prefill)  `ep_dispatch` sends each token once to every rank holding one of its experts.
    Before any data moves, every rank writes its tokens-per-destination row to every rank (LL words), so
    each rank knows where its rows land on every destination (after the rows of lower ranks) with no host
    round trip; then the rows are pushed straight into the destinations' receive regions. `ep_combine`
    sends each rank's result per received token back and sums them at the source.

low latency (decode)  `ep_dispatch_ll` is one kernel launch: every word travels as an LL word (4 bytes and
    the call's epoch in one 8-byte store), so the data is its own signal, and each receiver places every
    token straight at its row in `recv[local expert]`. `ep_combine_ll` first sends the routing weights to
    the experts' ranks; each rank sums its experts' weighted outputs per token and sends that one row
    back, where the token's rank adds them. No host sync (the kernel checks topk_idx itself; a bad row
    raises at the next EP call): a decode step can be captured in a CUDA graph. With
    `return_recv_hook=True` either op launches only its sends and returns a hook that launches the
    receive: work queued in between (here, the shared expert) runs while the rows travel.

Between the two, `grouped_gemm` runs every local expert on its rows, reading the per-expert counts on
the device. This tutorial runs a small MoE layer (one linear map per expert) both ways and checks it
against the same layer computed by one process.

fp8 (DeepSeek-V3's decode)  `ep_dispatch_ll(fp8=True)` quantizes each row to e4m3 inside the dispatch, a
    scale per 128 channels (half the bytes on the wire), and `grouped_gemm` takes those rows and scales as
    they arrive, with the experts' weights in fp8 per 128 x 128 block (`fp8_blocks`): each 128-channel
    slice is multiplied in fp8 and added to the fp32 accumulator times both scales.
"""
import torch

import weft

HIDDEN, EXPERTS, K, TOKENS = 128, 8, 2, 4  # fp8 scales cover 128 channels


def main():
    weft.init()
    me, w = weft.rank(), weft.world_size()
    local = EXPERTS // w
    g = torch.Generator().manual_seed(0)  # every rank builds every rank's tokens, to check its own result
    xs = [torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(w)]
    idxs = [torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(TOKENS)]) for _ in range(w)]
    wts = [torch.softmax(torch.randn(TOKENS, K, generator=g), -1) for _ in range(w)]
    experts = (torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5).to(torch.bfloat16)
    dev = weft.world().device
    mine = experts[me * local:(me + 1) * local].to(dev)
    x, idx, wt = xs[me].to(dev), idxs[me].to(dev), wts[me].to(dev)

    # The reference: the layer on one process, fp32.
    ref = torch.zeros(TOKENS, HIDDEN)
    for j in range(K):
        ref += wts[me][:, j:j + 1] * torch.stack([xs[me][t].float() @ experts[idxs[me][t, j]].float()
                                                  for t in range(TOKENS)])

    # Low latency: recv[e] holds counts[e] rows of local expert e; the experts run in one grouped GEMM.
    recv, counts, _, handle = weft.ops.ep_dispatch_ll(x, idx, EXPERTS, max_tokens_per_rank=TOKENS)
    y = weft.ops.grouped_gemm(recv, mine, counts)
    out_ll = weft.ops.ep_combine_ll(y, idx, wt, handle)

    # The same, split: a dense "shared expert" (any work) computed while the tokens travel each way.
    shared_w = experts[0].to(dev)
    recv, counts, _, handle, receive = weft.ops.ep_dispatch_ll(x, idx, EXPERTS, TOKENS, return_recv_hook=True)
    shared = x @ shared_w  # queued between the send and the receive
    receive()  # recv and counts are valid from here on
    out, receive = weft.ops.ep_combine_ll(weft.ops.grouped_gemm(recv, mine, counts), idx, wt, handle,
                                          return_recv_hook=True)
    shared = shared.float() * 0.5
    receive()
    torch.testing.assert_close(out, out_ll, rtol=0, atol=0, msg="split calls differ from one-launch calls")
    torch.testing.assert_close(shared, (x @ shared_w).float() * 0.5, rtol=0, atol=0)

    # High throughput: each token once per rank; that rank sums its local experts' outputs per token.
    rx, ridx, rw, counts_ht, handle = weft.ops.ep_dispatch(x, idx, wt, EXPERTS)
    assert torch.equal(counts_ht, counts)
    y = torch.zeros(rx.shape, dtype=torch.float32, device=dev)
    for j in range(K):
        for e in range(local):
            sel = ridx[:, j] == e
            y[sel] += rw[sel, j:j + 1] * (rx[sel].float() @ mine[e].float())
    out_ht = weft.ops.ep_combine(y.to(torch.bfloat16), handle)

    # fp8: the dispatch's e4m3 rows and scales straight into the fp8 grouped GEMM.
    w8, w_scales = weft.ops.fp8_blocks(mine)  # the weights per 128 x 128 block, K-major
    recv, counts, scales, handle = weft.ops.ep_dispatch_ll(x, idx, EXPERTS, TOKENS, fp8=True)
    y = weft.ops.grouped_gemm(recv, w8, counts, x_scales=scales, w_scales=w_scales)
    out_fp8 = weft.ops.ep_combine_ll(y, idx, wt, handle)
    err = (out_fp8.float().cpu() - ref).norm() / ref.norm()
    assert err < 0.1, f"fp8: relative error {float(err):.3f}"  # e4m3 keeps 3 mantissa bits of each operand

    for name, out in (("low latency", out_ll), ("high throughput", out_ht)):
        torch.testing.assert_close(out.float().cpu(), ref, rtol=3e-2, atol=3e-2, msg=lambda m: f"{name}: {m}")
    print(f"rank {me}: {TOKENS} tokens, {int(counts.sum())} (token, expert) pairs received for experts "
          f"{me * local}..{(me + 1) * local - 1}; both forms match the single-process layer, fp8 within "
          f"{float(err):.1%}")
    weft.finalize()


if __name__ == "__main__":
    main()
