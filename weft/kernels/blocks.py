"""Device building blocks shared by the kernel families: vector-friendly copies, rounding (to bf16, to fp8 e4m3),
16-bit elements packed in int32 words (the LL paths), a persistent grid's work items."""
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


@triton.jit
def e4m3_bits(v):
    """fp32 v (|v| <= 448, or NaN: 0x7F, as the GPU's conversion gives) rounded to the nearest e4m3fn (ties to
    even), as int32 bits 0..255. By hand under the interpreter, whose fp8 conversion rounds some values to the
    wrong binade."""
    if wl.INTERPRET:
        bits = v.to(tl.int32, bitcast=True)
        a = tl.abs(v)
        e = (a.to(tl.int32, bitcast=True) >> 23) - 127
        m = a.to(tl.int32, bitcast=True) & 0x7FFFFF
        keep = m >> 20
        rem = m & 0xFFFFF
        up = (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))
        normal = ((e + 7) << 3) + keep + up.to(tl.int32)
        s = a * 512.0  # below 2^-6: whole units of 2^-9
        fl = tl.floor(s)
        fi = fl.to(tl.int32)
        sub = fi + (((s - fl) > 0.5) | (((s - fl) == 0.5) & ((fi & 1) == 1))).to(tl.int32)
        return tl.where(v != v, 0x7F, ((bits >> 24) & 0x80) | tl.where(e < -6, sub, normal))
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def fp8_quantize(v):
    """Rows v (R, 128) fp32 quantized to e4m3 as weft.ops.fp8_rows does: (int32 bits (R, 128), scales (R,)),
    scale = max(amax, 1e-4) / 448 and v / scale to nearest even, both divisions IEEE (div_rn: the bits of
    pointwise.fp8_rows_torch). A row holding NaN gets scale NaN, so all NaN, as torch's amax propagates it (the
    max reduction here drops NaN); a row holding inf gets scale inf: 0 but NaN where the inf was, as torch."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-4)
    amax = tl.where(tl.max((v != v).to(tl.int32), axis=1) > 0, float("nan"), amax)
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0)
    return e4m3_bits(tl.math.div_rn(v, scale[:, None])), scale


@triton.jit
def first_item(base, NUM_PROGRAMS: tl.constexpr):
    """This program's first work item from `base` on, in a persistent grid that deals items round-robin
    (item i to program i % NUM_PROGRAMS); its next ones follow NUM_PROGRAMS apart."""
    return base + (tl.program_id(0) - base % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS


@triton.jit
def halves_of(words, ELEM: tl.constexpr):
    """The two 16-bit elements packed in each int32 word (little-endian: element 2j low), as fp32; for an fp32
    ELEM the word's one element and zeros."""
    if ELEM == tl.float32:
        lo = words.to(tl.float32, bitcast=True)
        hi = tl.zeros_like(lo)
    else:
        lo = (words & 0xFFFF).to(tl.int16).to(ELEM, bitcast=True).to(tl.float32)
        hi = ((words >> 16) & 0xFFFF).to(tl.int16).to(ELEM, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def word_of(lo, hi, ELEM: tl.constexpr):
    """fp32 `lo`, `hi` rounded to ELEM and packed back into one int32 word (halves_of's inverse: for an fp32 ELEM,
    `lo` alone)."""
    if ELEM == tl.float32:
        word = lo.to(tl.int32, bitcast=True)
    else:
        lo_bits = cast(lo, ELEM).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi_bits = cast(hi, ELEM).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        word = lo_bits | (hi_bits << 16)
    return word
