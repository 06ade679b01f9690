"""Programmatic dependent launch (Hopper and later): a kernel's programs start while the kernel before it on the
stream is still finishing, and wait for it only where they need its results.

A kernel launched as a dependent (weft.kernels.common.Launch's `dependent`; the driver's programmatic stream
serialization) may begin once every program of the kernel before it has called `release_dependents` (or ended).
It must call `wait_prior_kernel` before it reads anything the kernel before wrote or writes anything that kernel
reads: the wait returns once that kernel has ended and its memory is visible. What a program may do before its
wait is work on data no kernel of the stream writes — a decode step's weights: `prefetch_l2` of the first slab it
will stream, so that HBM keeps reading across the boundary between two kernels instead of idling through the
first kernel's last programs and the second's launch.

Call `release_dependents` after `wait_prior_kernel`: then the kernel after may start only once the kernel before
has ended, so at most two kernels' programs share the GPU and the chain stays ordered (the kernel before a
dependent one ended before that one passed its wait, and so on down the stream). Under the interpreter (cpu) the
calls do nothing: its kernels run one after another. Kernels take a `DEPENDENT` constexpr and call these only
when it is set, so that the same kernel compiles for GPUs without the instructions (sm_80).
"""
import triton

from . import ptx
from .core import INTERPRET


@triton.jit
def wait_prior_kernel():
    """Wait until the kernel before this one on the stream has ended and its writes are visible (no wait if this
    kernel was not launched as a dependent)."""
    if not INTERPRET:
        ptx.grid_dependency_wait()


@triton.jit
def release_dependents():
    """Let the kernel after this one on the stream start its programs (once every program of this kernel has
    called it or ended), if it is launched as a dependent."""
    if not INTERPRET:
        ptx.launch_dependents()


@triton.jit
def prefetch_l2(ptr, mask):
    """Fetch the lines of `ptr` (a tensor of pointers) where `mask` holds into L2, loading nothing into
    registers: a hint that costs one instruction per line."""
    if not INTERPRET:
        ptx.prefetch_l2(ptr, mask)
