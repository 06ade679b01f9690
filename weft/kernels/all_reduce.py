"""The reduction family through the symmetric heap: all_reduce (one-shot, two-shot), reduce_scatter, broadcast.

all_reduce:     out = sum over ranks r of x on rank r, on every rank.
reduce_scatter: out on rank r = sum over ranks of x[r * m : (r + 1) * m], x of (W * m, ...) rows.
broadcast:      x on every rank = x on rank `root` (in place).

all_reduce and reduce_scatter move data only with stores into peers' memory
(NVLink writes on the GPU: posted, no round trip, unlike remote loads) and
read only their own memory:

- one-shot all-reduce: every rank pushes its whole x into slot [me] of every
  rank's receive buffer, signals, and sums the W slots it received. One
  synchronisation step, (W - 1) * n elements sent per rank: the fastest for
  small messages, where latency dominates.
  Up to LL_MAX_BYTES it sends LL words instead (`wl.pack_ll`: 4 bytes of x
  and the epoch in one 8-byte store), and the receiver polls the words
  themselves (`wl.wait_ll`): no fence and no separate flag, at twice the
  bytes.
- two-shot all-reduce: a reduce-scatter (rank r receives slice r of every
  rank's x in W slots and sums them) followed by an all-gather (rank r pushes
  its summed slice into slice r of every rank's gather buffer, or straight
  into every rank's `out` when `out` is symmetric; then each rank copies the
  gather buffer to `out`). Two steps, but only ~2 (W - 1) / W * n elements
  cross the links per rank: the faster one once bandwidth dominates.
  Up to LL_TWO_SHOT_MAX_BYTES both steps send LL words, and the receivers
  unpack the gathered words straight into `out`.
- reduce_scatter: the first half of two-shot, the sum written to `out`.

Sums accumulate in fp32 in rank order 0, 1, ..., W - 1 on every rank, so
every rank gets the same bits and one-shot and two-shot agree bit for bit.

The elements are split into one part per program. Program p of every rank
handles part p only (for two-shot and reduce_scatter: sub-chunk p of every
rank's slice) and waits only on program p of its peers, so programs never
wait on a later program of their own grid (the interpreter runs them one
after another). Signals go to all ranks at once (`notify_all`) and a wait
polls all W flags at once. Flags count epochs, kept on the device, so calls
run back to back and replay in CUDA graphs with no reset.

Receive and gather buffers are double-buffered by epoch parity, and need no
extra handshake: rank s writes half e % 2 of rank q's buffers in epoch e
only after it saw q's first signal of epoch e - 1 (program p waited for it),
which q sent from its kernel of epoch e - 1, launched after its kernel of
epoch e - 2, the last reader of that half, had completed. The same argument
lets two-shot push straight into a symmetric `out`: a peer writes my `out`
only after my kernel of this call has started (it waited for my phase-1
data), so all my earlier work on `out` is done.

Per program slot the contexts keep int32 flags:
    one-shot and two-shot LL: [epoch]
    one-shot, reduce_scatter: [epoch, arrived[W]]
    two-shot:                 [epoch, arrived[W], reduced[W]]
    broadcast:                [epoch, ready, done[W]]
"""
from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

import weft.language as wl

from .all_gather import _at, _copy
from .common import as_words, check_method, check_out, check_tensor, world_or_raise

METHODS = ("auto", "one_shot", "two_shot")
OPS = ("sum",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# "auto" picks one_shot up to this many bytes at 8 ranks, two_shot above; with
# fewer ranks one-shot sends less, so the limit scales as 8 / W. Measured on
# 4 H200s (docs/perf.md, 2026-11-21, bf16, plain output): one_shot 10.8 / 16.5 us
# and two_shot 11.9 / 15.0 us at 512 KiB / 1 MiB, so the switch sits between
# them there, i.e. at 256 KiB at 8 ranks (not yet measured on 8).
ONE_SHOT_MAX_BYTES_AT_8 = 256 << 10

# One-shot sends messages up to this many bytes as LL words (data and epoch in one 8-byte store):
# no fence and no separate flag, at twice the bytes.
LL_MAX_BYTES = 64 << 10

# Two-shot sends messages up to this many bytes as LL words (all_reduce_ll_two_shot_kernel), or up to
# LL_TWO_SHOT_SYMMETRIC_MAX_BYTES into a symmetric `out` (where the push path needs no copy-out).
# Measured on 4 H200s (bf16, CUDA graphs, 2026-11-21): LL 7.3 / 8.0 / 8.7 / 10.5 / 16.1 us at
# 4 KiB / 64 KiB / 256 KiB / 512 KiB / 1 MiB; the push path 9.6 / 10.8 / 11.0 / 11.9 / 14.5 into a plain
# out, 8.1 / 8.8 / 9.1 / 10.1 / 12.3 into a symmetric one.
LL_TWO_SHOT_MAX_BYTES = 512 << 10
LL_TWO_SHOT_SYMMETRIC_MAX_BYTES = 256 << 10


# -- device helpers -------------------------------------------------------------

@triton.jit
def _cast(acc, dtype: tl.constexpr):
    """fp32 `acc` rounded to `dtype`, to nearest even. (Triton 3.6's interpreter
    truncates fp32 -> bf16; do the rounding by hand there, as the GPU does it.)"""
    if wl.INTERPRET:
        if dtype == tl.bfloat16:
            bits = acc.to(tl.int32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return acc.to(dtype)


@triton.jit
def _push_all(dst, src, lo, hi, heap, WORLD: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """dst[i] = src[i] for i in [lo, hi) on every rank (`dst` symmetric): one load, W stores."""
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(_at(src, offs, VEC))
        for q in tl.static_range(WORLD):
            tl.store(_at(wl.symm_at(dst, q, heap), offs, VEC), v)
    offs = full + tl.arange(0, BLOCK)
    mask = offs < hi
    v = tl.load(src + offs, mask=mask)
    for q in tl.static_range(WORLD):
        tl.store(wl.symm_at(dst, q, heap) + offs, v, mask=mask)


@triton.jit
def _sum_slots(slots, slot_len, offs, mask, MASKED: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
               VEC: tl.constexpr):
    """fp32 sum over q = 0..WORLD-1 of slots[q * slot_len + offs] (local memory). The loop is
    unrolled, so all WORLD loads are in flight before the adds need them."""
    acc = tl.zeros([BLOCK], tl.float32)
    for q in tl.static_range(WORLD):
        if MASKED:
            v = tl.load(slots + q * slot_len + offs, mask=mask, other=0.0)
        else:
            v = tl.load(_at(slots + q * slot_len, offs, VEC))
        acc += v.to(tl.float32)
    return acc


@triton.jit
def _reduce(dst, slots, slot_len, lo, hi, heap, PUSH: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
            VEC: tl.constexpr):
    """dst[i] = sum over q of slots[q * slot_len + i] for i in [lo, hi).

    With PUSH, `dst` is symmetric and the result goes to every rank's `dst`."""
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        val = _cast(_sum_slots(slots, slot_len, offs, None, False, WORLD, BLOCK, VEC), dst.dtype.element_ty)
        if PUSH:
            for q in tl.static_range(WORLD):
                tl.store(_at(wl.symm_at(dst, q, heap), offs, VEC), val)
        else:
            tl.store(_at(dst, offs, VEC), val)
    offs = full + tl.arange(0, BLOCK)
    mask = offs < hi
    val = _cast(_sum_slots(slots, slot_len, offs, mask, True, WORLD, BLOCK, VEC), dst.dtype.element_ty)
    if PUSH:
        for q in tl.static_range(WORLD):
            tl.store(wl.symm_at(dst, q, heap) + offs, val, mask=mask)
    else:
        tl.store(dst + offs, val, mask=mask)


@triton.jit
def _span(s, p, n, slice_len, chunk):
    """[lo, hi) of sub-chunk p of slice s (empty when past the end)."""
    lo = s * slice_len + p * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, (s + 1) * slice_len), n)
    return lo, tl.maximum(hi, lo)


# -- kernels --------------------------------------------------------------------

@triton.jit(do_not_specialize=["n", "chunk", "slot_len"])
def all_reduce_one_shot_kernel(x, recv, out, flags, heap, n, chunk, slot_len, WORLD: tl.constexpr,
                               BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Push part p of x into slot [me] of every rank's `recv` (half epoch % 2), then sum my W slots.

    `recv` holds two halves of W slots of `slot_len` elements.
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    f = flags + p * (1 + WORLD)
    arrived = f + 1
    epoch = tl.load(f) + 1
    half = recv + (epoch % 2) * WORLD * slot_len
    lo = p * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, n), lo)
    _push_all(half + me * slot_len, x, lo, hi, heap, WORLD, BLOCK, VEC)
    wl.notify_all(arrived + me, heap, epoch)
    token = wl.wait(arrived, WORLD, epoch, wl.CMP_GE)
    _reduce(out, wl.consume_token(half, token), slot_len, lo, hi, heap, False, WORLD, BLOCK, VEC)
    tl.store(f, epoch)


@triton.jit
def _halves_of(words, ELEM: tl.constexpr):
    """The two 16-bit elements packed in each int32 word (little-endian: element 2j low), as fp32."""
    lo = (words & 0xFFFF).to(tl.int16).to(ELEM, bitcast=True)
    hi = ((words >> 16) & 0xFFFF).to(tl.int16).to(ELEM, bitcast=True)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _word_of(lo, hi, ELEM: tl.constexpr):
    """fp32 `lo`, `hi` rounded to ELEM and packed back into one int32 word."""
    lo_bits = _cast(lo, ELEM).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = _cast(hi, ELEM).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo_bits | (hi_bits << 16)


@triton.jit
def _ll_sum(slots, slot_len, offs, mask, epoch, ELEM: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """The int32 words of the sum over q = 0..WORLD-1 (rank order, fp32) of the LL words at
    slots[q * slot_len + offs], each awaited until it carries `epoch`. A 16-bit ELEM packs two elements
    per word, summed separately."""
    acc_lo = tl.zeros([BLOCK], tl.float32)
    acc_hi = tl.zeros([BLOCK], tl.float32)
    for q in tl.static_range(WORLD):
        got = wl.wait_ll(slots + q * slot_len + offs, mask, epoch)
        if ELEM == tl.float32:
            acc_lo += got.to(tl.float32, bitcast=True)
        else:
            a, b = _halves_of(got, ELEM)
            acc_lo += a
            acc_hi += b
    if ELEM == tl.float32:
        word = _cast(acc_lo, tl.float32).to(tl.int32, bitcast=True)
    else:
        word = _word_of(acc_lo, acc_hi, ELEM)
    return word


@triton.jit(do_not_specialize=["words", "chunk", "slot_len"])
def all_reduce_ll_kernel(x, ll, out, flags, heap, words, chunk, slot_len, ELEM: tl.constexpr, WORLD: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One-shot with the data's own words as flags: push part p of x (int32 words) as LL words into
    slot [me] of every rank's `ll` (half epoch % 2), then sum my W slots as their words arrive.

    No fence, no separate flag: each 8-byte LL word carries 4 bytes of x and the epoch. `ll` holds two
    halves of W slots of `slot_len` int64 words; flags hold [epoch] per program.
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    f = flags + p
    epoch = tl.load(f) + 1
    half = ll + (epoch % 2) * WORLD * slot_len
    lo = p * chunk
    hi = tl.minimum(lo + chunk, words)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        packed = wl.pack_ll(tl.load(x + offs, mask=mask, other=0), epoch)
        for q in tl.static_range(WORLD):
            tl.store(wl.symm_at(half + me * slot_len, q, heap) + offs, packed, mask=mask)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        tl.store(out + offs, _ll_sum(half, slot_len, offs, mask, epoch, ELEM, WORLD, BLOCK), mask=mask)
    tl.store(f, epoch)


@triton.jit(do_not_specialize=["words", "slice_len", "chunk"])
def all_reduce_ll_two_shot_kernel(x, ll, out, flags, heap, words, slice_len, chunk, ELEM: tl.constexpr,
                                  WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Two-shot in LL words: three one-way trips and no fence, for mid-size messages.

    Rank r owns slice r (words [r * slice_len, (r + 1) * slice_len) of x); program p handles sub-chunk p
    of every slice. `ll` holds two halves (epoch parity) of [recv: W slots of slice_len | gathered:
    W * slice_len] int64 words.
      1. push sub-chunk p of slice s of x, as LL words, into slot [me] of rank s's recv;
      2. sum my W slots as their words arrive, push the sum as LL words into slice me of every rank's
         gathered;
      3. unpack the W slices of my gathered into out as their words arrive.
    A half is rewritten two epochs after it was read: rank s writes my half in epoch e only after it
    received my data of epoch e - 1 (phase 1 of s's slice, and phase 2 of mine), which I sent from my
    kernel of epoch e - 1, launched after my kernel of epoch e - 2 completed. Flags hold [epoch].
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    f = flags + p
    epoch = tl.load(f) + 1
    recv = ll + (epoch % 2) * 2 * WORLD * slice_len
    gathered = recv + WORLD * slice_len
    for k in range(WORLD):
        s = (me + p + k) % WORLD  # staggered destinations, as in the two-shot kernel
        lo, hi = _span(s, p, words, slice_len, chunk)
        dst = wl.symm_at(recv, s, heap) + (me - s) * slice_len  # word i of slice s -> slot me, i - s * slice_len
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hi
            tl.store(dst + offs, wl.pack_ll(tl.load(x + offs, mask=mask, other=0), epoch), mask=mask)
    lo, hi = _span(me, p, words, slice_len, chunk)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        packed = wl.pack_ll(_ll_sum(recv - me * slice_len, slice_len, offs, mask, epoch, ELEM, WORLD, BLOCK), epoch)
        for j in tl.static_range(WORLD):
            tl.store(wl.symm_at(gathered, (me + j) % WORLD, heap) + offs, packed, mask=mask)
    for k in range(WORLD):
        s = (me + p + k) % WORLD
        lo, hi = _span(s, p, words, slice_len, chunk)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hi
            tl.store(out + offs, wl.wait_ll(gathered + offs, mask, epoch), mask=mask)
    tl.store(f, epoch)


@triton.jit(do_not_specialize=["n", "slice_len", "chunk"])
def all_reduce_two_shot_kernel(x, recv, gathered, out, flags, heap, n, slice_len, chunk, GATHER: tl.constexpr,
                               COPY_OUT: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                               VEC: tl.constexpr):
    """Reduce-scatter, then (GATHER) all-gather, of sub-chunk p of every slice.

    Rank r owns slice r = [r * slice_len, (r + 1) * slice_len) of the n
    elements. Phase 1: push sub-chunk p of slice q of x into slot [me] of
    rank q's `recv` (half epoch % 2, W slots of slice_len). Phase 2: sum my
    W slots; without GATHER (reduce_scatter) into out[0:slice_len]; with
    GATHER into slice me of every rank's `gathered` (a symmetric buffer:
    the context's, half epoch % 2 of 2 x W * slice_len, then COPY_OUT copies
    it to `out`; or the caller's symmetric `out` itself).

    Flags [epoch, arrived[W], reduced[W]].
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    f = flags + p * (1 + 2 * WORLD)
    arrived = f + 1
    reduced = f + 1 + WORLD
    epoch = tl.load(f) + 1
    slots = recv + (epoch % 2) * WORLD * slice_len
    for k in range(WORLD):
        # Destinations staggered by rank and program: were every program of every rank to push to
        # rank 0 first, then rank 1, ..., each rank's incoming links would carry W - 1 senders in turn.
        s = (me + p + k) % WORLD
        lo, hi = _span(s, p, n, slice_len, chunk)
        # Element i of slice s lands at slots[me * slice_len + i - s * slice_len] on rank s.
        _copy(wl.symm_at(slots, s, heap) + (me - s) * slice_len, x, lo, hi, BLOCK, VEC)
    wl.notify_all(arrived + me, heap, epoch)
    token = wl.wait(arrived, WORLD, epoch, wl.CMP_GE)
    mine = wl.consume_token(slots, token)
    lo, hi = _span(me, p, n, slice_len, chunk)
    base = me * slice_len
    if GATHER:
        dst = gathered
        if COPY_OUT:
            dst = gathered + (epoch % 2) * WORLD * slice_len
        _reduce(dst, mine - base, slice_len, lo, hi, heap, True, WORLD, BLOCK, VEC)
        wl.notify_all(reduced + me, heap, epoch)
        token = wl.wait(reduced, WORLD, epoch, wl.CMP_GE)
        if COPY_OUT:
            res = wl.consume_token(dst, token)
            for s in range(WORLD):
                lo, hi = _span(s, p, n, slice_len, chunk)
                _copy(out, res, lo, hi, BLOCK, VEC)
    else:
        _reduce(out - base, mine - base, slice_len, lo, hi, heap, False, WORLD, BLOCK, VEC)
    tl.store(f, epoch)


@triton.jit(do_not_specialize=["n", "chunk", "root"])
def broadcast_kernel(x, stage, flags, heap, n, chunk, root, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """The root stages part p of x; the others copy it from the root's `stage` into x.

    Everybody reports `done` to every rank (not only this call's root), so a
    later call with another root still knows its stage is free.
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    f = flags + p * (2 + world)
    ready = f + 1
    done = f + 2
    epoch = tl.load(f) + 1
    lo = p * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, n), lo)
    if me == root:
        wl.wait(done, world, epoch - 1, wl.CMP_GE)
        _copy(stage, x, lo, hi, BLOCK, VEC)
        wl.notify_all(ready, heap, epoch)
    else:
        token = wl.wait(ready, 1, epoch, wl.CMP_GE)
        src = wl.consume_token(wl.symm_at(stage, root, heap), token)
        _copy(x, src, lo, hi, BLOCK, VEC)
    wl.notify_all(done + me, heap, epoch)
    tl.store(f, epoch)


# -- host side ------------------------------------------------------------------

def _launch_shape(n: int, element_size: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, BLOCK elements, num_warps) for `n` elements handled per rank and step."""
    if device.type != "cuda":
        return min(4, max(1, n * element_size // 4096)), 1024, 4
    # Up to 4M elements per rank and step: one 1024-element block per program (4 warps), up to 128
    # programs. Measured on 4 H200s (bf16, 2026-11-21, 8 KiB / 256 KiB / 1 MiB): one-shot 4.8 / 8.0 /
    # 15.9 us, against 5.1 / 8.1 / 16.5 with 2048-element blocks of 8 warps and up to 64 programs, and
    # 5.1 / 8.1 / 21.5 with up to 256 (each program adds W signals). Every program fits on the GPU at
    # once, which the per-slot waits rely on.
    if n >= (1 << 22):
        # From 4M elements, up to 512 programs of 2048 (8 warps): more bytes in flight. Same run, 256 MiB:
        # reduce_scatter 656 us and two-shot 1272 us, against 678 / 1325 us with up to 256 programs.
        return min(512, triton.cdiv(n, 2048)), 2048, 8
    return max(1, min(128, triton.cdiv(n, 1024))), 1024, 4


def _vector_width(element_size: int, *tensors: torch.Tensor) -> int:
    """Elements per 16-byte access if every base is 16-byte aligned, else 1 (the
    caller makes every part boundary a multiple of it)."""
    if all(t.data_ptr() % 16 == 0 for t in tensors):
        return 16 // element_size
    return 1


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` share memory without being the same contiguous tensor."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    same = a0 == b0 and a1 == b1 and a.is_contiguous() and b.is_contiguous()
    return a0 < b1 and b0 < a1 and not same


def _check_op(op) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(repr(o) for o in OPS)}, got {op!r}")


class ReduceContext:
    """Symmetric buffers and epoch-counted flags for one (op, method, size, dtype, programs): `buffer`
    (receive slots; broadcast: the root's staging), and `gathered` (two-shot into a plain `out` only)."""

    def __init__(self, world, words: int, dtype: torch.dtype, programs: int, flags_per_program: int,
                 gather_words: int = 0):
        heap = world.heap
        self.programs = programs
        self.buffer = heap.empty((words,), dtype)
        if dtype == torch.int64:
            self.buffer.zero_()  # LL words: epoch 0 in every tag, never awaited
        self.gathered = heap.empty((gather_words,), dtype) if gather_words else None
        self.flags = heap.empty((programs * flags_per_program,), torch.int32)
        self.flags.zero_()
        world.barrier()  # flags are zero everywhere before anyone signals


def _context(world, key: tuple, words: int, dtype: torch.dtype, programs: int, flags_per_program: int,
             gather_words: int = 0):
    """The context for `key`, created on first use (collectively: every rank makes the same calls)."""
    key = (*key, dtype, programs)
    return world.context(key, lambda: ReduceContext(world, words, dtype, programs, flags_per_program,
                                                    gather_words))


def _auto_method(nbytes: int, world_size: int) -> str:
    return "one_shot" if nbytes * world_size <= ONE_SHOT_MAX_BYTES_AT_8 * 8 else "two_shot"


def _prepare_out(x: torch.Tensor, out, shape, world, slice_bytes: int | None = None) -> torch.Tensor:
    """`out`, checked (or made). A part of a contiguous x may be overwritten only by the program that
    staged it: out = x, or (slice_bytes) out at a slice boundary of x, as NCCL's in-place reduce_scatter."""
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    check_out(out, shape, x.dtype, world)
    if x.is_contiguous() and _overlaps(out, x):
        inside = x.data_ptr() <= out.data_ptr() and (out.data_ptr() + out.numel() * out.element_size()
                                                      <= x.data_ptr() + x.numel() * x.element_size())
        if not (slice_bytes and inside and (out.data_ptr() - x.data_ptr()) % slice_bytes == 0):
            what = "x's row block r * m : (r + 1) * m" if slice_bytes else "x"
            raise ValueError(f"out overlaps x without being {what}: pass a separate tensor")
    return out


def all_reduce(x: torch.Tensor, op: str = "sum", method: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum `x` over all ranks; every rank gets the result (same shape and dtype as x).

    op: "sum" (fp32 accumulation). method: "one_shot" (each rank reads every
    rank's whole input: lowest latency), "two_shot" (reduce-scatter then
    all-gather: least traffic, for large inputs), "auto" (by size and world
    size). `out=x` reduces in place; `out` may be any tensor of x's shape and
    dtype. Collective: every rank calls it with the same shape, dtype and
    method.
    """
    world = world_or_raise()
    check_tensor("x", x, world, dtypes=DTYPES, contiguous=False)
    _check_op(op)
    check_method(method, METHODS)
    out = _prepare_out(x, out, x.shape, world)
    x = x.contiguous()
    n = x.numel()
    if n == 0:
        return out
    w = world.world_size
    nbytes = n * x.element_size()
    if method == "auto":
        method = _auto_method(nbytes, w)
    xf, of = x.reshape(-1), out.view(-1)
    if method == "one_shot" and _ll_fits(nbytes, LL_MAX_BYTES, xf, of):
        _one_shot_ll(world, xf, of, nbytes // 4)
    elif method == "one_shot":
        programs, block, warps = _launch_shape(n, x.element_size(), x.device)
        slot_len = triton.cdiv(n, 16) * 16  # every slot starts 16-byte aligned
        ctx = _context(world, ("all_reduce", method, n), 2 * w * slot_len, x.dtype, programs, 1 + w)
        chunk = triton.cdiv(triton.cdiv(n, programs), block) * block  # whole blocks but the last
        vec = _vector_width(x.element_size(), xf, of, ctx.buffer)
        all_reduce_one_shot_kernel[(programs,)](xf, ctx.buffer, of, ctx.flags, world.heap.descriptor, n, chunk,
                                                slot_len, WORLD=w, BLOCK=block, VEC=vec, num_warps=warps)
    elif _ll_fits(nbytes, LL_TWO_SHOT_SYMMETRIC_MAX_BYTES if world.heap.contains(of) else LL_TWO_SHOT_MAX_BYTES,
                  xf, of):
        _two_shot_ll(world, xf, of, nbytes // 4)
    else:
        align = 16 // x.element_size()  # slices start 16-byte aligned; the last one is ragged (or empty)
        slice_len = triton.cdiv(triton.cdiv(n, w), align) * align
        _two_shot(world, xf, of, n, slice_len, gather=True)
    return out


def _ll_fits(nbytes: int, limit: int, xf: torch.Tensor, of: torch.Tensor) -> bool:
    """Whether the LL path may take it: at most `limit` bytes, and whole 4-byte words in and out."""
    return nbytes <= limit and nbytes % 4 == 0 and xf.data_ptr() % 4 == 0 and of.data_ptr() % 4 == 0


_ELEM = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _ll_launch(words: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, BLOCK words, num_warps) for an LL kernel whose programs share `words` words."""
    if device.type != "cuda":
        return min(4, triton.cdiv(words, 256)), 256, 4
    # Measured on 4 H200s (bf16, 2026-11-21): blocks of 256 words (4 warps), up to 128 programs:
    # 4.1 / 4.3 / 5.0 us at 4 / 16 / 64 KiB against 6.5 / 6.6 / 7.4 with 512-word blocks and
    # 4.6 / 4.9 / 5.4 for the push path; at 128 KiB both paths take 6.3 us, at 256 KiB LL loses.
    return min(128, triton.cdiv(words, 256)), 256, 4


def _one_shot_ll(world, xf, of, words):
    w = world.world_size
    programs, block, warps = _ll_launch(words, xf.device)
    chunk = triton.cdiv(triton.cdiv(words, programs), block) * block
    ctx = _context(world, ("all_reduce", "ll", words), 2 * w * words, torch.int64, programs, 1)
    all_reduce_ll_kernel[(programs,)](xf.view(torch.int32), ctx.buffer, of.view(torch.int32), ctx.flags,
                                      world.heap.descriptor, words, chunk, words, ELEM=_ELEM[xf.dtype], WORLD=w,
                                      BLOCK=block, num_warps=warps)


def _two_shot_ll(world, xf, of, words):
    w = world.world_size
    slice_len = triton.cdiv(words, w)
    programs, block, warps = _ll_launch(slice_len, xf.device)
    chunk = triton.cdiv(triton.cdiv(slice_len, programs), block) * block
    ctx = _context(world, ("all_reduce", "ll_two_shot", words), 4 * w * slice_len, torch.int64, programs, 1)
    all_reduce_ll_two_shot_kernel[(programs,)](xf.view(torch.int32), ctx.buffer, of.view(torch.int32), ctx.flags,
                                               world.heap.descriptor, words, slice_len, chunk, ELEM=_ELEM[xf.dtype],
                                               WORLD=w, BLOCK=block, num_warps=warps)


def _two_shot(world, xf, of, n, slice_len, gather):
    """Launch the two-shot kernel: all_reduce (gather) or reduce_scatter (not)."""
    w = world.world_size
    programs, block, warps = _launch_shape(slice_len, xf.element_size(), xf.device)
    # Into a symmetric `out` the reduced slices are pushed straight to every rank; else through `gathered`.
    copy_out = gather and not world.heap.contains(of)
    name = "all_reduce" if gather else "reduce_scatter"
    ctx = _context(world, (name, "two_shot", n, copy_out), 2 * w * slice_len, xf.dtype, programs, 1 + 2 * w,
                   gather_words=2 * w * slice_len if copy_out else 0)
    chunk = triton.cdiv(triton.cdiv(slice_len, programs), block) * block
    gathered = ctx.gathered if copy_out else of
    vec = _vector_width(xf.element_size(), xf, of, ctx.buffer, gathered)
    if slice_len % vec:
        vec = 1
    all_reduce_two_shot_kernel[(programs,)](xf, ctx.buffer, gathered, of, ctx.flags, world.heap.descriptor, n,
                                            slice_len, chunk, GATHER=gather, COPY_OUT=copy_out, WORLD=w,
                                            BLOCK=block, VEC=vec, num_warps=warps)


def reduce_scatter(x: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None) -> torch.Tensor:
    """Rank r gets the sum over ranks of rows [r * m, (r + 1) * m) of x, where x has W * m rows.

    Returns (m, *x.shape[1:]) with x's dtype (fp32 accumulation). `out` may be
    any tensor of that shape, including a row block of x itself (NCCL-style in
    place: out = x[r * m:(r + 1) * m]). Collective.
    """
    world = world_or_raise()
    check_tensor("x", x, world, dtypes=DTYPES, contiguous=False)
    _check_op(op)
    w = world.world_size
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if x.shape[0] % w:
        raise ValueError(f"x has {x.shape[0]} rows, not divisible by the world size {w}")
    shape = (x.shape[0] // w, *x.shape[1:])
    out = _prepare_out(x, out, shape, world, slice_bytes=max(1, x.numel() // w * x.element_size()))
    x = x.contiguous()
    n = x.numel()
    if n == 0:
        return out
    _two_shot(world, x.reshape(-1), out.view(-1), n, n // w, gather=False)
    return out


def broadcast(x: torch.Tensor, root: int = 0) -> torch.Tensor:
    """Copy rank `root`'s x into x on every rank, in place; returns x. Any dtype. Collective."""
    world = world_or_raise()
    check_tensor("x", x, world)
    try:
        index = operator.index(root) if not isinstance(root, bool) else None
    except TypeError:
        index = None
    if index is None or not 0 <= index < world.world_size:
        raise ValueError(f"root must be an int in [0, {world.world_size}), got {root!r}")
    root = int(index)
    if x.numel() == 0:
        return x
    xw = as_words(x)
    n = xw.numel()
    programs, block, warps = _launch_shape(n, xw.element_size(), x.device)
    ctx = _context(world, ("broadcast", n), n, xw.dtype, programs, 2 + world.world_size)
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
    vec = _vector_width(xw.element_size(), xw, ctx.buffer)
    broadcast_kernel[(programs,)](xw, ctx.buffer, ctx.flags, world.heap.descriptor, n, chunk, root, BLOCK=block,
                                  VEC=vec, num_warps=warps)
    return x


# Signatures for the sm_90 compile check (weft.testing.compile).
_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
COMPILE_CASES = [
    (all_reduce_one_shot_kernel, dict(x=t, recv=t, out=t, flags="*i32", heap="*i64", n="i32", chunk="i32",
                                      slot_len="i32"),
     dict(WORLD=wd, BLOCK=2048, VEC=v), dict(num_warps=8))
    for dt, t in _PTR.items() for wd in (2, 8) for v in (1, 16 // dt.itemsize)
] + [
    (all_reduce_two_shot_kernel, dict(x=t, recv=t, gathered=t, out=t, flags="*i32", heap="*i64", n="i32",
                                      slice_len="i32", chunk="i32"),
     dict(GATHER=g, COPY_OUT=c, WORLD=8, BLOCK=2048, VEC=v), dict(num_warps=8))
    for dt, t in _PTR.items() for g, c in ((True, True), (True, False), (False, False)) for v in (1, 16 // dt.itemsize)
] + [
    (all_reduce_ll_kernel, dict(x="*i32", ll="*i64", out="*i32", flags="*i32", heap="*i64", words="i32",
                                chunk="i32", slot_len="i32"),
     dict(ELEM=e, WORLD=wd, BLOCK=256), dict(num_warps=4))
    for e in (tl.float32, tl.bfloat16, tl.float16) for wd in (2, 8)
] + [
    (all_reduce_ll_two_shot_kernel, dict(x="*i32", ll="*i64", out="*i32", flags="*i32", heap="*i64", words="i32",
                                         slice_len="i32", chunk="i32"),
     dict(ELEM=e, WORLD=wd, BLOCK=256), dict(num_warps=4))
    for e in (tl.float32, tl.bfloat16, tl.float16) for wd in (2, 8)
] + [
    (broadcast_kernel, dict(x=t, stage=t, flags="*i32", heap="*i64", n="i32", chunk="i32", root="i32"),
     dict(BLOCK=2048, VEC=v), dict(num_warps=8))
    for t in ("*i32", "*i16", "*i8") for v in (1, 16 // {"*i32": 4, "*i16": 2, "*i8": 1}[t])
]
