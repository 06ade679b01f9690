"""The reduction family through the symmetric heap: all_reduce (one-shot, two-shot), reduce_scatter, broadcast.

all_reduce:     out = sum over ranks r of x on rank r, on every rank.
reduce_scatter: out on rank r = sum over ranks of x[r * m : (r + 1) * m], x of (W * m, ...) rows.
broadcast:      x on every rank = x on rank `root` (in place).

Every op first copies its input into a symmetric staging buffer (`stage`; broadcast: the root only),
signals that it is there, and then reads peers' staging buffers directly
(NVLink loads on the GPU):

- one-shot all-reduce: every rank reads all W staging buffers whole and sums
  them. One synchronisation step, (W - 1) * n elements read per rank: the
  fastest for small messages, where latency dominates.
- two-shot all-reduce: a reduce-scatter (rank r sums slice r of every
  rank's staging buffer) followed by an all-gather (rank r writes its summed
  slice into slice r of every rank's staging buffer, which only rank r
  reads, so the buffer is reused; then each rank copies it out). Two steps,
  but only ~2 (W - 1) / W * n elements cross the links per rank: the faster
  one once bandwidth dominates.

Sums accumulate in fp32 in rank order 0, 1, ..., W - 1 on every rank, so
every rank gets the same bits and one-shot and two-shot agree bit for bit.

The elements are split into one part per program. Program p of every rank
handles part p only and waits only on program p of its peers, so programs
never wait on a later program of their own grid (the interpreter runs them
one after another). For two-shot and reduce_scatter, part p is sub-chunk p of
every rank's slice. Flags count epochs, kept on the device, so calls run back
to back and replay in CUDA graphs with no reset.

A staging buffer is never overwritten while a slow peer may still read the
previous call's data from it:
- one-shot double-buffers by epoch parity: a peer's `ready` for epoch e - 1
  (awaited during e - 1) says it finished epoch e - 2, the last reader of the
  half that epoch e overwrites. One synchronisation step per call, no more.
- two-shot needs nothing more: a rank leaves epoch e only after every peer's
  `arrived`, which each peer sends after its reads of epoch e.
- reduce_scatter and broadcast wait, before staging, for every peer's `done`
  of the previous epoch (broadcast: sent to every rank, as the root may change).

Per program slot the contexts keep int32 flags:
    one-shot:       [epoch, ready[W]]
    two-shot:       [epoch, ready[W], arrived[W]]
    reduce_scatter: [epoch, ready[W], done[W]]
    broadcast:      [epoch, ready, done[W]]
"""
from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

import weft.language as wl

from .common import as_words, check_method, check_out, check_tensor, no_capture_for_setup, world_or_raise

METHODS = ("auto", "one_shot", "two_shot")
OPS = ("sum",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# "auto" picks one_shot up to this many bytes at 8 ranks, two_shot above; with
# fewer ranks one-shot reads less, so the limit scales as 8 / W. Measured on
# 4 H200s (docs/perf.md, 2026-11-21): one_shot 15.5 / 21.7 / 31.9 us and
# two_shot 18.6 / 23.8 / 30.3 us at 512 KiB / 1 MiB / 2 MiB, so the switch sits
# at 1 MiB there, i.e. 512 KiB at 8 ranks (not yet measured on 8).
ONE_SHOT_MAX_BYTES_AT_8 = 512 << 10


# -- device helpers -------------------------------------------------------------

@triton.jit
def _at(base, offs, VEC: tl.constexpr):
    """`base + offs`, with the host's promise (VEC > 1) that groups of VEC
    elements start 16-byte aligned, so accesses become 16-byte vectors. The
    hints attach to the op that computes the pointers: apply them here, not
    to a pointer received as an argument (there they are lost)."""
    ptrs = base + offs
    if VEC > 1:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), VEC)
    return ptrs


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
def _copy(dst, src, lo, hi, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """dst[lo:hi] = src[lo:hi]. Whole blocks go unmasked (16-byte vectors when
    VEC > 1); the ragged tail is masked."""
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(_at(dst, offs, VEC), tl.load(_at(src, offs, VEC)))
    offs = full + tl.arange(0, BLOCK)
    mask = offs < hi
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _sum_peers(stage, offs, heap, mask, MASKED: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
               VEC: tl.constexpr):
    """fp32 sum over ranks 0..WORLD-1 of stage[offs] on that rank. The peer loop
    is unrolled, so all WORLD loads are in flight before the adds need them."""
    acc = tl.zeros([BLOCK], tl.float32)
    for q in tl.static_range(WORLD):
        if MASKED:
            v = tl.load(wl.symm_at(stage, q, heap) + offs, mask=mask, other=0.0)
        else:
            v = tl.load(_at(wl.symm_at(stage, q, heap), offs, VEC))
        acc += v.to(tl.float32)
    return acc


@triton.jit
def _reduce(dst, shift, stage, heap, lo, hi, PUSH: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
            VEC: tl.constexpr):
    """dst[i - shift] = sum over ranks of stage[i] for i in [lo, hi).

    With PUSH, `dst` is symmetric and the result goes to every rank's `dst`."""
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        val = _cast(_sum_peers(stage, offs, heap, None, False, WORLD, BLOCK, VEC), dst.dtype.element_ty)
        if PUSH:
            for q in tl.static_range(WORLD):
                tl.store(_at(wl.symm_at(dst, q, heap), offs - shift, VEC), val)
        else:
            tl.store(_at(dst, offs - shift, VEC), val)
    offs = full + tl.arange(0, BLOCK)
    mask = offs < hi
    val = _cast(_sum_peers(stage, offs, heap, mask, True, WORLD, BLOCK, VEC), dst.dtype.element_ty)
    if PUSH:
        for q in tl.static_range(WORLD):
            tl.store(wl.symm_at(dst, q, heap) + (offs - shift), val, mask=mask)
    else:
        tl.store(dst + (offs - shift), val, mask=mask)


@triton.jit
def _span(s, p, n, slice_len, chunk):
    """[lo, hi) of sub-chunk p of slice s (empty when past the end)."""
    lo = s * slice_len + p * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, (s + 1) * slice_len), n)
    return lo, tl.maximum(hi, lo)


# -- kernels --------------------------------------------------------------------

@triton.jit(do_not_specialize=["n", "chunk", "half"])
def all_reduce_one_shot_kernel(x, stage, out, flags, heap, n, chunk, half, WORLD: tl.constexpr,
                               BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Stage my part p in half (epoch % 2) of `stage`, then sum part p of every rank's into `out`.

    `stage` holds two halves of `half` elements: epoch e writes the half that
    epoch e - 2 used, whose readers all sent their `ready` of epoch e - 1 after
    reading it; that `ready` was awaited here during epoch e - 1.
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    f = flags + p * (1 + WORLD)
    ready = f + 1
    epoch = tl.load(f) + 1
    buf = stage + (epoch % 2) * half
    lo = p * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, n), lo)
    _copy(buf, x, lo, hi, BLOCK, VEC)
    for q in range(WORLD):
        wl.notify(ready + me, q, heap, epoch)
    token = wl.wait(ready, WORLD, epoch, wl.CMP_GE)
    _reduce(out, 0, wl.consume_token(buf, token), heap, lo, hi, False, WORLD, BLOCK, VEC)
    tl.store(f, epoch)


@triton.jit(do_not_specialize=["n", "slice_len", "chunk"])
def all_reduce_two_shot_kernel(x, stage, out, flags, heap, n, slice_len, chunk, GATHER: tl.constexpr,
                               WORLD: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Reduce-scatter, then (GATHER) all-gather, of sub-chunk p of every slice.

    Rank r owns slice r = [r * slice_len, (r + 1) * slice_len) of the n
    elements. Without GATHER (reduce_scatter) the sum of slice r goes to
    out[0:slice_len]; with GATHER (two-shot all-reduce) it is pushed into
    slice r of every rank's `stage` (read by nobody else but rank r), and
    every rank then copies its whole `stage` to `out`.

    Flags [epoch, ready[W], then arrived[W] (GATHER) or done[W]]. With
    GATHER, a peer's `arrived` comes after all its reads of the epoch, so
    `stage` is free when this program leaves it; without, peers report
    `done` and the next epoch waits for it before staging.
    """
    p = tl.program_id(0)
    me = wl.rank(heap)
    f = flags + p * (1 + 2 * WORLD)
    ready = f + 1
    arrived = f + 1 + WORLD
    done = f + 1 + WORLD
    epoch = tl.load(f) + 1
    if not GATHER:
        # Peers finished reading my stage in the previous epoch before I overwrite it.
        wl.wait(done, WORLD, epoch - 1, wl.CMP_GE)
    for s in range(WORLD):
        lo, hi = _span(s, p, n, slice_len, chunk)
        _copy(stage, x, lo, hi, BLOCK, VEC)
    for q in range(WORLD):
        wl.notify(ready + me, q, heap, epoch)
    token = wl.wait(ready, WORLD, epoch, wl.CMP_GE)
    src = wl.consume_token(stage, token)
    lo, hi = _span(me, p, n, slice_len, chunk)
    if GATHER:
        _reduce(src, 0, src, heap, lo, hi, True, WORLD, BLOCK, VEC)
        for q in range(WORLD):
            wl.notify(arrived + me, q, heap, epoch)
        token = wl.wait(arrived, WORLD, epoch, wl.CMP_GE)
        res = wl.consume_token(stage, token)
        for s in range(WORLD):
            lo, hi = _span(s, p, n, slice_len, chunk)
            _copy(out, res, lo, hi, BLOCK, VEC)
    else:
        _reduce(out, me * slice_len, src, heap, lo, hi, False, WORLD, BLOCK, VEC)
        for q in range(WORLD):
            wl.notify(done + me, q, heap, epoch)
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
        for q in range(world):
            wl.notify(ready, q, heap, epoch)
    else:
        token = wl.wait(ready, 1, epoch, wl.CMP_GE)
        src = wl.consume_token(wl.symm_at(stage, root, heap), token)
        _copy(x, src, lo, hi, BLOCK, VEC)
    for q in range(world):
        wl.notify(done + me, q, heap, epoch)
    tl.store(f, epoch)


# -- host side ------------------------------------------------------------------

def _launch_shape(n: int, element_size: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, BLOCK elements, num_warps) for `n` elements handled per rank and step."""
    if device.type != "cuda":
        return min(4, max(1, n * element_size // 4096)), 1024, 4
    # One 2048-element block per program, up to 64 programs; 256 from 4M elements per rank and step.
    # Measured on 4 H200s (docs/perf.md): with 64, two-shot reached only ~177 GB/s of bus bandwidth at
    # >= 16 MiB (NCCL ~340), too few loads in flight; 256 gave ~249 GB/s there but cost 10-50 % at 1-8 MiB,
    # where each extra program adds W signals. All 256 programs (8 warps each) fit on the GPU at once,
    # which the per-slot waits rely on.
    cap = 256 if n >= (1 << 22) else 64
    return max(1, min(cap, triton.cdiv(n, 2048))), 2048, 8


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
    """Symmetric staging buffer and epoch-counted flags for one (op, method, size, dtype, programs)."""

    def __init__(self, world, words: int, dtype: torch.dtype, programs: int, flags_per_program: int):
        heap = world.heap
        self.programs = programs
        self.stage = heap.empty((words,), dtype)
        self.flags = heap.empty((programs * flags_per_program,), torch.int32)
        self.flags.zero_()
        world.barrier()  # flags are zero everywhere before anyone signals


def _context(world, name: str, method: str, n: int, dtype: torch.dtype, programs: int, flags_per_program: int,
             words: int | None = None):
    """The context for `n` elements (staging buffer of `words`, default n), created on first use."""
    key = (name, method, n, dtype, programs)
    if key not in world.contexts:
        no_capture_for_setup(f"weft.ops.{name}")
    return world.context(key, lambda: ReduceContext(world, n if words is None else words, dtype, programs,
                                                    flags_per_program))


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
    heap = world.heap.descriptor
    if method == "one_shot":
        programs, block, warps = _launch_shape(n, x.element_size(), x.device)
        half = triton.cdiv(n, 16) * 16  # each half of the double buffer starts 16-byte aligned
        ctx = _context(world, "all_reduce", method, n, x.dtype, programs, 1 + w, words=2 * half)
        chunk = triton.cdiv(triton.cdiv(n, programs), block) * block  # whole blocks but the last
        vec = _vector_width(x.element_size(), xf, of, ctx.stage)
        all_reduce_one_shot_kernel[(programs,)](xf, ctx.stage, of, ctx.flags, heap, n, chunk, half, WORLD=w,
                                                BLOCK=block, VEC=vec, num_warps=warps)
    else:
        align = 16 // x.element_size()  # slices start 16-byte aligned; the last one is ragged (or empty)
        slice_len = triton.cdiv(triton.cdiv(n, w), align) * align
        _two_shot(world, "all_reduce", method, xf, of, n, slice_len, True)
    return out


def _two_shot(world, name, method, xf, of, n, slice_len, gather):
    w = world.world_size
    programs, block, warps = _launch_shape(slice_len, xf.element_size(), xf.device)
    ctx = _context(world, name, method, n, xf.dtype, programs, 1 + 2 * w)
    chunk = triton.cdiv(triton.cdiv(slice_len, programs), block) * block
    vec = _vector_width(xf.element_size(), xf, of, ctx.stage)
    if slice_len % vec:
        vec = 1
    all_reduce_two_shot_kernel[(programs,)](xf, ctx.stage, of, ctx.flags, world.heap.descriptor, n, slice_len, chunk,
                                            GATHER=gather, WORLD=w, BLOCK=block, VEC=vec, num_warps=warps)


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
    _two_shot(world, "reduce_scatter", "pull", x.reshape(-1), out.view(-1), n, n // w, False)
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
    ctx = _context(world, "broadcast", "pull", n, xw.dtype, programs, 2 + world.world_size)
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
    vec = _vector_width(xw.element_size(), xw, ctx.stage)
    broadcast_kernel[(programs,)](xw, ctx.stage, ctx.flags, world.heap.descriptor, n, chunk, root, BLOCK=block,
                                  VEC=vec, num_warps=warps)
    return x


# Signatures for the sm_90 compile check (weft.testing.compile).
_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
COMPILE_CASES = [
    (all_reduce_one_shot_kernel, dict(x=t, stage=t, out=t, flags="*i32", heap="*i64", n="i32", chunk="i32",
                                      half="i32"),
     dict(WORLD=wd, BLOCK=2048, VEC=v))
    for dt, t in _PTR.items() for wd in (2, 8) for v in (1, 16 // dt.itemsize)
] + [
    (all_reduce_two_shot_kernel, dict(x=t, stage=t, out=t, flags="*i32", heap="*i64", n="i32", slice_len="i32",
                                      chunk="i32"), dict(GATHER=g, WORLD=8, BLOCK=2048, VEC=v))
    for dt, t in _PTR.items() for g in (True, False) for v in (1, 16 // dt.itemsize)
] + [
    (broadcast_kernel, dict(x=t, stage=t, flags="*i32", heap="*i64", n="i32", chunk="i32", root="i32"),
     dict(BLOCK=2048, VEC=v))
    for t in ("*i32", "*i16", "*i8") for v in (1, 16 // {"*i32": 4, "*i16": 2, "*i8": 1}[t])
]
