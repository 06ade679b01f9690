"""Device building blocks shared by the kernel families: vector-friendly copies and rounding."""
import triton
import triton.language as tl

import weft.language as wl


@triton.jit
def at(base, offs, VEC: tl.constexpr):
    """`base + offs`, with the host's promise (VEC > 1) that groups of VEC
    elements start 16-byte aligned, so accesses become 16-byte vectors. The
    hints attach to the op that computes the pointers: apply them here, not
    to a pointer received as an argument (there they are lost)."""
    ptrs = base + offs
    if VEC > 1:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), VEC)
    return ptrs


@triton.jit
def copy(dst, src, lo, hi, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """dst[i] = src[i] for i in [lo, hi). Whole blocks go unmasked (16-byte vectors when
    VEC > 1); the ragged tail is masked. `dst` may be a peer's memory (a push)."""
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(lo, full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(at(dst, offs, VEC), tl.load(at(src, offs, VEC)))
    offs = full + tl.arange(0, BLOCK)
    mask = offs < hi
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def cast(acc, dtype: tl.constexpr):
    """fp32 `acc` rounded to `dtype`, to nearest even. (Triton 3.6's interpreter
    truncates fp32 -> bf16; do the rounding by hand there, as the GPU does it.)"""
    if wl.INTERPRET:
        if dtype == tl.bfloat16:
            bits = acc.to(tl.int32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return acc.to(dtype)
