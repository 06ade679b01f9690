"""A device-side barrier across ranks, as a kernel (graph-capturable, no host sync)."""
import torch
import triton

import weft.language as wl

from .common import world_or_raise


@triton.jit
def barrier_all_kernel(bar, heap):
    wl.barrier_all(bar, heap)


class BarrierContext:
    """One program slot of barrier words: [epoch, arrivals from each rank]."""

    def __init__(self, world):
        self.bar = world.heap.empty((1 + world.world_size,), torch.int32)
        self.bar.zero_()
        world.barrier()  # nobody signals into words a peer has not zeroed yet


def device_barrier() -> None:
    """Every rank's stream waits here until all ranks' streams have arrived."""
    world = world_or_raise()
    ctx = world.context("device_barrier", lambda: BarrierContext(world))
    barrier_all_kernel[(1,)](ctx.bar, world.heap.descriptor, num_warps=1)


COMPILE_CASES = [(barrier_all_kernel, dict(bar="*i32", heap="*i64"), {})]
