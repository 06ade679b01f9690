"""Signals: flags in the symmetric heap, published with release, awaited with acquire.

Flags are int32 or int64 words. Kernels count epochs in them instead of
resetting them, so back-to-back launches (and CUDA-graph replays) need no
host-side clean-up.
"""
import triton
import triton.language as tl

from . import interpreter, ptx
from .core import (CMP_EQ, CMP_GE, CMP_GT, CMP_LE, CMP_LT, CMP_NE, INTERPRET, SIGNAL_ADD, SIGNAL_SET, SCOPE_SYS,
                   WAIT_TIMEOUT_NS, num_ranks, rank, symm_at)


@triton.jit
def notify(flag_ptr, peer, heap, value=1, op: tl.constexpr = SIGNAL_SET, scope: tl.constexpr = SCOPE_SYS):
    """Publish `value` into rank `peer`'s copy of the flag at `flag_ptr` (op SIGNAL_SET or SIGNAL_ADD).

    Release semantics for the whole program: every store the program made
    before the call is visible to whoever acquires the flag.
    """
    remote = symm_at(flag_ptr, peer, heap)
    v = tl.full([], value, flag_ptr.dtype.element_ty)
    if INTERPRET:
        if op == SIGNAL_ADD:
            tl.atomic_add(remote, v, sem="release", scope="sys")
        else:
            tl.atomic_xchg(remote, v, sem="release", scope="sys")
    else:
        tl.debug_barrier()
        ptx.signal_thread0(remote, v, op == SIGNAL_ADD, scope)


@triton.jit
def _holds(seen, value, cmp: tl.constexpr):
    if cmp == CMP_EQ:
        return seen == value
    elif cmp == CMP_NE:
        return seen != value
    elif cmp == CMP_GT:
        return seen > value
    elif cmp == CMP_LE:
        return seen <= value
    elif cmp == CMP_LT:
        return seen < value
    else:
        return seen >= value


@triton.jit
def wait(flag_ptr, count, value, cmp: tl.constexpr = CMP_EQ, scope: tl.constexpr = SCOPE_SYS):
    """Spin (acquire) until the `count` flags from `flag_ptr` on satisfy `flag <cmp> value`.

    Every thread of the program polls for itself, so each thread's later loads
    are ordered after its own acquire. Returns a token for `consume_token`.
    With WEFT_WAIT_TIMEOUT_S set, gives up after that long: an error naming the
    rank, the flag and the values on the cpu backend; a printed report and a
    trap on the GPU.
    """
    if INTERPRET:
        return interpreter.spin_wait(flag_ptr, count, value, cmp)
    else:
        seen = ptx.ld_acquire(flag_ptr, scope)
        if WAIT_TIMEOUT_NS > 0:
            start = ptx.global_timer()
        for i in range(count):
            seen = ptx.ld_acquire(flag_ptr + i, scope)
            while not _holds(seen, value, cmp):
                if WAIT_TIMEOUT_NS > 0:
                    if ptx.global_timer() - start > WAIT_TIMEOUT_NS:
                        tl.device_print("weft wait timed out: flag index, address, expected, seen ", i,
                                        (flag_ptr + i).to(tl.int64, bitcast=True), value, seen)
                        ptx.trap()
                seen = ptx.ld_acquire(flag_ptr + i, scope)
        return seen


@triton.jit
def consume_token(x, token):
    """`x` carrying a data dependency on `token`, so loads through it come after the wait."""
    if INTERPRET:
        return x
    else:
        return x + ptx.depend(token)


@triton.jit
def fence():
    """Order this thread's earlier memory operations before its later ones, system-wide."""
    if not INTERPRET:
        ptx.fence_sys()


@triton.jit
def quiet():
    """Complete this program's outstanding puts (stores through NVLink are fenced)."""
    if not INTERPRET:
        tl.debug_barrier()
        ptx.fence_sys()


@triton.jit
def barrier_all(bar, heap):
    """Device-side barrier across all ranks for one program slot.

    `bar` points to this slot's 1 + world_size int32 words in the symmetric
    heap, zeroed once: [epoch, arrivals from rank 0, ..., rank W-1]. Every
    rank adds 1 to its arrival word on each peer and waits until all of its
    own arrival words reach its new epoch; no reset is ever needed.
    """
    me = rank(heap)
    n = num_ranks(heap)
    epoch = tl.load(bar) + 1
    tl.debug_barrier()
    tl.store(bar, epoch)
    for peer in range(n):
        notify(bar + 1 + me, peer, heap, 1, SIGNAL_ADD)
    wait(bar + 1, n, epoch, CMP_GE)


@triton.jit
def signal_op(sig_addr, signal, sig_op: tl.constexpr, peer, heap):
    notify(sig_addr, peer, heap, signal, sig_op)


@triton.jit
def signal_wait_until(sig_addr, cmp: tl.constexpr, cmp_value):
    return wait(sig_addr, 1, cmp_value, cmp)
