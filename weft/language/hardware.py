"""Hardware registers and cache hints. Under the interpreter a program is one vectorised
thread, so tid/lane/sm are 0, the timer is the host's monotonic clock and a prefetch does nothing."""
import triton
import triton.language as tl

from . import interpreter, ptx
from .core import INTERPRET


@triton.jit
def _special_register(name: tl.constexpr):
    if INTERPRET:
        return tl.full([], 0, tl.int32)
    else:
        return ptx.special_reg(name)


@triton.jit
def tid():
    return _special_register("tid.x")


@triton.jit
def lane_id():
    return _special_register("laneid")


@triton.jit
def sm_id():
    return _special_register("smid")


@triton.jit
def global_timer():
    """Nanoseconds (GPU: %globaltimer)."""
    if INTERPRET:
        return interpreter.monotonic_ns()
    else:
        return ptx.global_timer()


@triton.jit
def prefetch_l2(ptr, mask):
    """Fetch the lines of `ptr` where `mask` holds into L2 (GPU: prefetch.global.L2, one per element: give one
    address a 128-byte line). A hint: nothing is loaded, no fault is raised; nothing on the cpu backend."""
    if not INTERPRET:
        ptx.prefetch_l2(ptr, mask)
