"""Tutorial 03 — all-reduce: one-shot and two-shot, through the symmetric heap.

    weft run -n 4 tutorials/03_all_reduce.py

An all-reduce leaves sum over ranks of x on every rank. With every rank's
heap mapped into every process, there are two simple ways to do it:

one-shot  Every rank copies x into its symmetric staging buffer and notifies
          everyone. Then every rank reads *all* W staging buffers and sums
          them. One synchronisation step, but each rank reads (W - 1) * n
          elements over the links: the fastest for small messages, where the
          cost is latency, not bytes.

two-shot  A reduce-scatter, then an all-gather. Rank r sums only slice r
          (n / W elements) of every rank's staging buffer, then pushes that
          summed slice into every rank's buffer and notifies; each rank
          copies the assembled result out. Two synchronisation steps, but
          only ~2 (W - 1) / W * n elements cross the links per rank: the
          faster one once the message is large (bandwidth-bound).

`weft.ops.all_reduce(x, method="auto")` picks by size and world size. The
hand-written kernel below is the one-shot idea in its bare form, reading
peers' buffers. The library op turns every transfer into a *push* (stores
into the peer's receive slot: NVLink writes are posted, reads cost a round
trip), staggers the destinations so no rank's links take all senders at once,
signals all ranks at once (`wl.notify_all`) and polls all flags at once, and
adds many programs, 16-byte vector accesses, double buffering so
back-to-back calls need no host barrier, and argument checks. Measured on
4 x H200 (bf16, docs/performance/all_reduce.md): 4.1 us at 4 KiB (NCCL 14.6, torch 6.6; small
messages go as LL words, data and epoch in one 8-byte store: one-shot up to
64 KiB, two-shot up to 512 KiB), and
at 512 MiB two-shot in place in symmetric memory at NCCL's bus bandwidth
(346 vs 347 GB/s).
"""
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import weft
import weft.language as wl


@triton.jit(do_not_specialize=["epoch"])
def one_shot_sum_kernel(x, stage, out, ready, heap, n, epoch, BLOCK: tl.constexpr):
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    offs = tl.arange(0, BLOCK)
    # 1. Stage my input in my symmetric buffer, then tell every rank it is there (release).
    for start in range(0, n, BLOCK):
        mask = start + offs < n
        tl.store(stage + start + offs, tl.load(x + start + offs, mask=mask), mask=mask)
    for q in range(world):
        wl.notify(ready + me, q, heap, epoch)
    # 2. Wait until every rank's input is staged (acquire), then read them all and sum in fp32.
    token = wl.wait(ready, world, epoch, wl.CMP_GE)
    staged = wl.consume_token(stage, token)
    for start in range(0, n, BLOCK):
        mask = start + offs < n
        acc = tl.zeros([BLOCK], tl.float32)
        for q in range(world):
            acc += tl.load(wl.symm_at(staged, q, heap) + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + start + offs, acc.to(out.dtype.element_ty), mask=mask)


def reference_sum(x: torch.Tensor, group) -> torch.Tensor:
    """torch.distributed's all_reduce (gloo or NCCL), in fp32."""
    ref = x.float().clone()
    dist.all_reduce(ref, group=group)
    return ref


def main():
    weft.init()
    w = weft.world()
    n = 1000
    stage = weft.empty((n,), torch.float32)
    ready = weft.zeros((w.world_size,), torch.int32)
    weft.barrier()
    for epoch in range(1, 4):
        x = torch.randn(n, device=w.device) + w.rank
        out = torch.full_like(x, float("nan"))
        one_shot_sum_kernel[(1,)](x, stage, out, ready, w.heap.descriptor, n, epoch, BLOCK=256)
        torch.testing.assert_close(out, reference_sum(x, w.group), rtol=1e-5, atol=1e-5)
        weft.barrier()  # this bare kernel has no protection: nobody restages while a peer still reads

    # The library op: any tensor, out of place or in place, fp32/bf16/fp16 with fp32 accumulation.
    for method in ("one_shot", "two_shot", "auto"):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(4099, device=w.device) + w.rank).to(dtype)  # odd size: the last slice is ragged
            ref = reference_sum(x, w.group).to(dtype)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(weft.ops.all_reduce(x, method=method), ref, **tol)
            weft.ops.all_reduce(x, method=method, out=x)  # in place; calls follow each other with no barrier
            torch.testing.assert_close(x, ref, **tol)

    # reduce_scatter: rank r gets the sum of row block r; broadcast: everybody gets the root's tensor.
    m = 3
    x = torch.randn(w.world_size * m, 5, device=w.device)
    ref = reference_sum(x, w.group)[w.rank * m:(w.rank + 1) * m]
    torch.testing.assert_close(weft.ops.reduce_scatter(x), ref, rtol=1e-5, atol=1e-5)
    root = w.world_size - 1
    y = torch.arange(10.0, device=w.device) if w.rank == root else torch.zeros(10, device=w.device)
    weft.ops.broadcast(y, root=root)
    assert torch.equal(y, torch.arange(10.0, device=w.device))

    weft.barrier()
    if w.rank == 0:
        print(f"03_all_reduce: OK on {w.world_size} ranks (hand-written one-shot, library one_shot / two_shot / "
              "auto, reduce_scatter, broadcast)")
    weft.finalize()


if __name__ == "__main__":
    main()
