"""Context and memory: who am I, and where is this object on another rank.

Every weft kernel receives the heap descriptor `heap` (an int64 pointer):
    heap[0] = my rank, heap[1] = world size, heap[2 + r] = base of rank r's heap,
    heap[2 + W + r] = the node rank r runs on, heap[2 + 2W + r] = rank r's world rank (its NVSHMEM PE)

`symm_at` reaches the ranks of this node (loads and stores through the peer mappings); a rank on another node
is reached only through the network primitives (weft.language.shmem's puts and gets, `signal_op`,
`signal_wait_until`), which translate with `network_at`. On the cpu backend `symm_at` to an off-node rank
raises OffNodeAccess, so a kernel that cheats across simulated nodes fails its tests.
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
def same_node(peer, heap):
    """Whether rank `peer` (a rank or a block of ranks) runs on this rank's node: reachable through `symm_at`."""
    world = tl.load(heap + 1)
    return tl.load(heap + 2 + world + peer) == tl.load(heap + 2 + world + tl.load(heap))


@triton.jit
def _translate(ptr, peer, me, heap):
    blocks = (tl.load(heap + 2 + peer) - tl.load(heap + 2 + me)) >> 8
    ELEM: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    return ptr + blocks * (256 // ELEM)


@triton.jit
def network_at(ptr, peer, heap):
    """`symm_at` for the network primitives, to a rank of any node. On the cpu backend every node's heap lies in
    one shared file (the simulated network); on GPUs a peer on another node has no mapping (base 0): there the
    primitives reach other nodes only in their NVSHMEM form (weft.language.nvshmem), which needs no translation."""
    me = tl.load(heap)
    if INTERPRET:
        interpreter.stall_before_peer(me, peer)  # WEFT_TEST_DELAY: a peer's data arrives late
    return _translate(ptr, peer, me, heap)


@triton.jit
def network_pe(peer, heap):
    """Rank `peer`'s world rank: its PE number in NVSHMEM, which torch bootstraps over the world (the network
    primitives' NVSHMEM form addresses PEs, not a group's ranks)."""
    return tl.load(heap + 2 + 2 * tl.load(heap + 1) + peer).to(tl.int32)


@triton.jit
def symm_at(ptr, peer, heap):
    """`ptr` (into my heap) translated to the same object on rank `peer`, a rank of this node (another node's
    ranks are reached through the network primitives; on the cpu backend this raises OffNodeAccess).

    The heaps' bases lie a multiple of 256 bytes apart (the heap checks it), so the move is counted in
    256-byte blocks: Triton then still sees `ptr`'s alignment in the result and keeps 16-byte vector
    accesses through it (an opaque byte offset would make every access element-sized).
    """
    me = tl.load(heap)
    if INTERPRET:
        interpreter.check_same_node(heap, me, peer)  # OffNodeAccess: another node is reached by the network only
        interpreter.stall_before_peer(me, peer)  # WEFT_TEST_DELAY: a peer's data arrives late
    return _translate(ptr, peer, me, heap)


remote_ptr = symm_at
