"""Context and memory: who am I, and where is this object on another rank.

Every weft kernel receives the heap descriptor `heap` (an int64 pointer):
    heap[0] = my rank, heap[1] = world size, heap[2 + r] = base of rank r's heap
"""
import triton
import triton.language as tl

from . import interpreter
from ..runtime import settings
from ..runtime.backend import INTERPRET as _INTERPRET

# Trace-time switch between a primitive's interpreter form and its PTX form.
INTERPRET = tl.constexpr(_INTERPRET)
# WEFT_WAIT_TIMEOUT_S > 0 makes every spin give up after that long (read at import).
WAIT_TIMEOUT_NS = tl.constexpr(int(settings.wait_timeout_s() * 1e9))

# Comparison and signal-op codes, numbered as in NVSHMEM's headers (nvshmemi_cmp_type, nvshmemi_amo_t), so a
# value passes unchanged to NVSHMEM's device library. (torch's NVSHMEM Triton wrappers document SIGNAL_SET 0,
# SIGNAL_ADD 5 and CMP_GE 3: NVSHMEM adds for every op but 9 and reads 3 as LE — scripts/probe_nvshmem.py.)
CMP_EQ = tl.constexpr(0)
CMP_NE = tl.constexpr(1)
CMP_GT = tl.constexpr(2)
CMP_LE = tl.constexpr(3)
CMP_LT = tl.constexpr(4)
CMP_GE = tl.constexpr(5)
SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)
# Memory-model scopes of signals: the whole system (peers over NVLink) or this GPU.
SCOPE_SYS = tl.constexpr("sys")
SCOPE_GPU = tl.constexpr("gpu")


@triton.jit
def rank(heap):
    return tl.load(heap).to(tl.int32)


@triton.jit
def num_ranks(heap):
    return tl.load(heap + 1).to(tl.int32)


@triton.jit
def symm_at(ptr, peer, heap):
    """`ptr` (into my heap) translated to the same object on rank `peer`.

    The heaps' bases lie a multiple of 256 bytes apart (the heap checks it), so the move is counted in
    256-byte blocks: Triton then still sees `ptr`'s alignment in the result and keeps 16-byte vector
    accesses through it (an opaque byte offset would make every access element-sized).
    """
    me = tl.load(heap)
    if INTERPRET:
        interpreter.stall_before_peer(me, peer)  # WEFT_TEST_DELAY: a peer's data arrives late
    blocks = (tl.load(heap + 2 + peer) - tl.load(heap + 2 + me)) >> 8
    ELEM: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    return ptr + blocks * (256 // ELEM)


remote_ptr = symm_at
