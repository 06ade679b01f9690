"""A device-side barrier across ranks, as a kernel (graph-capturable, no host sync)."""
from __future__ import annotations

import torch
import triton

import weft.language as wl

from .common import Launch, group_name, resolve, workspace, zero_everywhere
from .registry import declare_op


@triton.jit
def barrier_all_kernel(bar, heap):
    wl.barrier_all(bar, heap)


class BarrierWorkspace:
    """One program slot of barrier words: [epoch, arrivals from each member], and the launch."""

    def __init__(self, group):
        self.bar = group.heap.empty((1 + group.size,), torch.int32)
        zero_everywhere(group, self.bar)
        self.launch = Launch(barrier_all_kernel, (1,), (self.bar, group.heap.descriptor), {}, num_warps=1)
        self.args = (self.bar, group.heap.descriptor)
        if self.launch.kernel is not None:  # compiled: addresses are all it takes
            self.args = tuple(t.data_ptr() for t in self.args)


@declare_op(collective=True)
def device_barrier(group=None) -> None:
    """Every member's stream waits here until all members' streams have arrived (group: default the world)."""
    ws = workspace(resolve(group), "device_barrier", BarrierWorkspace)
    ws.launch(*ws.args)


# torch.ops.weft.device_barrier(group_name) -> (): a collective with no tensors, kept by graph passes.
@device_barrier.define
def device_barrier_op(group_name: str) -> None:
    device_barrier.eager(group_name)


@device_barrier_op.register_fake
def _(group_name):
    return None


@device_barrier.traced
def _(group=None):
    torch.ops.weft.device_barrier(group_name(group))


COMPILE_CASES = [(barrier_all_kernel, dict(bar="*i32", heap="*i64"), {})]
