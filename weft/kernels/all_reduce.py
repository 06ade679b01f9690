"""The reduction family through the symmetric heap: all_reduce (one-shot, two-shot), reduce_scatter, broadcast.

all_reduce:     out = the reduction (`op`) over ranks r of x on rank r, on every rank.
reduce_scatter: out on rank r = the reduction over ranks of x[r * m : (r + 1) * m], x of (W * m, ...) rows.
broadcast:      x on every rank = x on rank `root` (in place).

Every op runs over a group (`group=`, default the world): ranks, W and `root` are the group's, and the
kernels see only its members (weft.runtime.group). On a group of one each op is a copy or nothing, with
no kernel and no workspace.

The reductions are torch.distributed's: sum, avg, max, min, product (`op` by name or ReduceOp), over
fp32, bf16, fp16, fp64, int8, uint8, int32, int64. The kernels take the op as a constexpr (`_combine`,
`_finish`): 16-bit floats accumulate in fp32, the other dtypes in their own type, so integer sums and
products wrap as torch's do; avg is the sum divided by W (for integers the wrapped sum divided toward
zero, NCCL's average, which gloo refuses); max and min propagate NaN as torch.maximum / torch.minimum.

all_reduce and reduce_scatter move data only with stores into peers' memory
(NVLink writes on the GPU: posted, no round trip, unlike remote loads) and
read only their own memory:

- one-shot all-reduce: every rank pushes its whole x into slot [me] of every
  rank's receive buffer, signals, and reduces the W slots it received. One
  synchronisation step, (W - 1) * n elements sent per rank: the fastest for
  small messages, where latency dominates.
  Up to all_reduce.ll_max_bytes (weft.tuning) it sends LL words instead (float
  dtypes; `wl.pack_ll`: 4 bytes of x and the epoch in one 8-byte store), and the receiver polls the words
  themselves (`wl.wait_ll`): no fence and no separate flag, at twice the
  bytes.
- two-shot all-reduce: a reduce-scatter (rank r receives slice r of every
  rank's x in W slots and sums them) followed by an all-gather (rank r pushes
  its summed slice into slice r of every rank's gather buffer, or straight
  into every rank's `out` when `out` is symmetric; then each rank copies the
  gather buffer to `out`). Two steps, but only ~2 (W - 1) / W * n elements
  cross the links per rank: the faster one once bandwidth dominates.
  Up to all_reduce.ll_two_shot_max_bytes both steps send LL words, and the receivers
  unpack the gathered words straight into `out`.
- reduce_scatter: the first half of two-shot, the sum written to `out`.

Reductions run in rank order 0, 1, ..., W - 1 on every rank, so every rank
gets the same bits and one-shot and two-shot agree bit for bit.

broadcast:      the root pushes part p of x into every rank's receive buffer, every rank
                signals every rank, and the others copy the part into x.

The elements are split into one part per program. Program p of every rank
handles part p only (for two-shot and reduce_scatter: sub-chunk p of every
rank's slice) and waits only on program p of its peers, so programs never
wait on a later program of their own grid (the interpreter runs them one
after another). Signals go to all ranks at once (`notify_all`) and a wait
polls all W flags at once.

One workspace serves the whole family, whatever the message size
(`ReduceWorkspace`): an LL region and a data region, each in two halves, per
program slot int32 flags [arrived[W], reduced[W]], and one epoch counter
(`wl.next_epoch`): every call of every op of the family takes the next epoch,
the same in all its programs, and its signals carry it (flags are compared
with >=, never reset). Messages larger than a half go through in passes.

The halves are used by call parity and need no extra handshake: rank s writes
half e % 2 of rank q's regions in call e only after its call e - 1 ended,
and in that call s's program 0 waited for a signal of q's call e - 1 (every
method's program 0 waits on every rank), which q sent after its call e - 2,
the last reader of half e % 2 in any layout, had completed. The same
argument lets two-shot push straight into a symmetric `out`: a peer writes
my `out` only after my kernel of this call has started (it waited for my
phase-1 data), so all my earlier work on `out` is done. LL words only ever
go to the LL region, so a stale word there carries an older epoch, never
data that could pass for the current one.

Why the tile primitives (`weft.language.tile`) do not carry this family's
synchronisation. Its unit is the program slot of a call, not a data tile:
program p of every rank raises one flag per call once all its parts are
pushed, whatever their size (none included), and waits for the W flags of
slot p; that every program 0 waits on every rank is what the halves' reuse
rests on. A tile map's waits follow data (`tile_wait` skips a block outside
the tensor), and its copies move one constexpr block per signal
(`tile_push`), where these kernels stream a part of runtime size in 16-byte
vectors and signal once. On a one-tile-per-rank map (`ShardMapping`),
`tile_notify` / `tile_wait_tiles` would be the same `notify_all` / `wait` on
the same flags under other names, minus the waits' timeout reports (`op`).
The LL kernels have no flags at all (each word carries its epoch), and the
epoch is a per-call ticket (`wl.next_epoch`), not a tile's signal.
"""
from __future__ import annotations

import operator

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning

from ..runtime import backend
from . import hierarchical
from .blocks import at, cast, copy, halves_of, word_of
from .common import (Launch, Plan, as_words, check_method, check_out, check_tensor, group_name, group_size,
                     nccl_from, nccl_reduce_scatter, out_kind, overlaps, plan, resolve, rows_divisible, signature,
                     signature_words, signatures, workspace, zero_everywhere)
from .registry import declare_op, fresh, into

METHODS = ("auto", "one_shot", "two_shot", "nccl")
RS_METHODS = ("auto", "two_shot", "nccl")

# The measured settings of this family are in weft.tuning (family all_reduce; their runs in
# weft/tuning/data/): how far "auto" takes one-shot (one_shot_max_bytes: one-shot sends W - 1 copies, so the
# limit falls with the world size), up to which size each path sends LL words (data and epoch in one 8-byte
# store: no fence and no separate flag, at twice the bytes; ll_max_bytes for one-shot, ll_two_shot_max_bytes
# and, into a symmetric out where the push path needs no copy-out, ll_two_shot_symmetric_max_bytes), the
# launch rules (launch, launch_large, ll_launch), and from which message size per rank "auto" hands a call to
# the process group's collective (NCCL) where it measured faster: nccl_above.<in_place | plain | symmetric>
# for all_reduce, reduce_scatter_nccl_above.<plain | symmetric>; and which (op, dtype) pairs "auto" gives the
# kernels at all (kernel_dtypes.<op>: {dtype name: true or false}), the others going to the process group.


# -- device helpers -------------------------------------------------------------

@triton.jit
def _push_all(dst, src, lo, hi, heap, WORLD: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """dst[i] = src[i] for i in [lo, hi) on every rank (`dst` symmetric): one load, W stores."""
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(at(src, offs, VEC))
        for q in tl.static_range(WORLD):
            tl.store(at(wl.symm_at(dst, q, heap), offs, VEC), v)
    offs = full + tl.arange(0, BLOCK)
    mask = offs < hi
    v = tl.load(src + offs, mask=mask)
    for q in tl.static_range(WORLD):
        tl.store(wl.symm_at(dst, q, heap) + offs, v, mask=mask)


# The reductions (`op`), a constexpr of the kernels: the combine of two values, and what ends the reduction.
SUM = tl.constexpr(0)
AVG = tl.constexpr(1)  # the sum, divided by the group size at the end
MAX = tl.constexpr(2)
MIN = tl.constexpr(3)
PRODUCT = tl.constexpr(4)


@triton.jit
def _widen(v):
    """v as the accumulator type: fp32 for 16-bit floats, the element type otherwise (integers wrap in their own
    width, as torch's and NCCL's sums and products do)."""
    if v.dtype == tl.float16:
        v = v.to(tl.float32)
    if v.dtype == tl.bfloat16:
        v = v.to(tl.float32)
    return v


@triton.jit
def _combine(a, b, OP: tl.constexpr):
    """One step of the reduction; MAX / MIN propagate NaN, as torch.maximum / torch.minimum do."""
    if OP == MAX:
        r = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    elif OP == MIN:
        r = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
    elif OP == PRODUCT:
        r = a * b
    else:
        r = a + b
    return r


@triton.jit
def _finish(acc, OP: tl.constexpr, WORLD: tl.constexpr):
    """The reduced value: for AVG the sum divided by WORLD (floats: IEEE division in the accumulator type;
    integers: the wrapped sum divided toward zero, as NCCL's average)."""
    if OP == AVG:
        if acc.dtype == tl.float32:
            acc = tl.math.div_rn(acc, tl.zeros_like(acc) + WORLD)  # `/` is an approximate division in fp32
        elif acc.dtype == tl.float64:
            acc = acc / WORLD
        else:
            acc = acc.to(tl.int64) // WORLD
    return acc


@triton.jit
def _reduce_slots(slots, slot_len, offs, mask, MASKED: tl.constexpr, OP: tl.constexpr, WORLD: tl.constexpr,
                  BLOCK: tl.constexpr, VEC: tl.constexpr):
    """The reduction over q = 0..WORLD-1, in rank order, of slots[q * slot_len + offs] (local memory), in the
    accumulator type (_widen). The loop is unrolled, so all WORLD loads are in flight before the combines need
    them."""
    for q in tl.static_range(WORLD):
        if MASKED:
            v = tl.load(slots + q * slot_len + offs, mask=mask, other=0)
        else:
            v = tl.load(at(slots + q * slot_len, offs, VEC))
        if q == 0:
            acc = _widen(v)
        else:
            acc = _combine(acc, _widen(v), OP)
    return _finish(acc, OP, WORLD)


@triton.jit
def _target(dst, own, q, me, heap):
    """Where rank q's copy of a pushed sum goes: rank q's `dst`, or for this rank `own` where given."""
    target = wl.symm_at(dst, q, heap)
    if own is not None:
        if q == me:
            target = own
    return target


@triton.jit
def _reduce(dst, slots, slot_len, lo, hi, heap, PUSH: tl.constexpr, OP: tl.constexpr, WORLD: tl.constexpr,
            BLOCK: tl.constexpr, VEC: tl.constexpr, own=None):
    """dst[i] = the reduction (OP) over q of slots[q * slot_len + i] for i in [lo, hi).

    With PUSH, `dst` is symmetric and the result goes to every rank's `dst`; given `own` (a local tensor
    indexed as dst), this rank's share goes there instead of into its own `dst`."""
    me = wl.rank(heap)
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        val = cast(_reduce_slots(slots, slot_len, offs, None, False, OP, WORLD, BLOCK, VEC), dst.dtype.element_ty)
        if PUSH:
            for q in tl.static_range(WORLD):
                tl.store(at(_target(dst, own, q, me, heap), offs, VEC), val)
        else:
            tl.store(at(dst, offs, VEC), val)
    offs = full + tl.arange(0, BLOCK)
    mask = offs < hi
    val = cast(_reduce_slots(slots, slot_len, offs, mask, True, OP, WORLD, BLOCK, VEC), dst.dtype.element_ty)
    if PUSH:
        for q in tl.static_range(WORLD):
            tl.store(_target(dst, own, q, me, heap) + offs, val, mask=mask)
    else:
        tl.store(dst + offs, val, mask=mask)


@triton.jit
def _span(s, p, n, slice_len, chunk):
    """[lo, hi) of sub-chunk p of slice s (empty when past the end)."""
    lo = s * slice_len + p * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, (s + 1) * slice_len), n)
    return lo, tl.maximum(hi, lo)


# -- kernels --------------------------------------------------------------------

@triton.jit(do_not_specialize=["n", "chunk", "slot_len", "half_len", "fp"])
def all_reduce_one_shot_kernel(x, recv, out, flags, counter, heap, n, chunk, slot_len, half_len, sig, err, fp,
                               OP: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Push part p of x into slot [me] of every rank's `recv` (half epoch % 2), then reduce my W slots.

    A half of `recv` holds W slots of `slot_len` elements (from `half_len` on for the second half).
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        arrived = flags + p * 2 * WORLD
        half = recv + (epoch % 2) * half_len
        lo = p * chunk
        hi = tl.maximum(tl.minimum(lo + chunk, n), lo)
        _push_all(half + me * slot_len, x, lo, hi, heap, WORLD, BLOCK, VEC)
        wl.notify_all(arrived + me, heap, epoch)
        if wl.check_signed(sig, epoch, fp, heap, err, op="all_reduce one-shot"):
            token = wl.wait(arrived, WORLD, epoch, wl.CMP_GE, heap=heap, op="all_reduce one-shot")
            _reduce(out, wl.consume_token(half, token), slot_len, lo, hi, heap, False, OP, WORLD, BLOCK, VEC)


@triton.jit
def _ll_reduce(slots, slot_len, offs, mask, epoch, heap, OP: tl.constexpr, ELEM: tl.constexpr, WORLD: tl.constexpr,
               BLOCK: tl.constexpr):
    """The int32 words of the reduction (OP) over q = 0..WORLD-1 (rank order, fp32) of the LL words at
    slots[q * slot_len + offs], each awaited until it carries `epoch`. A 16-bit ELEM packs two elements
    per word, reduced separately (blocks.halves_of)."""
    for q in tl.static_range(WORLD):
        got = wl.wait_ll(slots + q * slot_len + offs, mask, epoch, heap=heap, peer=q, op="all_reduce LL")
        a, b = halves_of(got, ELEM)
        if q == 0:
            acc_lo, acc_hi = a, b
        else:
            acc_lo = _combine(acc_lo, a, OP)
            acc_hi = _combine(acc_hi, b, OP)
    return word_of(_finish(acc_lo, OP, WORLD), _finish(acc_hi, OP, WORLD), ELEM)


@triton.jit(do_not_specialize=["words", "chunk", "half_words", "fp"])
def all_reduce_ll_kernel(x, ll, out, counter, heap, words, chunk, half_words, sig, err, fp, OP: tl.constexpr,
                         ELEM: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """One-shot with the data's own words as flags: push part p of x (int32 words) as LL words into
    slot [me] of every rank's `ll` (half epoch % 2), then reduce my W slots as their words arrive.

    No fence, no separate flag: each 8-byte LL word carries 4 bytes of x and the epoch. A half of `ll`
    holds W slots of `words` int64 words.
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        half = ll + (epoch % 2) * half_words
        lo = p * chunk
        hi = tl.minimum(lo + chunk, words)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hi
            packed = wl.pack_ll(tl.load(x + offs, mask=mask, other=0), epoch)
            for q in tl.static_range(WORLD):
                tl.store(wl.symm_at(half + me * words, q, heap) + offs, packed, mask=mask)
        if wl.check_signed(sig, epoch, fp, heap, err, op="all_reduce LL"):
            for start in range(lo, hi, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < hi
                tl.store(out + offs, _ll_reduce(half, words, offs, mask, epoch, heap, OP, ELEM, WORLD, BLOCK),
                         mask=mask)


@triton.jit(do_not_specialize=["words", "slice_len", "chunk", "half_words", "fp"])
def all_reduce_ll_two_shot_kernel(x, ll, out, counter, heap, words, slice_len, chunk, half_words, sig, err, fp,
                                  OP: tl.constexpr, ELEM: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Two-shot in LL words: three one-way trips and no fence, for mid-size messages.

    Rank r owns slice r (words [r * slice_len, (r + 1) * slice_len) of x); program p handles sub-chunk p
    of every slice. A half of `ll` (epoch parity) holds [recv: W slots of slice_len | gathered:
    W * slice_len] int64 words.
      1. push sub-chunk p of slice s of x, as LL words, into slot [me] of rank s's recv;
      2. reduce my W slots as their words arrive, push the result as LL words into slice me of every rank's
         gathered;
      3. unpack the W slices of my gathered into out as their words arrive.
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        recv = ll + (epoch % 2) * half_words
        gathered = recv + WORLD * slice_len
        for k in range(WORLD):
            s = (me + p + k) % WORLD  # staggered destinations, as in the two-shot kernel
            lo, hi = _span(s, p, words, slice_len, chunk)
            dst = wl.symm_at(recv, s, heap) + (me - s) * slice_len  # word i of slice s -> slot me, i - s * slice_len
            for start in range(lo, hi, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < hi
                tl.store(dst + offs, wl.pack_ll(tl.load(x + offs, mask=mask, other=0), epoch), mask=mask)
        # Checked before anything a peer sent is consumed: the gathered slices go into my `out` as they are.
        if wl.check_signed(sig, epoch, fp, heap, err, op="all_reduce LL two-shot"):
            lo, hi = _span(me, p, words, slice_len, chunk)
            for start in range(lo, hi, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < hi
                word = _ll_reduce(recv - me * slice_len, slice_len, offs, mask, epoch, heap, OP, ELEM, WORLD, BLOCK)
                packed = wl.pack_ll(word, epoch)
                for j in tl.static_range(WORLD):
                    tl.store(wl.symm_at(gathered, (me + j) % WORLD, heap) + offs, packed, mask=mask)
            for k in range(WORLD):
                s = (me + p + k) % WORLD
                lo, hi = _span(s, p, words, slice_len, chunk)
                for start in range(lo, hi, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    mask = offs < hi
                    got = wl.wait_ll(gathered + offs, mask, epoch, heap=heap, peer=s,
                                     op="all_reduce LL two-shot gather")
                    tl.store(out + offs, got, mask=mask)


@triton.jit(do_not_specialize=["n", "slice_len", "chunk", "half_len", "fp"])
def all_reduce_two_shot_kernel(x, recv, gathered, out, flags, counter, heap, n, slice_len, chunk, half_len, sig, err,
                               fp, GATHER: tl.constexpr, COPY_OUT: tl.constexpr, OP: tl.constexpr, WORLD: tl.constexpr,
                               BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Reduce-scatter, then (GATHER) all-gather, of sub-chunk p of every slice.

    Rank r owns slice r = [r * slice_len, (r + 1) * slice_len) of the n
    elements. Phase 1: push sub-chunk p of slice q of x into slot [me] of
    rank q's `recv` (half epoch % 2: W slots of slice_len). Phase 2: reduce my
    W slots (OP); without GATHER (reduce_scatter) into out[0:slice_len]; with
    GATHER into slice me of every rank's gathered buffer (COPY_OUT: the
    W * slice_len elements after the slots in the same half, copied to `out`
    afterwards; else the caller's symmetric `out` itself, passed as `gathered`).

    Flags per program [arrived[W], reduced[W]].
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        arrived = flags + p * 2 * WORLD
        reduced = arrived + WORLD
        slots = recv + (epoch % 2) * half_len
        for k in range(WORLD):
            # Destinations staggered by rank and program: were every program of every rank to push to
            # rank 0 first, then rank 1, ..., each rank's incoming links would carry W - 1 senders in turn.
            s = (me + p + k) % WORLD
            lo, hi = _span(s, p, n, slice_len, chunk)
            # Element i of slice s lands at slots[me * slice_len + i - s * slice_len] on rank s.
            copy(wl.symm_at(slots, s, heap) + (me - s) * slice_len, x, lo, hi, BLOCK, VEC)
        wl.notify_all(arrived + me, heap, epoch)
        if wl.check_signed(sig, epoch, fp, heap, err, op="all_reduce/reduce_scatter two-shot"):
            token = wl.wait(arrived, WORLD, epoch, wl.CMP_GE, heap=heap, op="all_reduce/reduce_scatter two-shot")
            mine = wl.consume_token(slots, token)
            lo, hi = _span(me, p, n, slice_len, chunk)
            base = me * slice_len
            if GATHER:
                if COPY_OUT:
                    # My slice's sum goes straight into my out; only the peers' slices pass through `gathered`.
                    dst = slots + WORLD * slice_len
                    _reduce(dst, mine - base, slice_len, lo, hi, heap, True, OP, WORLD, BLOCK, VEC, out)
                else:
                    dst = gathered
                    _reduce(dst, mine - base, slice_len, lo, hi, heap, True, OP, WORLD, BLOCK, VEC)
                wl.notify_all(reduced + me, heap, epoch)
                token = wl.wait(reduced, WORLD, epoch, wl.CMP_GE, heap=heap, op="all_reduce two-shot gather")
                if COPY_OUT:
                    res = wl.consume_token(dst, token)
                    for k in range(1, WORLD):
                        lo, hi = _span((me + k) % WORLD, p, n, slice_len, chunk)
                        copy(out, res, lo, hi, BLOCK, VEC)
            else:
                _reduce(out - base, mine - base, slice_len, lo, hi, heap, False, OP, WORLD, BLOCK, VEC)


@triton.jit(do_not_specialize=["n", "chunk", "half_len", "root", "fp"])
def broadcast_kernel(x, recv, flags, counter, heap, n, chunk, half_len, root, sig, err, fp, BLOCK: tl.constexpr,
                     VEC: tl.constexpr):
    """The root pushes part p of x into every rank's `recv` (half epoch % 2); every rank signals every
    rank, so that program 0 waits on everybody (what the halves' reuse relies on); the others copy the
    part into x."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        arrived = flags + p * 2 * world
        half = recv + (epoch % 2) * half_len
        lo = p * chunk
        hi = tl.maximum(tl.minimum(lo + chunk, n), lo)
        if me == root:
            for i in range(1, world):
                copy(wl.symm_at(half, (me + i) % world, heap), x, lo, hi, BLOCK, VEC)
        wl.notify_all(arrived + me, heap, epoch)
        if wl.check_signed(sig, epoch, fp, heap, err, op="broadcast"):
            token = wl.wait(arrived, world, epoch, wl.CMP_GE, heap=heap, op="broadcast")
            if me != root:
                copy(x, wl.consume_token(half, token), lo, hi, BLOCK, VEC)


# -- host side ------------------------------------------------------------------

# Program slots of the workspace's flags: the most programs any launch rule below uses.
MAX_PROGRAMS = 512

# The reductions, by the names torch.distributed's ReduceOp members have (lower case), and their constexpr codes.
OPS = {"sum": SUM.value, "avg": AVG.value, "max": MAX.value, "min": MIN.value, "product": PRODUCT.value}
_REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max",
               dist.ReduceOp.MIN: "min", dist.ReduceOp.PRODUCT: "product"}
# Every dtype NCCL reduces (fp8 aside); 16-bit floats accumulate in fp32, the others in their own type.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64)


def reduce_op_name(op) -> str:
    """The name ("sum", "avg", "max", "min", "product") of a reduction given by name or as a
    torch.distributed.ReduceOp (a member such as ReduceOp.MAX, or a ReduceOp made of one); ValueError naming
    `op` for anything else (PREMUL_SUM and the bitwise BAND / BOR / BXOR included)."""
    if type(op) is str and op in OPS:
        return op
    red = op.op if type(op) is dist.ReduceOp else op  # (isinstance would take a member for a ReduceOp too)
    if type(red) is dist.ReduceOp.RedOpType and red in _REDUCE_OPS:
        return _REDUCE_OPS[red]
    raise ValueError(f"op must be one of {', '.join(repr(o) for o in OPS)} or the torch.distributed.ReduceOp of "
                     f"one (SUM, AVG, MAX, MIN, PRODUCT), got {op!r}")


def _op_key(op) -> str:
    """reduce_op_name for a plan key: the common cases in one lookup."""
    if type(op) is str and op in OPS:
        return op
    return reduce_op_name(op)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kernels_take(op: str, dtype: torch.dtype, group) -> bool:
    """Whether `auto` may give this (op, dtype) to the kernels (then by size, under the nccl_above limits): the
    tuning data's all_reduce.kernel_dtypes.<op>, where they measured faster than the process group's collective
    (a dtype it does not name: not measured, the process group). Always on the cpu backend, whose kernels are what
    the tests check."""
    if group.device.type != "cuda":
        return True
    return tuning.value(f"all_reduce.kernel_dtypes.{op}", group.device, group.size).get(_dtype_name(dtype), False)


def _pg_all_reduce(t: torch.Tensor, op: str, process_group) -> None:
    """The process group's all_reduce of `t` in place. An integer average is the wrapped sum divided toward zero
    (NCCL's; gloo refuses it), so it is that sum and the division here on any backend."""
    if op == "avg" and not t.is_floating_point():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=process_group)
        t.div_(dist.get_world_size(process_group), rounding_mode="trunc")
        return
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()), group=process_group)


def _pg_reduce_scatter(out: torch.Tensor, x: torch.Tensor, op: str, process_group) -> None:
    """The process group's reduce_scatter of x into `out` (both contiguous); an integer average as _pg_all_reduce's."""
    if op == "avg" and not x.is_floating_point():
        nccl_reduce_scatter(out, x, process_group, op=dist.ReduceOp.SUM)
        out.div_(dist.get_world_size(process_group), rounding_mode="trunc")
        return
    nccl_reduce_scatter(out, x, process_group, op=getattr(dist.ReduceOp, op.upper()))


class ReduceWorkspace:
    """The family's symmetric workspace in one group, the same for every call whatever its size: an LL region
    (int64 words, zeroed: epoch 0 is never awaited) and a data region, each in two halves used by call parity;
    flags [arrived[W], reduced[W]] per program slot; the epoch counter (`wl.next_epoch`); the signature words
    (`wl.sign`, `wl.check_signed`) and the group's SignatureWord (`errors`), where the kernels record a
    mismatch."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        total = group.workspace_bytes // 4096 * 4096
        self.ll_half_words = total // 16 // 8  # an eighth of the workspace for LL words
        self.ll = heap.empty((2 * self.ll_half_words,), torch.int64)
        self.data_half_bytes = (total - total // 8) // 2 // 256 * 256
        self.data = heap.empty((2 * self.data_half_bytes,), torch.uint8)
        self.flags = heap.empty((MAX_PROGRAMS * 2 * w,), torch.int32)
        self.counter = heap.empty((1,), torch.int64)
        self.sig = signature_words(group, w)
        self.errors = signatures(group)
        self.errors.register(self.sig, self.counter)
        zero_everywhere(group, self.ll, self.flags, self.counter, self.sig)

    def data_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """The data region as `dtype` elements, and the elements in one half."""
        return self.data.view(dtype), self.data_half_bytes // dtype.itemsize


def _workspace(group) -> ReduceWorkspace:
    return workspace(group, "reduce", ReduceWorkspace)


def _launch_shape(n: int, element_size: int, device: torch.device, world_size: int) -> tuple[int, int, int]:
    """(programs, BLOCK elements, num_warps) for `n` elements handled per rank and step."""
    if device.type != "cuda":
        return min(4, max(1, n * element_size // 4096)), 1024, 4
    # Small blocks of few warps, up to a modest number of programs, then (all_reduce.launch_large) larger
    # blocks and more programs for more bytes in flight. Every program fits on the GPU at once, which the
    # per-slot waits rely on.
    large = tuning.value("all_reduce.launch_large", device, world_size)
    rule = large if n >= large["from_elements"] else tuning.value("all_reduce.launch", device, world_size)
    return max(1, min(MAX_PROGRAMS, rule["max_programs"], triton.cdiv(n, rule["block"]))), rule["block"], rule["warps"]


def _ll_launch(words: int, device: torch.device, world_size: int) -> tuple[int, int, int]:
    """(programs, BLOCK words, num_warps) for an LL kernel whose programs share `words` words."""
    if device.type != "cuda":
        return min(4, triton.cdiv(words, 256)), 256, 4
    rule = tuning.value("all_reduce.ll_launch", device, world_size)
    return min(MAX_PROGRAMS, rule["max_programs"], triton.cdiv(words, rule["block"])), rule["block"], rule["warps"]


def _vector_width(element_size: int, *tensors: torch.Tensor) -> int:
    """Elements per 16-byte access if every base is 16-byte aligned, else 1 (the
    caller makes every part boundary a multiple of it)."""
    if all(t.data_ptr() % 16 == 0 for t in tensors):
        return 16 // element_size
    return 1


_ELEM = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _ll_fits(nbytes: int, limit: int, *tensors: torch.Tensor) -> bool:
    """Whether the LL path may take it: a float dtype of _ELEM, at most `limit` bytes, and whole 4-byte words in
    and out."""
    return tensors[0].dtype in _ELEM and nbytes <= limit and nbytes % 4 == 0 and \
        all(t.data_ptr() % 4 == 0 for t in tensors)


class _Pass:
    """One launch of a reduction kernel over elements [lo, hi) of the flat input and output.

    `args(xs, os, fixed)` gives the kernel's runtime arguments for the pass's input and output, where
    `fixed` are the workspace tensors that every call passes, as `Launch.address` gives them (on GPUs their
    addresses, taken once). `typed` views the input and output as the kernel's pointer types (the LL kernels move int32
    words), which the interpreter and the compilation need."""

    def __init__(self, kernel, grid, args, fixed: tuple, constexprs: dict, warps: int, xf, of, lo: int, hi: int,
                 typed=None):
        self.lo, self.hi = lo, hi
        self.args = args
        self.typed = typed or (lambda t: t)
        self.launch = Launch(kernel, grid, args(self.typed(xf[lo:hi]), self.typed(of[lo:hi]), fixed), constexprs,
                             warps)
        self.fixed = tuple(map(self.launch.address, fixed))

    def __call__(self, xf: torch.Tensor, of: torch.Tensor) -> None:
        t = self.typed
        self.launch(*self.args(t(xf[self.lo:self.hi]), t(of[self.lo:self.hi]), self.fixed))

    def direct(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x and out whole in this one pass (no views made: on GPUs their addresses are all the kernel takes)."""
        address = self.launch.address
        self.launch(*self.args(address(x), address(out), self.fixed))


def _words32(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _one_shot_ll_pass(group, ws, xf, of, lo, hi, op, fp):
    words = (hi - lo) * xf.element_size() // 4
    programs, block, warps = _ll_launch(words, xf.device, group.size)
    chunk = triton.cdiv(triton.cdiv(words, programs), block) * block
    heap = group.heap.descriptor
    args = lambda xs, os, f: (xs, f[0], os, f[1], f[2], words, chunk, ws.ll_half_words, f[3], f[4], fp)
    return _Pass(all_reduce_ll_kernel, (programs,), args, (ws.ll, ws.counter, heap, ws.sig, ws.errors.tensor),
                 dict(OP=OPS[op], ELEM=_ELEM[xf.dtype], WORLD=group.size, BLOCK=block), warps, xf, of, lo, hi,
                 _words32)


def _two_shot_ll_pass(group, ws, xf, of, lo, hi, op, fp):
    words = (hi - lo) * xf.element_size() // 4
    slice_len = triton.cdiv(words, group.size)
    programs, block, warps = _ll_launch(slice_len, xf.device, group.size)
    chunk = triton.cdiv(triton.cdiv(slice_len, programs), block) * block
    heap = group.heap.descriptor
    args = lambda xs, os, f: (xs, f[0], os, f[1], f[2], words, slice_len, chunk, ws.ll_half_words, f[3], f[4], fp)
    return _Pass(all_reduce_ll_two_shot_kernel, (programs,), args, (ws.ll, ws.counter, heap, ws.sig,
                                                                    ws.errors.tensor),
                 dict(OP=OPS[op], ELEM=_ELEM[xf.dtype], WORLD=group.size, BLOCK=block), warps, xf, of, lo, hi,
                 _words32)


def _one_shot_pass(group, ws, xf, of, lo, hi, op, fp):
    n = hi - lo
    recv, half_len = ws.data_as(xf.dtype)
    programs, block, warps = _launch_shape(n, xf.element_size(), xf.device, group.size)
    slot_len = triton.cdiv(n, 16) * 16  # every slot starts 16-byte aligned
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block  # whole blocks but the last
    vec = _vector_width(xf.element_size(), xf[lo:hi], of[lo:hi])
    heap = group.heap.descriptor
    args = lambda xs, os, f: (xs, f[0], os, f[1], f[2], f[3], n, chunk, slot_len, half_len, f[4], f[5], fp)
    return _Pass(all_reduce_one_shot_kernel, (programs,), args, (recv, ws.flags, ws.counter, heap, ws.sig,
                                                                 ws.errors.tensor),
                 dict(OP=OPS[op], WORLD=group.size, BLOCK=block, VEC=vec), warps, xf, of, lo, hi)


def _two_shot_pass(group, ws, xf, of, lo, hi, gather: bool, copy_out: bool, op, fp):
    """all_reduce (gather) or reduce_scatter (not) of [lo, hi): two-shot through the data region. Into a
    symmetric `out` the reduced slices go straight to every rank's out (passed as `gathered`); else into
    the half's gathered part (COPY_OUT); reduce_scatter writes my own out only."""
    n = hi - lo
    w = group.size
    recv, half_len = ws.data_as(xf.dtype)
    align = 16 // xf.element_size()  # slices start 16-byte aligned; the last one is ragged (or empty)
    slice_len = triton.cdiv(triton.cdiv(n, w), align) * align if gather else n // w
    programs, block, warps = _launch_shape(slice_len, xf.element_size(), xf.device, w)
    chunk = triton.cdiv(triton.cdiv(slice_len, programs), block) * block
    vec = _vector_width(xf.element_size(), xf[lo:hi], of[lo:hi])
    if slice_len % vec:
        vec = 1
    heap = group.heap.descriptor
    args = lambda xs, os, f: (xs, f[0], os, os, f[1], f[2], f[3], n, slice_len, chunk, half_len, f[4], f[5], fp)
    return _Pass(all_reduce_two_shot_kernel, (programs,), args, (recv, ws.flags, ws.counter, heap, ws.sig,
                                                                 ws.errors.tensor),
                 dict(GATHER=gather, COPY_OUT=copy_out, OP=OPS[op], WORLD=w, BLOCK=block, VEC=vec), warps, xf, of,
                 lo, hi)


def _pieces(n: int, most: int, align: int) -> list[tuple[int, int]]:
    """[lo, hi) pieces of at most `most` elements (a multiple of `align`, at least `align`) covering n."""
    most = max(align, most // align * align)
    return [(lo, min(lo + most, n)) for lo in range(0, n, most)]


def _run_passes(passes, x, out, shape, x_contig: bool, out_contig: bool, errors):
    """Run `passes` over x's and out's flat elements; a non-contiguous x is copied first, a non-contiguous
    out is written through a contiguous temporary. A signature mismatch recorded in `errors` raises after the
    pass that found it (on the cpu backend, where launches are synchronous; on GPUs a later check raises)."""
    res = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    src = x if x_contig else x.contiguous()
    dst = res if out_contig else torch.empty(shape, dtype=x.dtype, device=x.device)
    xf, of = src.view(-1), dst.view(-1)
    for p in passes:
        p(xf, of)
        errors.raise_recorded()
    if dst is not res:
        res.copy_(dst)
    return res


def _check_outside(x: torch.Tensor, out: torch.Tensor) -> None:
    """out may be x itself (in place), or a tensor that shares no memory with x."""
    if overlaps(x, out) and not (out.data_ptr() == x.data_ptr() and out.numel() == x.numel()
                                 and out.is_contiguous() and x.is_contiguous()):
        raise ValueError("out overlaps x without being x: pass a separate tensor")


@declare_op(tensors=("x", "out"), collective=True)
def all_reduce(x: torch.Tensor, op: str = "sum", method: str = "auto", out: torch.Tensor | None = None,
               group=None) -> torch.Tensor:
    """Reduce `x` over the members of `group` (default: the world); every member gets the result (same shape and
    dtype as x).

    op: "sum", "avg" (the sum divided by the group size), "max", "min", "product", or the
    torch.distributed.ReduceOp of one (ReduceOp.SUM, ...). dtypes: fp32, bf16, fp16, fp64, int8, uint8,
    int32, int64. 16-bit floats accumulate in fp32, the others in their own type (integers wrap as torch's
    do; an integer average is the wrapped sum divided toward zero, as NCCL's); MAX / MIN propagate NaN as
    torch.maximum / torch.minimum. method: "one_shot" (each rank reads every
    rank's whole input: lowest latency), "two_shot" (reduce-scatter then
    all-gather: least traffic, for large inputs), "nccl" (the process group's
    own all_reduce: NCCL on GPUs, gloo on the cpu backend), "auto" (by size,
    group size and output kind, NCCL where it is measured faster, and for the (op, dtype) pairs the kernels
    are not measured on). `out=x` reduces in place; `out` may be any tensor of x's shape and dtype, of any
    layout. Any x: non-contiguous, any size (messages beyond the workspace go
    through in passes). On a group of one: a copy into `out` (none in place), no kernel. Collective over the
    group: every member calls it with the same shape, dtype, op and method.
    """
    g = resolve(group)
    found = plan(g, lambda: ("all_reduce", signature(x), _op_key(op), method, out_kind(g, out, x),
                             None if out is None or out is x else signature(out)),
                 lambda: AllReducePlan(g, x, op, method, out))
    return found.run(x, out)


def _auto_method(nbytes: int, device: torch.device, world_size: int) -> str:
    limit = tuning.value("all_reduce.one_shot_max_bytes", device, world_size)
    return "one_shot" if nbytes <= limit else "two_shot"


class AllReducePlan(Plan):
    """An all_reduce of one signature; `path` names what serves it: "empty", "alone" (a group of one), "nccl",
    or the kernel ("ll", "one_shot", "ll_two_shot", "two_shot")."""

    def __init__(self, group, x, op, method, out):
        super().__init__(group)
        check_tensor("x", x, group, dtypes=DTYPES, contiguous=False)
        self.op = op = reduce_op_name(op)
        check_method(method, METHODS)
        if out is not None:
            check_out(out, x.shape, x.dtype, group)
        kind = out_kind(group, out, x)
        self.checks_out = kind in ("plain", "symmetric")
        self.check(x, out)  # before the workspace is made
        self.shape, self.n, w = x.shape, x.numel(), group.size
        self.x_contig = x.is_contiguous()
        self.out_contig = out is None or out.is_contiguous()
        if self.n == 0:
            self.path, self.run = "empty", self.run_empty
        elif w == 1:
            self.path, self.run = "alone", self.run_alone
        elif group.topology.spans_nodes and method != "nccl" and hierarchical.hierarchy(group) is not None:
            self.path = "hierarchical"  # weft/kernels/hierarchical.py: the node's kernels, the network between
            self.run = hierarchical.AllReduce(group, hierarchical.hierarchy(group), x.shape, op, self.check).run
        else:
            if group.topology.spans_nodes:
                method = "nccl"  # nodes of unequal member counts: no rails
            nbytes = self.n * x.element_size()
            symmetric = out is not None and self.out_contig and group.heap.contains(out)
            if method == "auto":
                kind_key = "in_place" if kind == "x" and not symmetric else "symmetric" if symmetric else "plain"
                nccl = not _kernels_take(op, x.dtype, group) or \
                    nbytes >= nccl_from(f"all_reduce.nccl_above.{kind_key}", group)
                method = "nccl" if nccl else _auto_method(nbytes, x.device, w)
            if method == "nccl":
                self.path, self.run = "nccl", self.run_nccl
            else:
                self.prepare_passes(group, x, out, method, symmetric)

    def check(self, x, out):
        if self.checks_out:
            _check_outside(x, out)

    def run_empty(self, x, out):
        self.check(x, out)
        return torch.empty(self.shape, dtype=x.dtype, device=x.device) if out is None else out

    def run_alone(self, x, out):
        """A group of one: the reduction of one value is that value (every op, bit for bit)."""
        self.check(x, out)
        if out is None:
            return x.clone(memory_format=torch.contiguous_format)
        if out is not x:
            out.copy_(x)
        return out

    def run_nccl(self, x, out):
        self.check(x, out)
        if out is None:
            res = x.clone(memory_format=torch.contiguous_format)
        elif out is x and self.x_contig:
            res = out
        else:
            res = (out if self.out_contig else torch.empty(self.shape, dtype=x.dtype, device=x.device)).copy_(x)
        _pg_all_reduce(res, self.op, self.group.process_group)
        if out is not None and res is not out:
            out.copy_(res)
        return res if out is None else out

    def prepare_passes(self, group, x, out, method, symmetric):
        """The kernel's launches: one pass per workspace-sized part of x."""
        op, shape, n, w = self.op, self.shape, self.n, group.size
        nbytes = n * x.element_size()
        ws = _workspace(group)
        target = out if out is not None else x  # what the output's alignment follows
        xf = (x if self.x_contig else torch.empty(shape, dtype=x.dtype, device=x.device)).view(-1)
        of = (target if target.is_contiguous() else torch.empty(shape, dtype=x.dtype, device=x.device)).view(-1)
        if out is None:
            of = torch.empty(n, dtype=x.dtype, device=x.device)
        recv, half_len = ws.data_as(x.dtype)
        ll_words = ws.ll_half_words
        ll_max = tuning.value("all_reduce.ll_max_bytes", x.device, w)
        ll_two_shot_max = tuning.value("all_reduce.ll_two_shot_symmetric_max_bytes" if symmetric
                                       else "all_reduce.ll_two_shot_max_bytes", x.device, w)
        # The members must agree on the path (the LL paths also depend on 4-byte alignment: a member whose x or out
        # is not 4-byte aligned takes another path, which the signature check reports), and into a symmetric out
        # on where the gathered slices go.
        sign = lambda path: self.sign("all_reduce", n=n, dtype=_dtype_name(x.dtype), op=op, path=path)
        if method == "one_shot" and _ll_fits(nbytes, min(ll_max, ll_words // w * 4), xf, of):
            self.path = "ll"
            self.passes = [_one_shot_ll_pass(group, ws, xf, of, 0, n, op, sign(self.path))]
        elif method == "one_shot":
            self.path = "one_shot"
            fp = sign(self.path)
            self.passes = [_one_shot_pass(group, ws, xf, of, lo, hi, op, fp)
                           for lo, hi in _pieces(n, half_len // w - 16, 16)]
        elif _ll_fits(nbytes, min(ll_two_shot_max, (ll_words // (2 * w) - 1) * w * 4), xf, of):
            self.path = "ll_two_shot"
            self.passes = [_two_shot_ll_pass(group, ws, xf, of, 0, n, op, sign(self.path))]
        else:
            # Into a plain out a half holds W slots and the gathered slices; into a symmetric one just the slots.
            copy_out = not symmetric
            align = 16 // x.element_size()
            most = (half_len // (2 * w if copy_out else w) - align) // align * align * w
            self.path = "two_shot"
            fp = sign("two_shot" if copy_out else "two_shot into a symmetric out")
            self.passes = [_two_shot_pass(group, ws, xf, of, lo, hi, True, copy_out, op, fp)
                           for lo, hi in _pieces(n, most, align * w)]
        self.errors = ws.errors
        if len(self.passes) == 1 and self.x_contig and self.out_contig and not backend.INTERPRET:
            self.direct, self.run = self.passes[0].direct, self.run_direct
        else:
            self.run = self.run_passes

    def run_direct(self, x, out):
        """The common case (one pass, contiguous tensors), in as few Python steps as it takes."""
        if self.checks_out:
            _check_outside(x, out)
        res = torch.empty_like(x) if out is None else out  # x is contiguous here; empty_like parses less
        self.direct(x, res)
        self.errors.raise_recorded()
        return res

    def run_passes(self, x, out):
        self.check(x, out)
        return _run_passes(self.passes, x, out, self.shape, self.x_contig, self.out_contig, self.errors)


@declare_op(tensors=("x", "out"), collective=True)
def reduce_scatter(x: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None,
                   method: str = "auto", group=None) -> torch.Tensor:
    """Member r of `group` (default: the world) gets the reduction over the members of rows
    [r * m, (r + 1) * m) of x, where x has (group size) * m rows.

    Returns (m, *x.shape[1:]) with x's dtype. op and dtypes as all_reduce's (the same accumulation, wrap,
    average and NaN rules). `out` may be
    any tensor of that shape, including a row block of x itself (NCCL-style in
    place: out = x[r * m:(r + 1) * m]). method: "two_shot" (weft's push
    kernel), "nccl" (the process group's reduce_scatter), "auto". On a group of one: a copy of x (none in
    place), no kernel. Collective over the group.
    """
    g = resolve(group)
    found = plan(g, lambda: ("reduce_scatter", signature(x), _op_key(op), method, out_kind(g, out),
                             None if out is None else signature(out)),
                 lambda: ReduceScatterPlan(g, x, op, out, method))
    return found.run(x, out)


class ReduceScatterPlan(Plan):
    """A reduce_scatter of one signature: no data, a group of one, the process group's collective, or the
    two-shot kernel's first half (in one pass, or pass by pass over column ranges of every rank's block)."""

    def __init__(self, group, x, op, out, method):
        super().__init__(group)
        check_tensor("x", x, group, dtypes=DTYPES, contiguous=False)
        self.op = op = reduce_op_name(op)
        check_method(method, RS_METHODS)
        w = group.size
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension")
        if x.shape[0] % w:
            raise ValueError(f"x has {x.shape[0]} rows, not divisible by the group size {w}")
        self.shape = shape = (x.shape[0] // w, *x.shape[1:])
        if out is not None:
            check_out(out, shape, x.dtype, group)
        self.n = n = x.numel()
        self.m = n // w  # elements per rank's block
        self.x_contig = x.is_contiguous()
        self.out_contig = out is None or out.is_contiguous()
        self.block_bytes = max(1, self.m * x.element_size())
        self.dtype, self.device = x.dtype, x.device
        self.check(x, out)  # before the workspace is made
        if n == 0:
            self.run = self.run_empty
        elif w == 1:
            self.run = self.run_alone
        elif group.topology.spans_nodes and method != "nccl" and hierarchical.hierarchy(group) is not None:
            self.run = hierarchical.ReduceScatter(group, hierarchical.hierarchy(group), shape, op, self.check).run
        else:
            if group.topology.spans_nodes:
                method = "nccl"  # nodes of unequal member counts: no rails
            if method == "auto":
                symmetric = out is not None and group.heap.contains(out)
                key = f"all_reduce.reduce_scatter_nccl_above.{'symmetric' if symmetric else 'plain'}"
                method = "nccl" if not _kernels_take(op, x.dtype, group) or \
                    n * x.element_size() >= nccl_from(key, group) else "two_shot"
            if method == "nccl":
                self.run = self.run_nccl
            else:
                self.prepare_passes(group, x)

    def check(self, x, out):
        """out may be a row block of x at a block boundary (NCCL's in place), or outside x."""
        if out is not None and self.x_contig and overlaps(out, x):
            offset = out.data_ptr() - x.data_ptr()
            if not (self.out_contig and 0 <= offset and offset % self.block_bytes == 0):
                raise ValueError("out overlaps x without being x's row block r * m : (r + 1) * m: pass a separate "
                                 "tensor")

    def result(self, out):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device) if out is None else out

    def run_empty(self, x, out):
        self.check(x, out)
        return self.result(out)

    def run_alone(self, x, out):
        """A group of one: its block is all of x, reduced over one member: x itself (bit for bit)."""
        self.check(x, out)
        if out is None:
            return x.clone(memory_format=torch.contiguous_format)
        if not (out.data_ptr() == x.data_ptr() and self.x_contig and self.out_contig):  # in place: nothing
            out.copy_(x)
        return out

    def run_nccl(self, x, out):
        self.check(x, out)
        res = torch.empty(self.shape, dtype=x.dtype, device=x.device) if out is None or not self.out_contig else out
        src = x if self.x_contig else x.contiguous()
        if out is not None and overlaps(res, src):  # in place: the block to a separate buffer first
            src = src.clone()
        _pg_reduce_scatter(res, src, self.op, self.group.process_group)
        if out is not None and res is not out:
            out.copy_(res)
        return res if out is None else out

    def prepare_passes(self, group, x):
        w, n, m, op = group.size, self.n, self.m, self.op
        ws = _workspace(group)
        self.errors = ws.errors
        fp = self.sign("reduce_scatter", n=n, dtype=_dtype_name(x.dtype), op=op)
        recv, half_len = ws.data_as(x.dtype)
        most = half_len // w  # elements of each rank's block per pass
        xf = (x if self.x_contig else torch.empty(x.shape, dtype=x.dtype, device=x.device)).reshape(-1)
        of = torch.empty(m, dtype=x.dtype, device=x.device)
        if m <= most:
            self.passes = [_two_shot_pass(group, ws, xf, of, 0, n, False, False, op, fp)]
            if self.x_contig and self.out_contig and not backend.INTERPRET:
                self.direct, self.run = self.passes[0].direct, self.run_direct
            else:
                self.run = self.run_one_pass
            return
        # Larger than the workspace: pass by pass over a column range [lo, hi) of every rank's block, gathered
        # into a contiguous (W, hi - lo) temporary first (a local copy: the price of a bounded workspace). The
        # temporary is the call's own, not the plan's: a plan keeps no memory of torch's allocator.
        self.pieces = _pieces(m, most, 16)
        sample = torch.empty(w * self.pieces[0][1], dtype=x.dtype, device=x.device)
        self.passes = [_two_shot_pass(group, ws, sample[:w * (hi - lo)], of[:hi - lo], 0, w * (hi - lo), False,
                                      False, op, fp) for lo, hi in self.pieces]
        self.run = self.run_pieces

    def run_direct(self, x, out):
        """The common case (one pass, contiguous tensors), in as few Python steps as it takes."""
        if out is not None:
            self.check(x, out)
        res = self.result(out)
        self.direct(x, res)
        self.errors.raise_recorded()
        return res

    def run_one_pass(self, x, out):
        self.check(x, out)
        res = self.result(out)
        dst = res if self.out_contig else torch.empty(self.shape, dtype=x.dtype, device=x.device)
        src = x if self.x_contig else x.contiguous()
        if backend.INTERPRET:
            self.passes[0](src.view(-1), dst.view(-1))
        else:
            self.passes[0].direct(src, dst)
        self.errors.raise_recorded()
        if dst is not res:
            res.copy_(dst)
        return res

    def run_pieces(self, x, out):
        self.check(x, out)
        res = self.result(out)
        w, m = self.group.size, self.m
        blocks = x.reshape(w, m)
        stage = torch.empty(w * self.pieces[0][1], dtype=x.dtype, device=x.device)
        dst = torch.empty(m, dtype=x.dtype, device=x.device)
        for (lo, hi), p in zip(self.pieces, self.passes):
            part = stage[:w * (hi - lo)].view(w, hi - lo)
            part.copy_(blocks[:, lo:hi])
            p.direct(part.view(-1), dst[lo:hi])
            self.errors.raise_recorded()
        res.copy_(dst.view(self.shape))
        return res


@declare_op(tensors=("x",), collective=True)
def broadcast(x: torch.Tensor, root: int = 0, group=None) -> torch.Tensor:
    """Copy x of member `root` of `group` (default: the world) into x on every member, in place; returns x.
    `root` is a group rank (member `root` is world rank group.ranks[root]). Any dtype and layout. On a group
    of one: nothing to do. Collective over the group."""
    g = resolve(group)
    found = plan(g, lambda: ("broadcast", signature(x), root if type(root) is int else None),
                 lambda: BroadcastPlan(g, x, root))
    return found.run(x)


class BroadcastPlan(Plan):
    """A broadcast of one signature: nothing (no data, or a group of one), or the root's pushes in passes."""

    def __init__(self, group, x, root):
        super().__init__(group)
        check_tensor("x", x, group, contiguous=False)
        try:
            index = operator.index(root) if not isinstance(root, bool) else None
        except TypeError:
            index = None
        if index is None or not 0 <= index < group.size:
            raise ValueError(f"root must be a group rank, an int in [0, {group.size}), got {root!r}")
        root = int(index)
        if x.numel() == 0 or group.size == 1:
            self.run = self.run_nothing
            return
        self.contig = contig = x.is_contiguous()
        ws = _workspace(group)
        self.errors = ws.errors
        xw = as_words(x if contig else torch.empty(x.shape, dtype=x.dtype, device=x.device))
        n = xw.numel()
        # The word size follows x's alignment (as_words): members whose x differ in it split the bytes
        # differently, which the signature check reports.
        fp = self.sign("broadcast", bytes=n * xw.element_size(), word=_dtype_name(xw.dtype), root=root)
        data, half_len = ws.data_as(xw.dtype)
        heap = group.heap.descriptor
        self.passes = []
        for lo, hi in _pieces(n, half_len, 16):
            programs, block, warps = _launch_shape(hi - lo, xw.element_size(), x.device, group.size)
            chunk = triton.cdiv(triton.cdiv(hi - lo, programs), block) * block
            vec = _vector_width(xw.element_size(), xw[lo:hi])
            args = lambda xs, os, f, k=hi - lo, chunk=chunk: (xs, *f[:4], k, chunk, half_len, root, *f[4:], fp)
            self.passes.append(_Pass(broadcast_kernel, (programs,), args, (data, ws.flags, ws.counter, heap, ws.sig,
                                                                            ws.errors.tensor),
                                     dict(BLOCK=block, VEC=vec), warps, xw, xw, lo, hi))
        if len(self.passes) == 1 and contig and not backend.INTERPRET:
            self.direct, self.run = self.passes[0].direct, self.run_direct
        else:
            self.run = self.run_passes

    def run_nothing(self, x):
        return x

    def run_direct(self, x):
        self.direct(x, x)
        self.errors.raise_recorded()
        return x

    def run_passes(self, x):
        buf = x if self.contig else x.contiguous()
        words = as_words(buf)
        for p in self.passes:
            p(words, words)
            self.errors.raise_recorded()
        if buf is not x:
            x.copy_(buf)
        return x


# -- the operators ------------------------------------------------------------------------------------------
#   torch.ops.weft.all_reduce(x, group_name, op, method)       -> (x's shape)
#   torch.ops.weft.all_reduce_(x, group_name, op, method)      -> (), x reduced in place
#   torch.ops.weft.reduce_scatter(x, group_name, op, method)   -> (rows / group size, ...)
#   torch.ops.weft.broadcast(x, group_name, root)              -> the root's x
#   torch.ops.weft.broadcast_(x, group_name, root)             -> (), x overwritten in place
# `op` is the reduction's name (a traced call passes a ReduceOp by its name). Autograd (docs/design.md), over
# the same group: all_reduce's backward is the all_reduce of the gradient (op sum or avg: the same op);
# reduce_scatter's the all_gather of it (avg: divided by the group size); broadcast's that all_reduce on the
# root, zero elsewhere. max, min and product have no backward here.

@all_reduce.define
def all_reduce_op(x: torch.Tensor, group_name: str, op: str = "sum", method: str = "auto") -> torch.Tensor:
    return fresh(all_reduce.eager(x, op=op, method=method, group=group_name), x)


@all_reduce_op.register_fake
def _(x, group_name, op="sum", method="auto"):
    return x.new_empty(x.shape)


@all_reduce.define(name="all_reduce_", mutates_args=("x",))
def all_reduce_inplace_op(x: torch.Tensor, group_name: str, op: str = "sum", method: str = "auto") -> None:
    all_reduce.eager(x, op=op, method=method, out=x, group=group_name)


@all_reduce_inplace_op.register_fake
def _(x, group_name, op="sum", method="auto"):
    return None


@all_reduce.traced
def _(x, op="sum", method="auto", out=None, group=None):
    name, op = group_name(group), reduce_op_name(op)
    if out is x and not (torch.is_grad_enabled() and x.requires_grad):
        torch.ops.weft.all_reduce_(x, name, op, method)
        return x
    return into(out, torch.ops.weft.all_reduce(x, name, op, method))


def _save_group_and_op(ctx, inputs, output):
    ctx.group_name = inputs[1]
    ctx.op = reduce_op_name(inputs[2]) if len(inputs) > 2 else "sum"


def _linear_op(ctx, name: str) -> str:
    """The op of a differentiated call: sum and avg are linear; the others have no backward here."""
    if ctx.op not in ("sum", "avg"):
        raise NotImplementedError(f"weft.ops.{name}'s backward is defined for op 'sum' and 'avg', not {ctx.op!r}")
    return ctx.op


def _all_reduce_backward(ctx, grad):
    # Every member's output is the same reduction of every member's x: the gradient of x is the same reduction
    # of every member's output gradient.
    return all_reduce(grad, op=_linear_op(ctx, "all_reduce"), group=ctx.group_name), None, None, None


all_reduce_op.register_autograd(_all_reduce_backward, setup_context=_save_group_and_op)


@reduce_scatter.define
def reduce_scatter_op(x: torch.Tensor, group_name: str, op: str = "sum", method: str = "auto") -> torch.Tensor:
    return fresh(reduce_scatter.eager(x, op=op, method=method, group=group_name), x)


@reduce_scatter_op.register_fake
def _(x, group_name, op="sum", method="auto"):
    size = group_size(group_name)
    rows_divisible(x, size)
    return x.new_empty((x.shape[0] // size, *x.shape[1:]))


@reduce_scatter.traced
def _(x, op="sum", out=None, method="auto", group=None):
    return into(out, torch.ops.weft.reduce_scatter(x, group_name(group), reduce_op_name(op), method))


def _reduce_scatter_backward(ctx, grad):
    from .all_gather import all_gather
    gathered = all_gather(grad, group=ctx.group_name)
    if _linear_op(ctx, "reduce_scatter") == "avg":
        gathered = gathered / group_size(ctx.group_name)
    return gathered, None, None, None


reduce_scatter_op.register_autograd(_reduce_scatter_backward, setup_context=_save_group_and_op)


@broadcast.define
def broadcast_op(x: torch.Tensor, group_name: str, root: int = 0) -> torch.Tensor:
    return broadcast.eager(x.clone(memory_format=torch.contiguous_format), root=root, group=group_name)


@broadcast_op.register_fake
def _(x, group_name, root=0):
    return x.new_empty(x.shape)


@broadcast.define(name="broadcast_", mutates_args=("x",))
def broadcast_inplace_op(x: torch.Tensor, group_name: str, root: int = 0) -> None:
    broadcast.eager(x, root=root, group=group_name)


@broadcast_inplace_op.register_fake
def _(x, group_name, root=0):
    return None


@broadcast.traced
def _(x, root=0, group=None):
    name = group_name(group)
    if torch.is_grad_enabled() and x.requires_grad:  # in place for autograd: a copy of the functional result
        return x.copy_(torch.ops.weft.broadcast(x, name, root))
    torch.ops.weft.broadcast_(x, name, root)
    return x


def _broadcast_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]
    ctx.root = inputs[2] if len(inputs) > 2 else 0


def _broadcast_backward(ctx, grad):
    # Every member's output is the root's x: the root's gradient is the sum of all of them, the others' zero.
    summed = all_reduce(grad, group=ctx.group_name)
    return (summed if resolve(ctx.group_name).rank == ctx.root else torch.zeros_like(grad)), None, None


broadcast_op.register_autograd(_broadcast_backward, setup_context=_broadcast_setup)


# Signatures for the sm_90 compile check (weft.testing.compile).
_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
# The other dtypes and ops, each compiled in the kernels that take them (the LL kernels take the float dtypes).
_MORE = [("*fp64", AVG), ("*i8", AVG), ("*u8", PRODUCT), ("*i32", MAX), ("*i64", MIN), ("*fp32", MAX),
         ("*bf16", AVG), ("*fp16", PRODUCT)]
COMPILE_CASES = [
    (all_reduce_one_shot_kernel, dict(x=t, recv=t, out=t, flags="*i32", counter="*i64", heap="*i64", n="i32",
                                      chunk="i32", slot_len="i32", half_len="i32", sig="*i64", err="*i64", fp="i32"),
     dict(OP=SUM.value, WORLD=wd, BLOCK=2048, VEC=v), dict(num_warps=8))
    for dt, t in _PTR.items() for wd in (2, 8) for v in (1, 16 // dt.itemsize)
] + [
    (all_reduce_two_shot_kernel, dict(x=t, recv=t, gathered=t, out=t, flags="*i32", counter="*i64", heap="*i64",
                                      n="i32", slice_len="i32", chunk="i32", half_len="i32", sig="*i64", err="*i64",
                                      fp="i32"),
     dict(GATHER=g, COPY_OUT=c, OP=SUM.value, WORLD=8, BLOCK=2048, VEC=v), dict(num_warps=8))
    for dt, t in _PTR.items() for g, c in ((True, True), (True, False), (False, False)) for v in (1, 16 // dt.itemsize)
] + [
    (all_reduce_one_shot_kernel, dict(x=t, recv=t, out=t, flags="*i32", counter="*i64", heap="*i64", n="i32",
                                      chunk="i32", slot_len="i32", half_len="i32", sig="*i64", err="*i64", fp="i32"),
     dict(OP=op.value, WORLD=4, BLOCK=1024, VEC=1), dict(num_warps=4))
    for t, op in _MORE
] + [
    (all_reduce_two_shot_kernel, dict(x=t, recv=t, gathered=t, out=t, flags="*i32", counter="*i64", heap="*i64",
                                      n="i32", slice_len="i32", chunk="i32", half_len="i32", sig="*i64", err="*i64",
                                      fp="i32"),
     dict(GATHER=g, COPY_OUT=True, OP=op.value, WORLD=4, BLOCK=1024, VEC=1), dict(num_warps=4))
    for t, op in _MORE for g in (True, False)
] + [
    (all_reduce_ll_kernel, dict(x="*i32", ll="*i64", out="*i32", counter="*i64", heap="*i64", words="i32",
                                chunk="i32", half_words="i32", sig="*i64", err="*i64", fp="i32"),
     dict(OP=op.value, ELEM=e, WORLD=wd, BLOCK=256), dict(num_warps=4))
    for e in (tl.float32, tl.bfloat16, tl.float16) for wd in (2, 8) for op in (SUM, AVG, MAX)
] + [
    (all_reduce_ll_two_shot_kernel, dict(x="*i32", ll="*i64", out="*i32", counter="*i64", heap="*i64", words="i32",
                                         slice_len="i32", chunk="i32", half_words="i32", sig="*i64", err="*i64",
                                         fp="i32"),
     dict(OP=op.value, ELEM=e, WORLD=wd, BLOCK=256), dict(num_warps=4))
    for e in (tl.float32, tl.bfloat16, tl.float16) for wd in (2, 8) for op in (SUM, MIN, PRODUCT)
] + [
    (broadcast_kernel, dict(x=t, recv=t, flags="*i32", counter="*i64", heap="*i64", n="i32", chunk="i32",
                            half_len="i32", root="i32", sig="*i64", err="*i64", fp="i32"),
     dict(BLOCK=2048, VEC=v), dict(num_warps=8))
    for t in ("*i32", "*i16", "*i8") for v in (1, 16 // {"*i32": 4, "*i16": 2, "*i8": 1}[t])
]
