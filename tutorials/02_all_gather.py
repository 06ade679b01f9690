"""Tutorial 02 — all-gather by pushing into peers' symmetric memory.

    weft run -n 4 tutorials/02_all_gather.py

`weft.empty` allocates from the symmetric heap: the same offset on every
rank, so `wl.symm_at(ptr, peer, heap)` turns a pointer to *my* buffer into a
pointer to *peer's* buffer, and a plain `tl.store` through it writes over
NVLink (or, on the cpu backend, into the peer's shared memory).

The hand-written kernel below is the whole idea of a push all-gather:
  1. store my shard into slot `me` of every rank's output,
  2. notify each rank that my slot has arrived (release),
  3. wait until every rank's slot has arrived in my output (acquire).
An epoch number makes the flags reusable without a reset. The library's
`weft.ops.all_gather` adds what a real op needs: many programs, 16-byte
vector copies, a "ready" handshake so a fast rank never overwrites a buffer
a slow rank is still reading, a pull variant, and argument checks.
"""
import torch
import triton
import triton.language as tl

import weft
import weft.language as wl


@triton.jit(do_not_specialize=["epoch"])
def push_all_gather_kernel(x, out, arrived, heap, n, epoch, BLOCK: tl.constexpr):
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    offs = tl.arange(0, BLOCK)
    for q in range(world):
        dst = wl.symm_at(out, q, heap) + me * n
        for start in range(0, n, BLOCK):
            mask = start + offs < n
            tl.store(dst + start + offs, tl.load(x + start + offs, mask=mask), mask=mask)
        wl.notify(arrived + me, q, heap, epoch)
    wl.wait(arrived, world, epoch, wl.CMP_GE)


def main():
    weft.init()
    w = weft.world()
    n = 1000
    out = weft.empty((w.world_size * n,), torch.float32)
    arrived = weft.zeros((w.world_size,), torch.int32)
    weft.barrier()
    def shard(rank, epoch):  # every rank can recompute every rank's input
        return torch.randn(n, generator=torch.Generator().manual_seed(1000 * epoch + rank))

    for epoch in range(1, 4):
        out.fill_(float("nan"))
        weft.barrier()  # this simple kernel has no "ready" handshake: nobody pushes into a buffer being reset
        x = shard(w.rank, epoch).to(w.device)
        push_all_gather_kernel[(1,)](x, out, arrived, w.heap.descriptor, n, epoch, BLOCK=256)
        expected = torch.cat([shard(q, epoch) for q in range(w.world_size)])
        assert torch.equal(out.cpu(), expected), f"rank {w.rank}, epoch {epoch}: wrong gather"
        weft.barrier()  # everyone has checked before the next epoch overwrites

    # The library op: any input, pull into a plain tensor or push into a symmetric one.
    x = torch.randn(3, 5, device=w.device) + w.rank
    gathered = weft.ops.all_gather(x)
    assert gathered.shape == (3 * w.world_size, 5)
    for q in range(w.world_size):
        assert torch.all((gathered[3 * q:3 * q + 3] - q).abs() < 10)
    assert torch.equal(gathered[3 * w.rank:3 * w.rank + 3], x)
    weft.barrier()
    if w.rank == 0:
        print(f"02_all_gather: hand-written push kernel and weft.ops.all_gather agree on {w.world_size} ranks")
    weft.finalize()


if __name__ == "__main__":
    main()
