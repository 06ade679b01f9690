"""M2N: rows routed from M sender ranks to N receiver ranks and back (m2n_dispatch / m2n_combine), the
disaggregated form of the EP LL ops (MegaScale-Infer's attention -> expert traffic): the senders and receivers are
two disjoint sets of ranks of one group (the union: `group=`, default the world), whose ranks the kernels see.

Dispatch: each sender row t names up to k receivers (`dest[t, j]`: a receiver index in [0, N), or -1 for none).
The rows travel once per receiver, whatever k: sender s writes row t once into each receiver it names, at the row's
slot in that receiver's segment for s (the rows of s naming the receiver, in order), and beside it the position of
the slot's first entry among s's entries for that receiver (row-major (t, j) order: a row's entries for one
receiver are consecutive), then the segment's slot and entry counts, then raises its flag; a receiver waits for
every sender's flag and copies each slot to its entries: recv[s, :counts[s]] are sender s's entries' rows, in
order. Combine: each receiver sums a slot's entries' processed rows y[s, i], each times its weight, in entry order
in fp32 (the sender's combine first writes the weights, by entry position, into the receivers' workspace and
raises a flag there), and pushes that one fp32 row back into sender s's combine segment at the slot; a sender
waits for every receiver and sums a row's slots in the order of their first entries, rounded to x's dtype once:
out[t] = sum over the receivers r of row t of (sum over its entries j for r of weights[t, j] * y_row(t, j)). At
k = 1 a slot is an entry: the receiver pushes y's row as it is and the sender multiplies it by its weight (no
weights travel). So a top-k row crosses the link once per receiver each way instead of k times (k / N times
fewer bytes at N receivers, for fp32 sums of twice the width). One launch per side per op, no host sync,
CUDA-graph capturable.

Work: each launch is a grid of LANES x CHUNKS programs (the plan's choice: weft.tuning `m2n.launch` on GPUs);
program p moves column chunk p % CHUNKS of its lane's rows. A sender's lane is a contiguous block of its tokens;
the program finds each entry's position and each row's slots without talking to the others: its receivers'
entries and slots before the block (histograms of dest's rows before it), then within the block row by row (a
triangular sum over the row's k entries), all in registers. The receivers' lanes (their copies out, their sums
back) take slots u = lane mod LANES of each segment; a sender's combine lanes its tokens, as in dispatch.

Synchronisation (per direction, both the same): the buffers are double-buffered by the call's epoch
(`wl.next_epoch` on a counter per op: every union rank calls each op once per step, so the epochs agree); flags
count epochs and are never reset. A writer (sender in dispatch, receiver in combine) of call e first waits for
every reader's acknowledgement of call e - 1, which a reader releases after it has copied its half out: so when
half e % 2 is rewritten at call e, its last reading (call e - 2) ended before the ack of e - 1 was sent. Only the
writer writes a segment, its counts and its flag; only the reader its acknowledgement word in the writer's heap.
The combine's weights go the other way, in the receivers' own halves: the sender writes those of call e after
the receivers' sums of call e - 1 reached it, which each receiver sent after reading call e - 2's weights (the same
half), and raises a weights flag per call (raised whatever its check found, like the others).
Flags and acks are indexed by role (sender / receiver index), so a group's calls keep one sender set and one
receiver set (another split of the same ranks needs a group of its own).
A side's flag (or ack) is raised once by the last of its programs to finish (`_last_out`: a ticket counter with
release / acquire, so that flag's release covers every program's stores), so the two sides' grids are each
their plan's own. No program waits on a program of its own grid, only on the peers' flags, acks and signature
words, none of which waits on a later program of the waiter's rank: the interpreter, which runs a grid's programs
one after another, runs the protocol as it is.

The signature check (weft.language.signals): the plan signs M, N, k, hidden, dtype, max_tokens and the two rank
sets (group ranks), one fingerprint per op. Every program signs its launch; the readers check every member's
signature before their first wait: the receivers in dispatch, every member in combine. A dispatch sender (a writer
that waits on nothing of the receivers' current call) does not check: waiting for the receivers to start the call
would make a sender that runs calls ahead (weft/models/disaggregated.py: one channel per micro-batch, the
attention side dispatching the next micro-batch while the experts serve the last) wait in a cycle. What it writes
lands in the receivers' workspace half within its own plan's bounds (its quarter), where a receiver that found
the mismatch reads nothing. So a mismatch of the pair (its plans differ, so both fingerprints) is found by the
receivers in dispatch (recv and counts unwritten: no rows) and by every member in combine (nothing written), and
is raised as weft.SignatureMismatch on every member after the combine's launch (on GPUs at the family's next call
or weft.check_errors()), not after the dispatch: the members' raises, which resynchronise collectively, then pair
up. A combine whose members take handles of different plans is found and raised by that combine. The flags and
acks are released whatever the check found, and by a tripped family's launches too (a writer's flag says "I have
done writing", an ack "I no longer read my half": both true of a launch that does nothing), so no wait of the
next matching call hangs.

Workspace: made at the group's first M2N call, collectively (an allocation and a host barrier over the group). That
needs no rank outside the call: the group must be exactly the senders and the receivers, and every one of them
calls each op (unlike p2p, where a first transfer between two members leaves the others out: weft/kernels/p2p.py).
Its data region is four fixed quarters, [op][half], whatever the plan: calls of plans of different sizes never
overlap another half's rows.

A destination outside [-1, N) is never dereferenced: the entry counts as none and the sender records it in the
family's error word, raised (ValueError naming `dest`, the row and the value) after the launch under the
interpreter, and at the family's next call or `weft.check_errors()` on GPUs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning
from .blocks import cast
from .common import (ErrorWord, Launch, Plan, check_tensor, group_name, handle_group, plan, resolve, signature,
                     signature_words, signatures, workspace, zero_everywhere)
from ..runtime.group import Group
from .registry import declare_op, export

ERROR_SET = tl.constexpr(1 << 62)
INDEX_DTYPES = (torch.int32, torch.int64)
# The launch under the interpreter (programs, chunk elements, warps): chunks so small that the tests' rows span
# several, lanes enough that their tokens span several.
M2N_CPU = (6, 8, 4)


@triton.jit
def _wide(v):
    """v as int64 (loop counters are plain ints under the interpreter): offsets of large buffers."""
    return v + tl.zeros([], tl.int64)


@triton.jit
def _start(counter, sig, sig_err, fp, heap, CHECK: tl.constexpr, op: tl.constexpr):
    """The launch's epoch, and whether it may run: its family not tripped (then it signs), and with CHECK every
    member's launch signed with the same fingerprint (awaited and compared: wl.check_signed)."""
    epoch = wl.next_epoch(counter)
    ok = wl.signature_live(sig, heap)
    if ok:
        wl.sign(sig, epoch, fp, heap)
        if CHECK:
            ok = wl.check_signed(sig, epoch, fp, heap, sig_err, op=op)
    return epoch, ok


@triton.jit
def _last_out(done):
    """Whether this program is the last of its grid to get here. Its ticket is taken with release after a CTA
    barrier (every thread's stores, remote ones included, come before it) and acquire, so the last program has
    seen every program's stores, and a flag it then releases covers them all. The last one resets the counter
    for the next launch (stream-ordered after this one). Every program must call it, whatever it did."""
    wl.program_sync()
    ticket = tl.atomic_add(done, 1, sem="acq_rel", scope="sys")
    last = ticket == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _lane_tokens(tokens, lane, LANES: tl.constexpr):
    """Lane `lane`'s contiguous block [lo, hi) of the tokens (the last lane's ends at `tokens`)."""
    share = tl.cdiv(tokens, LANES)
    lo = tl.minimum(lane * share, tokens)
    return lo, tl.minimum(lo + share, tokens)


@triton.jit
def _entries_before(dest, t_end, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """For each receiver n < BLOCK_N: how many entries of dest's rows [0, t_end) name it, and how many of those
    rows name it at least once (its slots); 0 for n >= N."""
    jj = tl.arange(0, BLOCK_K)
    nn = tl.arange(0, BLOCK_N)
    found = tl.zeros([BLOCK_N], tl.int32)
    rows = tl.zeros([BLOCK_N], tl.int32)
    for t0 in range(0, t_end, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        d = tl.load(dest + tt[:, None] * K + jj[None, :], mask=(tt[:, None] < t_end) & (jj[None, :] < K), other=-1)
        hit = (d[:, :, None] == nn[None, None, :]) & (nn < N)[None, None, :]
        per_row = tl.sum(hit.to(tl.int32), axis=1)  # (row, receiver)
        found += tl.sum(per_row, axis=0)
        rows += tl.sum((per_row > 0).to(tl.int32), axis=0)
    return found, rows


@triton.jit
def _peer_of(receiver, receivers, N: tl.constexpr):
    """Group ranks of receiver indices (a tensor of them; anything outside [0, N) gives receivers[0])."""
    peer = tl.zeros_like(receiver) + receivers[0]
    for r in tl.static_range(1, N):
        peer = tl.where(receiver == r, receivers[r], peer)
    return peer


@triton.jit(do_not_specialize=["tokens"])
def m2n_dispatch_kernel(x, dest, routes, recv, counts, buf, starts, seg_counts, flags, acks, counter, done, err, heap,
                        sig, sig_err, fp, tokens, hidden, max_tokens, max_rows, half_elems, half_words, senders,
                        receivers, ME: tl.constexpr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                        SENDER: tl.constexpr, LANES: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """SENDER: column chunk p % CHUNKS of my lane's tokens into their receivers' slots, each token once per receiver
    it names (buf: halves of half_elems elements, each [M][max_tokens][hidden] rows; starts: halves of half_words
    int32, each [M][max_tokens + 1]: slot u's first entry position, then the entry count). The chunk-0 programs
    write routes (T, 2K): [t, j] = receiver * max_rows + the entry's position, [t, K + j] = receiver * max_tokens
    + the row's slot there where j is the row's first entry for that receiver, else -1; and the starts. The last
    lane's chunk-0 program (it has counted every entry) writes my slot counts and the entry counts; the last
    program out raises flags[ME] on every receiver. Else: wait for every sender, copy slots u = lane (mod LANES)
    of each segment to their entries' rows of recv (M, max_rows, hidden), counts (M,) (program 0), routes (M,
    max_tokens + 2): [s, 0] the slot count n, [s, 1 + u] slot u's start, [s, 1 + n] the entry count; the last
    program out acknowledges acks[ME] on every sender. ME: my sender or receiver index; senders / receivers: group
    ranks. Every program signs (sig, fp); a receiver's checks every member's signature first and on a mismatch
    reads nothing (recv, counts, routes unwritten); a sender's does not check (the module doc)."""
    p = tl.program_id(0)
    lane = p // CHUNKS
    cc = (p % CHUNKS) * CHUNK + tl.arange(0, CHUNK)
    cm = cc < hidden
    epoch, ok = _start(counter, sig, sig_err, fp, heap, SENDER == 0, "m2n_dispatch")
    half = buf + _wide(epoch % 2) * half_elems
    starts_half = starts + _wide(epoch % 2) * half_words
    if SENDER:
        if ok:
            for r in tl.static_range(N):
                wl.wait(acks + r, 1, epoch - 1, wl.CMP_GE, heap=heap, peer=receivers[r], op="m2n_dispatch (ack)")
            jj = tl.arange(0, BLOCK_K)
            nn = tl.arange(0, BLOCK_N)
            lo, hi = _lane_tokens(tokens, lane, LANES)
            # My entries and slots before the block, per receiver.
            before, before_slots = _entries_before(dest, lo, K, N, BLOCK_T, BLOCK_K, BLOCK_N)
            for t in range(lo, hi):
                raw = tl.load(dest + t * K + jj, mask=jj < K, other=-1)
                valid = (raw >= 0) & (raw < N)
                d = tl.where(valid, raw, -1).to(tl.int32)
                hit = (d[:, None] == nn[None, :]).to(tl.int32)  # (entry j, receiver): the row's entries
                # Entries i < j of the row naming the same receiver, by a triangular sum: tl.cumsum over the
                # (1, 2) tile of top-1 over 2 receivers failed an assertion of Triton 3.6's scan lowering on H200.
                earlier = (jj[None, :] < jj[:, None]).to(tl.int32)  # (j, i): i comes before j
                ahead = tl.sum(earlier[:, :, None] * hit[None, :, :], axis=1)  # (j, receiver)
                pos = tl.sum(hit * (ahead + before[None, :]), axis=1)
                slot = tl.sum(hit * before_slots[None, :], axis=1)
                first = valid & (tl.sum(hit * ahead, axis=1) == 0)  # the row's first entry for its receiver
                before += tl.sum(hit, axis=0)
                before_slots += tl.max(hit, axis=0)
                peer = _peer_of(d, receivers, N)
                if p % CHUNKS == 0:
                    tl.store(routes + t * 2 * K + jj, tl.where(valid, d * max_rows + pos, -1), mask=jj < K)
                    tl.store(routes + t * 2 * K + K + jj, tl.where(first, d * max_tokens + slot, -1), mask=jj < K)
                    tl.store(wl.symm_at(starts_half + ME * (max_tokens + 1) + slot, peer, heap), pos, mask=first)
                    bad = (raw != -1) & (valid == 0) & (jj < K)
                    if tl.max(bad.to(tl.int32), axis=0) > 0:
                        value = tl.sum(tl.where(jj == tl.min(tl.where(bad, jj, BLOCK_K), axis=0), raw, 0), axis=0)
                        tl.store(err, ERROR_SET | (_wide(t) << 32) | (_wide(value) & 0xFFFFFFFF))
                row = tl.load(x + _wide(t) * hidden + cc, mask=cm)
                at = half + (ME * max_tokens + slot).to(tl.int64)[:, None] * hidden + cc[None, :]
                tl.store(wl.symm_at(at, peer[:, None], heap), tl.broadcast_to(row[None, :], [BLOCK_K, CHUNK]),
                         mask=first[:, None] & cm[None, :])
            if (p % CHUNKS == 0) & (lane == LANES - 1):  # its block ends at `tokens`: the counts are complete
                for r in tl.static_range(N):
                    n_slots = tl.sum(tl.where(nn == r, before_slots, 0), axis=0)
                    tl.store(wl.symm_at(starts_half + ME * (max_tokens + 1) + n_slots, receivers[r], heap),
                             tl.sum(tl.where(nn == r, before, 0), axis=0))
                    tl.store(wl.symm_at(seg_counts + (epoch % 2) * M + ME, receivers[r], heap), n_slots.to(tl.int64))
        if _last_out(done):  # also when tripped: what it wrote (nothing) is done
            for r in tl.static_range(N):
                wl.notify(flags + ME, receivers[r], heap, epoch)
    else:
        if ok:
            for s in tl.static_range(M):
                token = wl.wait(flags + s, 1, epoch, wl.CMP_GE, heap=heap, peer=senders[s], op="m2n_dispatch")
                n_slots = tl.load(wl.consume_token(seg_counts + (epoch % 2) * M + s, token), volatile=True)
                n_slots = n_slots.to(tl.int32)
                first = wl.consume_token(starts_half + s * (max_tokens + 1), token)
                seg = wl.consume_token(half + _wide(s * max_tokens) * hidden, token)
                table = routes + s * (max_tokens + 2)
                if p == 0:
                    n = tl.load(first + n_slots)
                    tl.store(counts + s, n)
                    tl.store(table, n_slots)
                    tl.store(table + 1 + n_slots, n)
                for u in range(lane, n_slots, LANES):
                    lo = tl.load(first + u)
                    hi = tl.load(first + u + 1)
                    if p % CHUNKS == 0:
                        tl.store(table + 1 + u, lo)
                    row = tl.load(seg + _wide(u) * hidden + cc, mask=cm)
                    for i in range(lo, hi):  # the slot's entries: its row's k entries naming me
                        tl.store(recv + _wide(s * max_rows + i) * hidden + cc, row, mask=cm)
        if _last_out(done):  # also after a mismatch, or tripped: nothing of the half is read
            for s in tl.static_range(M):
                wl.notify(acks + ME, senders[s], heap, epoch)


@triton.jit(do_not_specialize=["tokens"])
def m2n_combine_kernel(y, weights, routes, out, buf, wbuf, flags, wflags, acks, counter, done, heap, sig, sig_err,
                       fp, tokens, hidden, max_tokens, max_rows, half_elems, whalf_elems, senders, receivers,
                       ME: tl.constexpr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, SENDER: tl.constexpr,
                       LANES: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Slot by slot, the way back. buf: halves of half_elems, each [N][max_tokens][hidden] on a sender: the
    receivers' slot rows for it, fp32 partial sums for K > 1, y's dtype for K = 1; wbuf: fp32 halves of
    whalf_elems, each [M][max_rows] on a receiver: the senders' weights by entry position (K > 1).
    Sender (K > 1): program 0 first writes each entry's weight to its receiver's wbuf and raises wflags[ME] there.
    Receiver: for slots u = lane (mod LANES) of each segment, chunk p % CHUNKS: K > 1: sum_i w_i y[s, i] over
    the slot's entries i in order (fp32); K = 1: y[s, u]; into sender s's buf at [ME][u]; the last program out
    raises flags[ME] on every sender. Sender: wait for every receiver, out[t] = the row's slots summed in the
    order of their first entries (K > 1), weights[t, 0] * its slot (K = 1), for chunk p % CHUNKS of my lane's
    tokens; the last program out acknowledges acks[ME] on every receiver. Every program signs and checks every
    member's signature first: on a mismatch it writes nothing (weights, pushes, out)."""
    p = tl.program_id(0)
    lane = p // CHUNKS
    cc = (p % CHUNKS) * CHUNK + tl.arange(0, CHUNK)
    cm = cc < hidden
    epoch, ok = _start(counter, sig, sig_err, fp, heap, True, "m2n_combine")
    half = buf + _wide(epoch % 2) * half_elems
    whalf = wbuf + _wide(epoch % 2) * whalf_elems
    if SENDER:
        if K > 1:
            if p == 0:  # the weights, where the receivers sum their slots' entries
                if ok:
                    jj = tl.arange(0, BLOCK_K)
                    for t0 in range(0, tokens, BLOCK_T):
                        tt = t0 + tl.arange(0, BLOCK_T)
                        at = tt[:, None] * 2 * K + jj[None, :]
                        there = (tt[:, None] < tokens) & (jj[None, :] < K)
                        route = tl.load(routes + at, mask=there, other=-1)
                        w = tl.load(weights + tt[:, None] * K + jj[None, :], mask=there, other=0.0)
                        peer = _peer_of(route // max_rows, receivers, N)
                        tl.store(wl.symm_at(whalf + ME * max_rows + route % max_rows, peer, heap), w,
                                 mask=route >= 0)
                for r in tl.static_range(N):  # also after a mismatch: a receiver's wait must end
                    wl.notify(wflags + ME, receivers[r], heap, epoch)
        if ok:
            token = 0
            for r in tl.static_range(N):
                token = wl.wait(flags + r, 1, epoch, wl.CMP_GE, heap=heap, peer=receivers[r], op="m2n_combine")
            seg = wl.consume_token(half, token)
            lo, hi = _lane_tokens(tokens, lane, LANES)
            for t in range(lo, hi):
                acc = tl.zeros([CHUNK], tl.float32)
                for j in tl.static_range(K):  # in j order, as a sequential fp32 sum
                    slot = tl.load(routes + t * 2 * K + K + j)
                    if slot >= 0:
                        v = tl.load(seg + _wide(slot) * hidden + cc, mask=cm, other=0.0)
                        if K == 1:
                            acc += tl.load(weights + t) * v.to(tl.float32)
                        else:
                            acc += v
                tl.store(out + _wide(t) * hidden + cc, cast(acc, out.dtype.element_ty), mask=cm)
        if _last_out(done):  # also after a mismatch, or tripped: nothing of the half is read
            for r in tl.static_range(N):
                wl.notify(acks + ME, receivers[r], heap, epoch)
    else:
        if ok:
            for s in tl.static_range(M):
                wl.wait(acks + s, 1, epoch - 1, wl.CMP_GE, heap=heap, peer=senders[s], op="m2n_combine (ack)")
            mine = half + _wide(ME * max_tokens) * hidden
            for s in tl.static_range(M):
                table = routes + s * (max_tokens + 2)
                n_slots = tl.load(table)
                w = whalf + s * max_rows
                if K > 1:
                    token = wl.wait(wflags + s, 1, epoch, wl.CMP_GE, heap=heap, peer=senders[s],
                                    op="m2n_combine (weights)")
                    w = wl.consume_token(w, token)
                for u in range(lane, n_slots, LANES):
                    lo = tl.load(table + 1 + u)
                    if K == 1:
                        v = tl.load(y + _wide(s * max_rows + lo) * hidden + cc, mask=cm)
                    else:
                        hi = tl.load(table + 2 + u)
                        v = tl.zeros([CHUNK], tl.float32)
                        for i in range(lo, hi):  # the slot's entries in order, a sequential fp32 sum
                            v += tl.load(w + i) * tl.load(y + _wide(s * max_rows + i) * hidden + cc, mask=cm,
                                                          other=0.0).to(tl.float32)
                    tl.store(wl.symm_at(mine + _wide(u) * hidden + cc, senders[s], heap), v, mask=cm)
        if _last_out(done):  # also after a mismatch, or tripped: what it wrote (nothing) is done
            for s in tl.static_range(M):
                wl.notify(flags + ME, senders[s], heap, epoch)


class M2NWorkspace:
    """The union group's M2N workspace: a data region of four fixed quarters, [dispatch, combine][half] (a plan's
    in each half: dispatch [M][max_tokens][hidden] slot rows, then [M][max_tokens + 1] int32 starts; combine on a
    sender [N][max_tokens][hidden] slot rows (fp32 sums where k > 1), on a receiver [M][max_rows] fp32 weights),
    slot counts, flags and acks per op (and the combine's weight flags), epoch counters, last-out counters,
    signature words per op; the error word of bad destinations."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        self.quarter_bytes = group.workspace_bytes // 4 // 256 * 256
        self.data = heap.empty((4 * self.quarter_bytes,), torch.uint8)
        self.words = heap.empty((2 * w + 5 * w + 2 + 2,), torch.int64)
        self.seg_counts = self.words[:2 * w]
        f = self.words[2 * w:7 * w]
        self.d_flags, self.d_acks, self.c_flags, self.c_acks, self.c_wflags = (f[i * w:(i + 1) * w] for i in range(5))
        self.d_counter, self.c_counter = self.words[7 * w:7 * w + 1], self.words[7 * w + 1:7 * w + 2]
        self.d_done, self.c_done = self.words[7 * w + 2:7 * w + 3], self.words[7 * w + 3:7 * w + 4]
        self.d_sig, self.c_sig = signature_words(group, w), signature_words(group, w)
        zero_everywhere(group, self.words, self.d_sig, self.c_sig)
        # Bad destinations: read by the host with no sync (pinned memory on GPUs), weft.check_errors() raises too.
        self.errors = ErrorWord(group, _bad_dest)
        self.err = self.errors.tensor
        # Every member takes one epoch per call of each op, whatever the check found: no counter to resynchronise.
        self.signatures = signatures(group)
        self.signatures.register(self.d_sig)
        self.signatures.register(self.c_sig)

    def raise_recorded(self) -> None:
        self.errors.raise_recorded()


def _bad_dest(words) -> ValueError:
    value = words[0] & 0xFFFFFFFF
    value -= (value >> 31) << 32
    return ValueError(f"dest row {(words[0] >> 32) & ((1 << 30) - 1)} holds {value}: a receiver outside "
                      "[0, number of receivers) (and not -1)")


def _ranks(name, ranks, g) -> tuple[int, ...]:
    """Group ranks of `ranks` (world ranks, or a Group's)."""
    world_ranks = getattr(ranks, "ranks", ranks)
    try:
        world_ranks = tuple(int(r) for r in world_ranks)
    except TypeError:
        raise TypeError(f"{name} must be a weft.Group or a sequence of world ranks, got {type(ranks).__name__}") \
            from None
    if not world_ranks or len(set(world_ranks)) != len(world_ranks):
        raise ValueError(f"{name} must name at least one rank, each once, got {list(world_ranks)}")
    missing = [r for r in world_ranks if r not in g.ranks]
    if missing:
        raise ValueError(f"{name}: world ranks {missing} are not in the group of ranks {list(g.ranks)}")
    return tuple(sorted(g.ranks.index(r) for r in world_ranks))


@export
class M2NHandle:
    """What m2n_dispatch returns for m2n_combine: its plan and routing table (sender: (T, 2k) int32, each entry's
    receiver * max_rows + position, then each row's slots; receiver: (M, max_tokens + 2) int32, each segment's
    slot count, slot starts and entry count; m2n_dispatch_kernel's doc)."""

    def __init__(self, plan, routes):
        self.plan, self.routes = plan, routes


class M2NPlan(Plan):
    """A dispatch / combine pair of one signature on the union group."""

    def __init__(self, group, x, dest, senders, receivers, max_tokens):
        super().__init__(group)
        self.senders, self.receivers = s, r = _ranks("senders", senders, group), _ranks("receivers", receivers, group)
        if set(s) & set(r):
            raise ValueError(f"senders and receivers must be disjoint (group ranks {sorted(set(s) & set(r))} in both)")
        if set(s) | set(r) != set(range(group.size)):
            raise ValueError(f"senders and receivers must make up the group (of {group.size} ranks): pass their union "
                             "as group=")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        check_tensor("x", x, group, dtypes=(torch.float32, torch.bfloat16, torch.float16), contiguous=False)
        check_tensor("dest", dest, group, dtypes=INDEX_DTYPES, contiguous=False)
        if x.dim() != 2 or dest.dim() != 2 or dest.shape[0] != x.shape[0] or dest.shape[1] < 1:
            raise ValueError(f"x must be (tokens, hidden) and dest (tokens, k), got {tuple(x.shape)} and "
                             f"{tuple(dest.shape)}")
        self.is_sender = group.rank in s
        self.me = s.index(group.rank) if self.is_sender else r.index(group.rank)
        if not self.is_sender and x.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows on a receiver: receivers pass (0, hidden) (and dest (0, k))")
        if x.shape[0] > max_tokens:
            raise ValueError(f"x has {x.shape[0]} rows, more than max_tokens={max_tokens}")
        self.k, self.hidden, self.dtype = dest.shape[1], x.shape[1], x.dtype
        self.max_tokens, self.max_rows = max_tokens, max_tokens * self.k
        m, n = len(s), len(r)
        self.ws = ws = workspace(group, "m2n", M2NWorkspace)
        # A half of each op's quarter (the workspace's doc). The combine's slot rows are fp32 sums where k > 1.
        el, q = x.element_size(), ws.quarter_bytes
        c_dtype = x.dtype if self.k == 1 else torch.float32
        rows_bytes = -(-m * max_tokens * self.hidden * el // 256) * 256
        need = max(rows_bytes + m * (max_tokens + 1) * 4,
                   n * max_tokens * self.hidden * c_dtype.itemsize, m * self.max_rows * 4)
        if need > q:
            raise ValueError(f"m2n needs 4 x {need} bytes of workspace for max_tokens={max_tokens}, k={self.k}, "
                             f"hidden={self.hidden}, {m} senders and {n} receivers; the group's is "
                             f"{group.workspace_bytes} (WEFT_WORKSPACE_BYTES)")
        self.half_elems, self.c_half_elems, self.words_per_half = q // el, q // c_dtype.itemsize, q // 4
        self.d_buf = ws.data[:2 * q].view(x.dtype)
        self.d_starts = ws.data[rows_bytes:2 * q].view(torch.int32)
        self.c_buf = ws.data[2 * q:].view(c_dtype)
        self.c_weights = ws.data[2 * q:].view(torch.float32)
        self.recv_shape = (m if not self.is_sender else 0, self.max_rows, self.hidden)
        self.counts_len = 0 if self.is_sender else m
        # What the members must agree on (each sender's token count is its own, up to max_tokens); the grids are
        # each side's own (_last_out), so not the launch settings.
        agreed = dict(M=m, N=n, k=self.k, hidden=self.hidden, dtype=str(x.dtype).removeprefix("torch."),
                      max_tokens=max_tokens, senders=list(s), receivers=list(r))
        self.combine_fp = self.sign("m2n_combine", **agreed)
        self.dispatch_fp = self.sign("m2n_dispatch", **agreed)
        if group.device.type == "cuda":
            launch = tuning.value("m2n.launch", group.device, group.size)
            programs, chunk, self.warps = launch["programs"], launch["chunk"], launch["warps"]
        else:
            programs, chunk, self.warps = M2N_CPU
        # Column chunks of `chunk` elements (larger where a row would need more than `programs` of them); as many
        # lanes of rows as fill `programs`, no more than there are rows (a sender's tokens, a receiver's rows of
        # a segment).
        chunk = max(chunk, triton.next_power_of_2(triton.cdiv(self.hidden, programs)))
        chunks = triton.cdiv(self.hidden, chunk)
        lanes = max(1, min(programs // chunks, max_tokens if self.is_sender else self.max_rows))
        self.grid = (lanes * chunks,)
        self.consts = dict(ME=self.me, M=m, N=n, K=self.k, SENDER=self.is_sender, LANES=lanes, CHUNKS=chunks,
                           CHUNK=chunk)
        blocks = dict(BLOCK_T=min(32, triton.next_power_of_2(max_tokens)), BLOCK_K=triton.next_power_of_2(self.k))
        self.dispatch_consts = dict(self.consts, **blocks, BLOCK_N=triton.next_power_of_2(n))
        self.combine_consts = dict(self.consts, **blocks)
        self.heap = group.heap.descriptor
        # The launches (compiled on GPUs for their first call's arguments): the arguments every call passes alike
        # taken once, as the launch takes them (on GPUs addresses); a role's empty outputs made once.
        ws, dev = self.ws, group.device
        tail = (self.hidden, self.max_tokens, self.max_rows)
        self.no_recv = torch.empty(self.recv_shape, dtype=self.dtype, device=dev) if self.is_sender else None
        self.no_counts = torch.empty((0,), dtype=torch.int32, device=dev) if self.is_sender else None
        self.no_out = None if self.is_sender else torch.empty((0, self.hidden), dtype=self.dtype, device=dev)
        x, dest = x.contiguous(), dest.contiguous()
        recv, counts, routes = self._outputs(x, dest)
        d_fixed = (self.d_buf, self.d_starts, ws.seg_counts, ws.d_flags, ws.d_acks, ws.d_counter, ws.d_done, ws.err,
                   self.heap, ws.d_sig, ws.signatures.tensor, self.dispatch_fp)
        self.d_tail = tail + (self.half_elems, self.words_per_half, self.senders, self.receivers)
        self.c_tail = tail + (self.c_half_elems, self.words_per_half, self.senders, self.receivers)
        self.dispatch_launch = Launch(m2n_dispatch_kernel, self.grid, (x, dest, routes, recv, counts, *d_fixed,
                                                                       x.shape[0], *self.d_tail),
                                      self.dispatch_consts, self.warps)
        self.address = self.dispatch_launch.address
        self.d_fixed = self.dispatch_launch.arguments(d_fixed)
        self.c_fixed_tensors = (self.c_buf, self.c_weights, ws.c_flags, ws.c_wflags, ws.c_acks, ws.c_counter,
                                ws.c_done, self.heap, ws.c_sig, ws.signatures.tensor, self.combine_fp)
        self.c_fixed = self.dispatch_launch.arguments(self.c_fixed_tensors)
        # By the 16-byte alignment of y, weights and routes (the caller's tensors: the compiled kernel assumes its
        # first call's), made at the first combine of each.
        self.combine_launches: dict = {}

    def _outputs(self, x, dest):
        """A dispatch's (recv, counts, routes): fresh where the role fills them, the plan's empty ones elsewhere."""
        # The handle's routing table: a sender's (T, 2k) entry and slot routes, a receiver's (M, max_tokens + 2)
        # slot counts, starts and entry counts (m2n_dispatch_kernel's doc).
        shape = (dest.shape[0], 2 * self.k) if self.is_sender else (len(self.senders), self.max_tokens + 2)
        routes = torch.empty(shape, dtype=torch.int32, device=x.device)
        if self.is_sender:
            return self.no_recv, self.no_counts, routes
        return (torch.empty(self.recv_shape, dtype=self.dtype, device=x.device),
                torch.zeros((self.counts_len,), dtype=torch.int32, device=x.device), routes)

    def dispatch(self, x, dest):
        ws = self.ws
        ws.raise_recorded()
        ws.signatures.raise_recorded()
        x, dest = x.contiguous(), dest.contiguous()
        recv, counts, routes = self._outputs(x, dest)
        a = self.address
        self.dispatch_launch(a(x), a(dest), a(routes), a(recv), a(counts), *self.d_fixed, x.shape[0], *self.d_tail)
        if x.device.type == "cpu":  # not a signature mismatch: the pair's combine raises it (the module doc)
            ws.raise_recorded()
        return recv, counts, M2NHandle(self, routes)

    def combine(self, y, weights, handle):
        ws = self.ws  # a mismatch its dispatch found is raised after this launch, which its peers' combines await
        tokens = handle.routes.shape[0] if self.is_sender else 0
        if self.is_sender:
            check_tensor("weights", weights, self.group, dtypes=(torch.float32,), contiguous=False)
            if tuple(weights.shape) != (tokens, self.k):
                raise ValueError(f"weights has shape {tuple(weights.shape)}, expected {(tokens, self.k)}")
            out = torch.empty((tokens, self.hidden), dtype=self.dtype, device=self.group.device)
            y, weights = self.d_buf, weights.contiguous()  # y: unused on a sender
        else:
            check_tensor("y", y, self.group, dtypes=(self.dtype,), contiguous=False)
            if tuple(y.shape) != self.recv_shape:
                raise ValueError(f"y has shape {tuple(y.shape)}, expected {self.recv_shape} (recv's)")
            out = self.no_out
            y, weights = y.contiguous(), self.c_weights  # weights: unused on a receiver
        key = (y.data_ptr() & 15 == 0, weights.data_ptr() & 15 == 0, handle.routes.data_ptr() & 15 == 0)
        launch = self.combine_launches.get(key)
        if launch is None:
            launch = self.combine_launches[key] = Launch(
                m2n_combine_kernel, self.grid, (y, weights, handle.routes, out, *self.c_fixed_tensors, tokens,
                                                *self.c_tail), self.combine_consts, self.warps)
        a = self.address
        launch(a(y), a(weights), a(handle.routes), a(out), *self.c_fixed, tokens, *self.c_tail)
        ws.signatures.raise_recorded()
        return out


def _plan(x, dest, senders, receivers, max_tokens, group) -> M2NPlan:
    g = resolve(group)
    key = lambda: ("m2n", signature(x), signature(dest), tuple(getattr(senders, "ranks", senders)),  # noqa: E731
                   tuple(getattr(receivers, "ranks", receivers)), max_tokens)
    return plan(g, key, lambda: M2NPlan(g, x, dest, senders, receivers, max_tokens))


@declare_op(collective=True)
def m2n_dispatch(x: torch.Tensor, dest: torch.Tensor, senders: Group | Sequence[int],
                 receivers: Group | Sequence[int], max_tokens: int,
                 group=None) -> tuple[torch.Tensor, torch.Tensor, M2NHandle]:
    """Route rows from the `senders` ranks to the `receivers` ranks (two disjoint sets making up `group`, default
    the world; each a weft.Group or a sequence of world ranks, the same on every rank). Collective over the group.

    A sender passes x (T, hidden) (T <= max_tokens; bf16/fp16/fp32, any layout) and dest (T, k): each row's
    receivers by index in `receivers` (group order), -1 for none; a receiver passes x (0, hidden) of the same
    dtype and dest (0, k). Returns (recv, counts, handle): on a receiver recv (M, max_tokens * k, hidden) whose
    rows [0, counts[s]) are sender s's rows for it, in (row, j) order, bit-exact, counts (M,) int32; on a sender
    recv (0, max_tokens * k, hidden) and counts (0,). No host sync, capturable. A dest value outside [-1, N)
    counts as none and raises a ValueError naming it (see the module doc)."""
    found = _plan(x, dest, senders, receivers, max_tokens, group)
    return found.dispatch(x, dest)


@declare_op(collective=True)
def m2n_combine(y: torch.Tensor | None, weights: torch.Tensor | None, handle: M2NHandle,
                group=None) -> torch.Tensor:
    """The way back: a receiver passes y (recv's shape: its processed rows; rows past counts unread), weights
    None; a sender passes y None and weights (T, k) fp32. A sender gets out (T, hidden) = sum_j weights[t, j] *
    (the processed row of entry (t, j)), 0 where a row has no receiver (fp32 sums, rounded once); a receiver
    gets (0, hidden). Collective over the dispatch's group, after the dispatch whose handle it takes (`group`:
    default that one; another raises)."""
    handle_group(handle, group, M2NHandle, "m2n_dispatch")
    return handle.plan.combine(y, weights, handle)


# -- the operators, by group name: senders / receivers as world ranks; the combine takes the dispatch's arguments --

@m2n_dispatch.define
def m2n_dispatch_op(x: torch.Tensor, dest: torch.Tensor, senders: list[int], receivers: list[int], max_tokens: int,
                    group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recv, counts, handle = m2n_dispatch.eager(x, dest, senders, receivers, max_tokens, group=group_name)
    return recv, counts, handle.routes.clone()


def _role(senders, group_name):
    g = resolve(group_name)
    return g.ranks[g.rank] in senders


@m2n_dispatch_op.register_fake
def _(x, dest, senders, receivers, max_tokens, group_name):
    sender = _role(senders, group_name)
    rows = max_tokens * dest.shape[1]
    return (x.new_empty((0 if sender else len(senders), rows, x.shape[1])),
            x.new_empty((0 if sender else len(senders),), dtype=torch.int32),
            x.new_empty((dest.shape[0], 2 * dest.shape[1]) if sender else (len(senders), max_tokens + 2),
                        dtype=torch.int32))


def _world_ranks(ranks, group):
    return [int(r) for r in getattr(ranks, "ranks", ranks)]


@m2n_dispatch.traced
def _(x, dest, senders, receivers, max_tokens, group=None):
    s, r = _world_ranks(senders, group), _world_ranks(receivers, group)
    recv, counts, routes = torch.ops.weft.m2n_dispatch(x, dest, s, r, max_tokens, group_name(group))
    return recv, counts, M2NHandle((x, dest, s, r, max_tokens, group_name(group)), routes)


@m2n_combine.define
def m2n_combine_op(y: torch.Tensor, weights: torch.Tensor, routes: torch.Tensor, x: torch.Tensor, dest: torch.Tensor,
                   senders: list[int], receivers: list[int], max_tokens: int, group_name: str) -> torch.Tensor:
    found = _plan(x, dest, senders, receivers, max_tokens, group_name)
    return m2n_combine.eager(None if found.is_sender else y, weights if found.is_sender else None,
                             M2NHandle(found, routes))


@m2n_combine_op.register_fake
def _(y, weights, routes, x, dest, senders, receivers, max_tokens, group_name):
    return x.new_empty((dest.shape[0] if _role(senders, group_name) else 0, x.shape[1]))


@m2n_combine.traced
def _(y, weights, handle, group=None):
    x, dest, s, r, max_tokens, name = handle.plan
    return torch.ops.weft.m2n_combine(y if y is not None else x, weights if weights is not None else x.new_empty(0),
                                      handle.routes, x, dest, s, r, max_tokens, name)


# Signatures for the sm_90 compile check (weft.testing.compile): 128 tokens x 7168 bf16, k = 8, the H200 launch.
_SIDES = dict(ME=0, M=2, N=2, K=8, CHUNK=1024, CHUNKS=7)
COMPILE_CASES = [
    (m2n_dispatch_kernel, dict(x="*bf16", dest=dt, routes="*i32", recv="*bf16", counts="*i32", buf="*bf16",
                               starts="*i32", seg_counts="*i64", flags="*i64", acks="*i64", counter="*i64",
                               done="*i64", err="*i64", heap="*i64", sig="*i64", sig_err="*i64", fp="i32",
                               tokens="i32", hidden="i32", max_tokens="i32", max_rows="i32", half_elems="i32",
                               half_words="i32", senders=("i32",) * 2, receivers=("i32",) * 2),
     dict(_SIDES, SENDER=sender, K=k, LANES=18, BLOCK_T=32, BLOCK_K=k, BLOCK_N=2), dict(num_warps=8))
    for sender in (True, False) for dt in (("*i64", "*i32") if sender else ("*i64",))
    for k in ((1, 8) if sender else (8,))  # top-1 over 2 receivers: a (1, 2) routing tile
] + [
    (m2n_combine_kernel, dict(y="*bf16", weights="*fp32", routes="*i32", out="*bf16", buf=buf, wbuf="*fp32",
                              flags="*i64", wflags="*i64", acks="*i64", counter="*i64", done="*i64", heap="*i64",
                              sig="*i64", sig_err="*i64", fp="i32", tokens="i32", hidden="i32", max_tokens="i32",
                              max_rows="i32", half_elems="i32", whalf_elems="i32", senders=("i32",) * 2,
                              receivers=("i32",) * 2),
     dict(_SIDES, SENDER=sender, K=k, LANES=18, BLOCK_T=32, BLOCK_K=k), dict(num_warps=8))
    for sender in (True, False) for k, buf in ((1, "*bf16"), (8, "*fp32"))
]
