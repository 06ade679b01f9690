"""A device-side barrier across ranks, as a kernel (graph-capturable, no host sync)."""
from __future__ import annotations

import torch
import triton

import weft.language as wl

from .common import Launch, check_world_size, workspace, world_or_raise, world_size, zero_everywhere
from .registry import declare_op


@triton.jit
def barrier_all_kernel(bar, heap):
    wl.barrier_all(bar, heap)


class BarrierWorkspace:
    """One program slot of barrier words: [epoch, arrivals from each rank], and the launch."""

    def __init__(self, world):
        self.bar = world.heap.empty((1 + world.world_size,), torch.int32)
        zero_everywhere(world, self.bar)
        self.launch = Launch(barrier_all_kernel, (1,), (self.bar, world.heap.descriptor), {}, num_warps=1)
        self.args = (self.bar, world.heap.descriptor)
        if self.launch.kernel is not None:  # compiled: addresses are all it takes
            self.args = tuple(t.data_ptr() for t in self.args)


@declare_op(collective=True)
def device_barrier() -> None:
    """Every rank's stream waits here until all ranks' streams have arrived."""
    ws = workspace(world_or_raise(), "device_barrier", BarrierWorkspace)
    ws.launch(*ws.args)


# torch.ops.weft.device_barrier(world_size) -> (): a collective with no tensors, kept by graph passes.
@device_barrier.define
def device_barrier_op(world_size: int) -> None:
    check_world_size(world_size)
    device_barrier.eager()


@device_barrier_op.register_fake
def _(world_size):
    return None


@device_barrier.traced
def _():
    torch.ops.weft.device_barrier(world_size())


COMPILE_CASES = [(barrier_all_kernel, dict(bar="*i32", heap="*i64"), {})]
