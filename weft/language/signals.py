"""Signals: flags in the symmetric heap, published with release, awaited with acquire.

Flags are int32 or int64 words. Kernels count epochs in them instead of
resetting them, so back-to-back launches (and CUDA-graph replays) need no
host-side clean-up.

The cross-rank signature check (`sign`, `check_signed`, `signature_live`): every collective launch carries its
plan's fingerprint `fp` (a 31-bit hash of what the members must agree on). A family's workspace holds `sig`:
int64 words [2][W] (one per member and call parity) and one `tripped` word after them. Each program first
publishes (epoch, fp) as an LL word into slot [epoch % 2][me] of every member (`sign`), and before its first
wait on a peer's signal or data it awaits every member's word of its epoch and compares (`check_signed`).
Every member's launch of an epoch writes its word whatever its grid or pass count, so the check never hangs
on a mismatch, and once it passes the members run the same protocol. A mismatch is recorded in the error
word `err` and trips this rank's family (`tripped`: its later launches do nothing until the host has raised
the error and resynchronised the epochs: a launch already queued on a GPU behind the mismatched one, the
next pass of a call, must not wait for a peer that runs no such pass), and the program skips the rest of
the launch: no more waits, no output.

The words of a parity are reused two calls later, as the families' double-buffered halves are: a member
writes slot [e % 2] of my words in call e + 2 only after its call e + 1 waited on mine, which I signalled
after my call e, the last reader of that slot, had completed.
"""
import triton
import triton.language as tl

from . import interpreter, nvshmem, ptx
from .core import (CMP_EQ, CMP_GE, CMP_GT, CMP_LE, CMP_LT, CMP_NE, INTERPRET, SIGNAL_ADD, SIGNAL_SET, SCOPE_SYS,
                   WAIT_TIMEOUT_NS, network_at, num_ranks, rank, symm_at)


@triton.jit
def notify(flag_ptr, peer, heap, value=1, op: tl.constexpr = SIGNAL_SET, scope: tl.constexpr = SCOPE_SYS):
    """Publish `value` into rank `peer`'s copy of the flag at `flag_ptr` (op SIGNAL_SET or SIGNAL_ADD).

    Release semantics for the whole program: every store the program made
    before the call is visible to whoever acquires the flag.
    """
    _publish(symm_at(flag_ptr, peer, heap), value, op, scope)


@triton.jit
def _publish(remote, value, op: tl.constexpr, scope: tl.constexpr):
    """Release-store (SIGNAL_SET) or release-add `value` at the translated flag `remote`."""
    v = tl.full([], value, remote.dtype.element_ty)
    if INTERPRET:
        if op == SIGNAL_ADD:
            tl.atomic_add(remote, v, sem="release", scope="sys")
        else:
            tl.atomic_xchg(remote, v, sem="release", scope="sys")
    else:
        tl.debug_barrier()
        ptx.signal_thread0(remote, v, op == SIGNAL_ADD, scope)


# Flags a program polls, or ranks it signals, at once: one per lane of a warp.
LANES = tl.constexpr(32)


@triton.jit
def notify_all(flag_ptr, heap, value=1, op: tl.constexpr = SIGNAL_SET, scope: tl.constexpr = SCOPE_SYS):
    """`notify` to every rank (myself included), all at once: lane r publishes to rank r.

    One release per lane instead of one release after another: each release
    must wait for the program's earlier stores to complete, so W serial
    notifies cost W times that wait.
    """
    world = num_ranks(heap)
    for base in range(0, world, LANES):
        peers = base + tl.arange(0, LANES)
        live = peers < world
        remote = symm_at(flag_ptr, tl.where(live, peers, 0), heap)
        v = tl.full([LANES], value, flag_ptr.dtype.element_ty)
        if not INTERPRET:
            tl.debug_barrier()  # the program's stores happen before any lane's release
        if op == SIGNAL_ADD:
            tl.atomic_add(remote, v, mask=live, sem="release", scope=scope)
        else:
            tl.atomic_xchg(remote, v, mask=live, sem="release", scope=scope)


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
def wait(flag_ptr, count, value, cmp: tl.constexpr = CMP_EQ, scope: tl.constexpr = SCOPE_SYS, heap=None, peer=0,
         op: tl.constexpr = tl.constexpr("wait"), ranks: tl.constexpr = 0, backoff_ns: tl.constexpr = 0):
    """Spin (acquire) until the `count` flags from `flag_ptr` on satisfy `flag <cmp> value`.

    Every thread of the program polls for itself, so each thread's later loads
    are ordered after its own acquire. Returns a token for `consume_token`.
    With WEFT_WAIT_TIMEOUT_S set, gives up after that long with a report naming
    the waiting rank (from `heap`, when given), the op (`op`), the rank whose
    signal is missing (flag i is raised by rank `peer + i`; with `ranks` > 0,
    flags laid out [program][rank], by rank i % ranks), the expected and the
    seen value: an error on the cpu backend; a printed report and a trap on
    the GPU. `backoff_ns` > 0: each poll after the first sleeps about that long
    first (ptx.nanosleep), for programs that share an SM with working ones.
    """
    if INTERPRET:
        me = -1
        if heap is not None:
            me = rank(heap)
        return interpreter.spin_wait(flag_ptr, count, value, cmp, me, peer, op, ranks)
    else:
        # Lane i of every warp polls flag base + i: up to 32 flags in one round trip. A CTA barrier
        # after the loop orders every thread's later loads after the acquires (barrier + acquire).
        lanes = tl.arange(0, LANES)
        seen = tl.zeros([LANES], flag_ptr.dtype.element_ty)
        if WAIT_TIMEOUT_NS > 0:
            start = ptx.global_timer()
        for base in range(0, count, LANES):
            ptrs = flag_ptr + tl.minimum(base + lanes, count - 1)
            seen = ptx.ld_acquire(ptrs, scope)
            ok = _holds(seen, value, cmp).to(tl.int32)
            while tl.min(ok, axis=0) == 0:
                if WAIT_TIMEOUT_NS > 0:
                    if ptx.global_timer() - start > WAIT_TIMEOUT_NS:
                        i = tl.min(tl.where(ok == 0, base + lanes, count), axis=0)
                        me = -1
                        if heap is not None:
                            me = rank(heap)
                        whom = peer + i
                        if ranks > 0:
                            whom = i % ranks
                        tl.device_print("weft " + op + " wait timed out: rank, waits for rank, flag index, "
                                        "address, expected, seen ", me, whom, i,
                                        (flag_ptr + i).to(tl.int64, bitcast=True), value,
                                        tl.min(tl.where(base + lanes == i, seen, value), axis=0))
                        ptx.trap()
                if backoff_ns > 0:
                    ptx.nanosleep(backoff_ns)
                seen = ptx.ld_acquire(ptrs, scope)
                ok = _holds(seen, value, cmp).to(tl.int32)
        tl.debug_barrier()
        return tl.max(seen, axis=0)


@triton.jit
def next_epoch(counter):
    """The epoch of this launch: one more than the previous launch's, the same in every program of the grid.

    `counter` is one int64 word (zeroed once, never reset), local to this rank: [epoch | programs that
    have taken it]. Each program takes a ticket with one atomic, whose result carries the epoch, so no
    program can see another launch's value; the last program to take one publishes the epoch for the
    next launch (every program of this grid has read it by then). Kernels count their signals in these
    epochs, so buffers can be double-buffered by the parity of the *call*, whatever the grid size of
    each call. One atomic per program, issued at its start, instead of a plain load.
    """
    word = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    epoch = (word >> 32) + 1
    ticket = word & 0xFFFFFFFF
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    if ticket == programs - 1:
        tl.atomic_xchg(counter, epoch << 32, sem="relaxed", scope="gpu")
    return epoch.to(tl.int32)


@triton.jit
def last_epoch(counter):
    """The epoch the last launch on `counter` took with `next_epoch`, for a later kernel of the same call
    (a receive half launched after its send half): that launch has ended (stream order), and its last
    program left [epoch | 0] in the word."""
    return (tl.load(counter, volatile=True) >> 32).to(tl.int32)


@triton.jit
def pack_ll(payload, epoch):
    """Low-latency (LL) words: int32 `payload` in the low half of an int64, `epoch` in the high half.

    A peer stores a word in one 8-byte store, which is single-copy atomic: whoever sees the epoch in
    a word sees its payload, so data needs no separate flag, fence or release (one one-way trip
    instead of data, fence and flag). Costs twice the bytes: for small messages.
    """
    return (epoch.to(tl.int64) << 32) | (payload.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def wait_ll(ptrs, mask, epoch, heap=None, peer=-1, op: tl.constexpr = tl.constexpr("LL wait")):
    """Spin until every LL word at `ptrs` (any shape; where `mask`) carries `epoch`; returns their int32 payloads.

    The words are polled with volatile loads (straight from L2, where peers' NVLink stores land).
    WEFT_WAIT_TIMEOUT_S applies as in `wait`; the report names the waiting rank (from `heap`), the op,
    `peer` (the rank that writes these words), the expected epoch and the one seen.
    """
    if INTERPRET:
        me = -1
        if heap is not None:
            me = rank(heap)
        words = interpreter.spin_wait_ll(ptrs, mask, epoch, me, peer, op)
    else:
        # Spin on a scalar (a tensor carried through the loop trips Triton 3.6's layout passes),
        # then load the words that have all arrived.
        arrived = 0
        if WAIT_TIMEOUT_NS > 0:
            start = ptx.global_timer()
        while arrived == 0:
            tags = (tl.load(ptrs, mask=mask, other=0, volatile=True) >> 32).to(tl.int32)
            arrived = tl.min(((tags == epoch) | (mask == 0)).to(tl.int32))
            if WAIT_TIMEOUT_NS > 0:
                if (arrived == 0) & (ptx.global_timer() - start > WAIT_TIMEOUT_NS):
                    me = -1
                    if heap is not None:
                        me = rank(heap)
                    tl.device_print("weft " + op + " timed out: rank, waits for rank, expected epoch, seen ", me,
                                    peer, epoch, tl.min(tl.where(mask & (tags != epoch), tags, 0x7FFFFFFF), axis=0))
                    ptx.trap()
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    return words.to(tl.int32)


# -- the cross-rank signature check ----------------------------------------------------------------------

@triton.jit
def signature_live(sig, heap):
    """Whether this rank's family may run its launch: not tripped by a signature mismatch the host has not
    raised yet (its `tripped` word, after the [2][W] signature words)."""
    return tl.load(sig + 2 * num_ranks(heap), volatile=True) == 0


@triton.jit
def sign(sig, epoch, fp, heap):
    """Publish this launch's fingerprint `fp` as the LL word (epoch, fp) into slot [epoch % 2][me] of every
    member's `sig`, all members at once (a lane each). Issued before the program's signals, whose release
    then covers it too."""
    if INTERPRET:
        interpreter.sign_words(sig, epoch, fp, heap)
    else:
        me = rank(heap)
        n = num_ranks(heap)
        word = pack_ll(fp + tl.zeros([], tl.int32), epoch + tl.zeros([], tl.int32))
        for base in range(0, n, LANES):
            peers = base + tl.arange(0, LANES)
            live = peers < n
            slot = sig + (epoch % 2) * n + me
            tl.store(symm_at(slot, tl.where(live, peers, 0), heap), tl.full([LANES], 0, tl.int64) + word, mask=live)


@triton.jit
def signature_words(sig, epoch, heap):
    """The first LANES members' signature words of `epoch` as they are now: one volatile load, no wait. Loaded
    before a wait for the members' data and passed to check_signed (`seen`), they spare it a round trip of its
    own where every member had signed by then."""
    if INTERPRET:
        return tl.zeros([LANES], tl.int64)
    n = num_ranks(heap)
    peers = tl.arange(0, LANES)
    live = peers < n
    return tl.load(_signature_slots(sig, epoch, n, peers, live), mask=live, other=0, volatile=True)


@triton.jit
def _signature_slots(sig, epoch, n, peers, live):
    """The signature words of `epoch` of members `peers` (where `live`; member 0's elsewhere) among n."""
    return sig + (epoch % 2) * n + tl.where(live, peers, 0)


@triton.jit
def check_signed(sig, epoch, fp, heap, err, op: tl.constexpr = tl.constexpr("signature check"), seen=None):
    """Whether every member's launch of `epoch` carries `fp`: awaits each member's signature word of this epoch
    (LL: no flag needed), compares. On a mismatch records [1, peer, mine, theirs] in the error word `err`
    (words 1.. first, word 0 last) and trips this rank's family (`signature_live`), and returns False: the
    program must not write its output. `op` names the op in a wait timeout's report (a member that runs no call
    of the family). `seen`: signature_words loaded earlier; where they all carry `epoch`, no wait."""
    if INTERPRET:
        return interpreter.check_signed_words(sig, epoch, fp, heap, err, op)
    n = num_ranks(heap)
    bad_peer = n
    theirs = fp + tl.zeros([], tl.int32)
    for base in range(0, n, LANES):
        peers = base + tl.arange(0, LANES)
        live = peers < n
        slots = _signature_slots(sig, epoch, n, peers, live)
        if seen is not None:
            ready = (base == 0) & (tl.min((((seen >> 32).to(tl.int32) == epoch) | ~live).to(tl.int32)) == 1)
            if ready:
                got = (seen & 0xFFFFFFFF).to(tl.int32)
            else:
                got = wait_ll(slots, live, epoch, heap=heap, op=op)
        else:
            got = wait_ll(slots, live, epoch, heap=heap, op=op)
        other = live & (got != fp)
        first = tl.min(tl.where(other, peers, n), axis=0)
        if (first < n) & (bad_peer == n):
            bad_peer = first
            theirs = tl.max(tl.where(peers == first, got, 0), axis=0)
    if bad_peer < n:
        tl.store(err + 1, bad_peer.to(tl.int64))
        tl.store(err + 2, (fp + tl.zeros([], tl.int32)).to(tl.int64))
        tl.store(err + 3, theirs.to(tl.int64))
        tl.store(err, tl.full([], 1, tl.int64))
        tl.store(sig + 2 * n, tl.full([], 1, tl.int64))
    return bad_peer == n


@triton.jit
def consume_token(x, token):
    """`x` carrying a data dependency on `token`, so loads through it come after the wait.

    The dependency is 0 times 256: a bare opaque 0 would hide x's alignment from Triton's analysis, and every
    load through the pointer would then go element by element instead of in 16-byte vectors."""
    if INTERPRET:
        return x
    else:
        return x + ptx.depend(token) * 256


@triton.jit
def fence():
    """Order this thread's earlier memory operations before its later ones, system-wide."""
    if not INTERPRET:
        ptx.fence_sys()


@triton.jit
def program_sync():
    """Make this program's earlier stores visible to all of its threads (a CTA barrier). A scalar store is made by
    one thread and a later scalar load by every thread: a kernel that reads back its own words (counters, state)
    needs this between the two."""
    if not INTERPRET:
        tl.debug_barrier()


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
    notify_all(bar + 1 + me, heap, 1, SIGNAL_ADD)
    wait(bar + 1, n, epoch, CMP_GE, heap=heap, op="barrier_all")


@triton.jit
def signal_op(sig_addr, signal, sig_op: tl.constexpr, peer, heap):
    """`notify` as a network primitive: `peer` may be on another node (weft.language.core.network_at)."""
    _publish(network_at(sig_addr, peer, heap), signal, sig_op, SCOPE_SYS)


@triton.jit
def signal_wait_until(sig_addr, cmp: tl.constexpr, cmp_value, NVSHMEM: tl.constexpr = False):
    """Spin (acquire) until my flag at `sig_addr` satisfies `flag <cmp> cmp_value`. NVSHMEM: NVSHMEM's wait on
    an int64 signal word (weft.language.nvshmem). Returns a token for `consume_token`."""
    if NVSHMEM:
        return nvshmem.signal_wait_until(sig_addr, cmp, cmp_value)
    else:
        return wait(sig_addr, 1, cmp_value, cmp)
