"""All-gather through the symmetric heap: push (write into peers) and pull (read from peers).

out[r * n : (r + 1) * n] = x on rank r, for every rank r.

The shard is split into one slice per program. Program p of every rank
handles slice p only and waits only on program p of its peers, so programs
never wait on a later program of their own grid (the interpreter runs them
one after another). Flags count epochs, kept on the device, so calls run
back to back and replay in CUDA graphs with no reset.

Per program slot the context keeps 1 + 2W int32 flags:
    [epoch, ready[W], arrived/done[W]]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import weft.language as wl

from .common import as_words, check_method, check_out, check_tensor, world_or_raise

METHODS = ("auto", "push", "pull")


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
def _copy(dst, src, lo, hi, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """dst[i] = src[i] for i in [lo, hi). Whole blocks go unmasked (16-byte vectors when
    VEC > 1); the ragged tail is masked. `dst` may be a peer's memory (a push)."""
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(_at(dst, offs, VEC), tl.load(_at(src, offs, VEC)))
    offs = full + tl.arange(0, BLOCK)
    mask = offs < hi
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["n", "chunk"])
def all_gather_push_kernel(x, gathered, out, flags, heap, n, chunk, COPY_OUT: tl.constexpr, BLOCK: tl.constexpr,
                           VEC: tl.constexpr):
    """Program (p, i) pairs me with rank q = (i - me) mod W, and q's program (p, i) pairs back
    with me: it pushes my slice p into q's buffer and waits for q's slice p to arrive in mine.
    All peers are served in parallel, one program each, so a small gather costs one round trip.

    COPY_OUT: `gathered` is the context's double buffer (by epoch parity) and the slice is
    copied to `out` afterwards. q last read the buffer half we write two epochs ago, and its
    arrival in the previous epoch proves it finished that read, so no handshake is needed.
    Otherwise `gathered` is the caller's symmetric output, which q may still be reading:
    wait until q says it is free ("ready") before writing.
    """
    p = tl.program_id(0)
    i = tl.program_id(1)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    q = (i - me + world) % world
    f = flags + (p * world + i) * 3  # [epoch, ready from q, arrived from q]
    epoch = tl.load(f) + 1
    lo = p * chunk
    hi = tl.minimum(lo + chunk, n)
    buf = gathered
    if COPY_OUT:
        buf = gathered + (epoch % 2) * world * n
    else:
        wl.notify(f + 1, q, heap, epoch)
        token = wl.wait(f + 1, 1, epoch, wl.CMP_GE)
        buf = wl.consume_token(buf, token)
    _copy(wl.symm_at(buf, q, heap) + me * n, x, lo, hi, BLOCK, VEC)
    wl.notify(f + 2, q, heap, epoch)
    token = wl.wait(f + 2, 1, epoch, wl.CMP_GE)
    if COPY_OUT:
        _copy(out + q * n, wl.consume_token(buf, token) + q * n, lo, hi, BLOCK, VEC)
    tl.store(f, epoch)


@triton.jit(do_not_specialize=["n", "chunk"])
def all_gather_pull_kernel(x, stage, out, flags, heap, n, chunk, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Publish my slice in `stage` (symmetric), then read every rank's slice into `out`."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    f = flags + p * (1 + 2 * world)
    ready = f + 1
    done = f + 1 + world
    epoch = tl.load(f) + 1
    lo = p * chunk
    hi = tl.minimum(lo + chunk, n)
    # Peers finished reading the previous epoch's slice before I overwrite it.
    wl.wait(done, world, epoch - 1, wl.CMP_GE)
    _copy(stage, x, lo, hi, BLOCK, VEC)
    wl.notify_all(ready + me, heap, epoch)
    for i in range(world):
        q = (me + 1 + p + i) % world
        token = wl.wait(ready + q, 1, epoch, wl.CMP_GE)
        src = wl.consume_token(wl.symm_at(stage, q, heap), token)
        _copy(out + q * n, src, lo, hi, BLOCK, VEC)
        wl.notify(done + me, q, heap, epoch)
    tl.store(f, epoch)


def _launch_shape(method: str, nbytes: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, BLOCK words, num_warps) for a shard of `nbytes`: grid rows of pull, or of push
    (which has one column per peer)."""
    if device.type != "cuda":
        return min(4, max(1, nbytes // 4096)), 1024, 4
    if method == "push":
        return max(1, min(16, nbytes // (256 << 10))), 2048, 8
    return max(1, min(64, nbytes // (64 << 10))), 2048, 8


def _vector_width(n: int, *tensors: torch.Tensor) -> int:
    """Words per 16-byte access if every slice boundary and base is 16-byte aligned, else 1."""
    words = 16 // tensors[0].element_size()
    aligned = n % words == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
    return words if aligned else 1


class AllGatherContext:
    """Symmetric workspace and flags for one (method, shard size, dtype, output kind)."""

    def __init__(self, world, method: str, shard_words: int, word_dtype: torch.dtype, programs: int,
                 symmetric_out: bool):
        heap, w = world.heap, world.world_size
        self.method, self.programs = method, programs
        if method == "push":
            # Into a symmetric out the peers push straight into it; else into two halves, by epoch parity.
            self.buffer = None if symmetric_out else heap.empty((2 * w * shard_words,), word_dtype)
            self.flags = heap.empty((programs * w * 3,), torch.int32)
        else:
            self.buffer = heap.empty((shard_words,), word_dtype)
            self.flags = heap.empty((programs * (1 + 2 * w),), torch.int32)
        self.flags.zero_()
        world.barrier()  # flags are zero everywhere before anyone signals


def all_gather(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto") -> torch.Tensor:
    """Gather `x` from every rank along dim 0: returns (world_size * x.shape[0], *x.shape[1:]).

    method: "push" writes into peers' symmetric buffers (zero-copy when `out`
    is itself symmetric, from `weft.empty`; otherwise through a double buffer
    and a local copy); "pull" reads peers' slices straight into `out`, which
    may be any tensor; "auto" is push, the faster at every measured size.
    """
    world = world_or_raise()
    check_tensor("x", x, world, contiguous=False)
    check_method(method, METHODS)
    x = x.contiguous()
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    w = world.world_size
    shape = (w * x.shape[0], *x.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        check_out(out, shape, x.dtype, world)
    if x.numel() == 0:
        return out
    symmetric_out = world.heap.contains(out)
    if method == "auto":
        # Measured on 8x H200 (docs/perf.md, 2026-11-21): push is ahead of pull at every size,
        # with or without a symmetric output.
        method = "push"
    xw, ow = as_words(x), as_words(out)
    if xw.dtype != ow.dtype:  # alignment differs: move bytes
        xw, ow = x.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
    n = xw.numel()
    programs, block, warps = _launch_shape(method, n * xw.element_size(), x.device)
    zero_copy = method == "push" and symmetric_out
    key = ("all_gather", method, n, xw.dtype, programs, zero_copy)
    ctx = world.context(key, lambda: AllGatherContext(world, method, n, xw.dtype, programs, zero_copy))
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block  # whole blocks but the last
    vec = _vector_width(n, xw, ow, *([] if zero_copy else [ctx.buffer]))
    heap = world.heap.descriptor
    if method == "push":
        if zero_copy:
            # Every rank's `out` sits at the same offset: push straight into it.
            all_gather_push_kernel[(programs, w)](xw, ow, ow, ctx.flags, heap, n, chunk, COPY_OUT=False,
                                                BLOCK=block, VEC=vec, num_warps=warps)
        else:
            all_gather_push_kernel[(programs, w)](xw, ctx.buffer, ow, ctx.flags, heap, n, chunk, COPY_OUT=True,
                                                BLOCK=block, VEC=vec, num_warps=warps)
    else:
        all_gather_pull_kernel[(programs,)](xw, ctx.buffer, ow, ctx.flags, heap, n, chunk, BLOCK=block, VEC=vec,
                                            num_warps=warps)
    return out


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    (all_gather_push_kernel, dict(x="*i32", gathered="*i32", out="*i32", flags="*i32", heap="*i64", n="i32",
                                  chunk="i32"), dict(COPY_OUT=c, BLOCK=2048, VEC=v))
    for c in (False, True) for v in (1, 4)
] + [
    (all_gather_pull_kernel, dict(x="*i32", stage="*i32", out="*i32", flags="*i32", heap="*i64", n="i32",
                                  chunk="i32"), dict(BLOCK=2048, VEC=v)) for v in (1, 4)
]
