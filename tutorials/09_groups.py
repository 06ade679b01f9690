"""Tutorial 09 — groups: which rank is in which group, and why kernels see group ranks.

    weft run -n 4 tutorials/09_groups.py

A real job splits its ranks along several axes: tensor parallelism (TP) inside a few GPUs, data parallelism
(DP) across the copies of the model. On 4 ranks with TP = 2:

    world ranks   0   1   2   3
    TP groups    [0   1] [2   3]       weft.new_subgroups(2): consecutive ranks, one model replica each
    DP groups    [0,      2]           weft.new_group([0, 2]) and weft.new_group([1, 3]): the same shard
                     [1,      3]       of the model in each replica

`new_group` is collective over the world (every rank calls it for every group, as torch.distributed.new_group
wants); members get a `weft.Group`, the others None. A group's ranks follow world order: group rank i is its
i-th smallest world rank. Every op takes `group=` (None: the world).

Kernels never learn about groups. A group has its own symmetric heap, and the heap descriptor it hands a kernel
is [my rank in the group, group size, base of member 0, base of member 1, ...]: `wl.rank(heap)`,
`wl.num_ranks(heap)` and `wl.symm_at(ptr, q, heap)` are group-relative, so the kernel below, written for "all
ranks", runs unchanged over the world, a TP group, a DP group or a group of one.
"""
import torch
import triton
import triton.language as tl

import weft
import weft.language as wl


@triton.jit
def who_is_there_kernel(seen, heap):
    """Write (my world rank) into slot `me` of every member's `seen`: afterwards seen[q] on every member is the
    world rank of group rank q. `seen` is symmetric in the group's heap."""
    me = wl.rank(heap)
    for q in range(wl.num_ranks(heap)):
        tl.store(wl.symm_at(seen, q, heap) + me, tl.load(seen + wl.num_ranks(heap)))


def main():
    weft.init()
    world, me = weft.world_size(), weft.rank()
    tp = weft.new_subgroups(2)
    dp = None
    for first in range(2):
        made = weft.new_group(range(first, world, 2))
        dp = dp or made
    one = weft.new_subgroups(1)

    for name, group in (("world", weft.get_group()), ("TP", tp), ("DP", dp), ("one", one)):
        # Slots 0..size-1 are written by the members; slot `size` holds this rank's world rank, the kernel's input.
        seen = weft.zeros((group.size + 1,), torch.int32, group=group)
        seen[group.size] = me
        group.barrier()
        who_is_there_kernel[(1,)](seen, group.heap.descriptor)
        group.barrier()  # every member's stores have landed
        assert seen[:group.size].tolist() == list(group.ranks), (name, seen)
        print(f"world rank {me}: {name:5s} group rank {group.rank} of {group.size}, members {list(group.ranks)}")
        group.barrier()

    # The library's ops take the same groups: each DP group gathers its members' values, concurrently with
    # the other DP group, and the TP groups likewise.
    x = torch.tensor([float(me)], device=weft.device())
    assert weft.ops.all_gather(x, group=dp).tolist() == [float(r) for r in dp.ranks]
    assert weft.ops.all_gather(x, group=tp).tolist() == [float(r) for r in tp.ranks]
    weft.barrier()
    if me == 0:
        print("every kernel saw its group's ranks only")
    weft.finalize()


if __name__ == "__main__":
    main()
