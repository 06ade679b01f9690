"""Hardware registers. Under the interpreter a program is one vectorised
thread, so tid/lane/sm are 0 and the timer is the host's monotonic clock."""
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
