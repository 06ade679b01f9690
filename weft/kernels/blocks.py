"""Device building blocks shared by the kernel families: vector-friendly copies, rounding (to bf16, to fp8 e4m3),
16-bit elements packed in int32 words (the LL paths), a grouped GEMM tile, the MoE routing check."""
import triton
import triton.language as tl

import weft.language as wl

from .gemm import dot


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
    """fp32 v (|v| <= 448) rounded to the nearest e4m3fn (ties to even), as int32 bits 0..255. By hand under
    the interpreter, whose fp8 conversion rounds some values to the wrong binade."""
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
        return ((bits >> 24) & 0x80) | tl.where(e < -6, sub, normal)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def fp8_quantize(v):
    """Rows v (R, 128) fp32 quantized to e4m3 as weft.ops.fp8_rows does: (int32 bits (R, 128), scales (R,)),
    scale = max(amax, 1e-4) / 448 and v / scale to nearest even, both divisions IEEE (div_rn: the bits of
    pointwise.fp8_rows_torch)."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-4)
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


@triton.jit
def group_tile(a, pairs, w, out, a_row0, out_row0, row0, rows, e, pm, pn, N, K,
               GATHER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               A_TMA: tl.constexpr = False, W_TMA: tl.constexpr = False):
    """One tile of a grouped GEMM: row block pm x column block pn of a segment of rows (rows [row0, row0 + rows),
    all of expert e): out[out_row0 + row, cols] = (A row) @ w[e][:, cols], fp32 accumulation rounded to
    out's dtype. A row: row a_row0 + pairs[row] // TOP_K of `a` (GATHER: a token
    picked by a (token, expert) pair index), else row a_row0 + row. a (·, K), w (E, K, N), out (·, N) row-major.
    Rows past the segment are not stored. Pipelined NUM_STAGES deep; EVEN_K / EVEN_N: K / N are whole blocks
    (no masks).

    W_TMA: w is a TMA descriptor of the weights as (E K, N), blocks (BLOCK_K, BLOCK_N) (K whole BLOCK_Ks, so a
    K block never reaches into w[e + 1]; columns past N read as zeros). A_TMA (not with GATHER): a is a TMA
    descriptor of a, blocks (BLOCK_M, BLOCK_K); the block's rows past the segment read the rows that follow
    (another segment's, or zeros past the end), which change only rows that are not stored. The TMA loads
    leave the pointer tensors of their operand out of the registers, where the accumulator needs them."""
    i = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    live = i < rows
    row = row0 + tl.where(live, i, 0)  # dead rows read the segment's first row: in bounds, never stored
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    if not A_TMA:
        if GATHER:
            src = a_row0 + tl.load(pairs + row) // TOP_K
        else:
            src = a_row0 + row
        a_ptrs = a + src.to(tl.int64)[:, None] * K + kk[None, :]
    if not W_TMA:
        b_ptrs = w + e.to(tl.int64) * K * N + kk[:, None] * N + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if A_TMA:
            x = a.load([a_row0 + row0 + pm * BLOCK_M, k0])
        else:
            if EVEN_K:
                x = tl.load(a_ptrs)
            else:
                x = tl.load(a_ptrs, mask=(k0 + kk)[None, :] < K, other=0.0)
            a_ptrs += BLOCK_K
        if W_TMA:
            b = w.load([e * K + k0, pn * BLOCK_N])
        else:
            if EVEN_K and EVEN_N:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=((k0 + kk)[:, None] < K) & (cols[None, :] < N), other=0.0)
            b_ptrs += BLOCK_K * N
        acc = dot(x, b, acc)
    dst = out + (out_row0 + row).to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(dst, cast(acc, out.dtype.element_ty), mask=live[:, None] & (cols[None, :] < N))


# -- the MoE routing check (moe's EP kernels, moe_tp's check kernel) ------------------------
# A bad topk_idx row (an expert named twice, or one outside [0, E) and not -1) is recorded in an error word
# that the host reads with no sync (moe.RoutingErrorWord, which decodes it into the ValueError).

ERROR_SET = tl.constexpr(1 << 62)  # marks a recorded error: word = ERROR_SET | row << 33 | kind << 32 | expert


@triton.jit
def valid_experts(raw, live, EXPERTS: tl.constexpr):
    """Entries of topk rows (any integer type) as int32 experts, -1 where none or outside [0, EXPERTS)."""
    raw = raw.to(tl.int64)
    return tl.where(live & (raw >= 0) & (raw < EXPERTS), raw, -1).to(tl.int32)


@triton.jit
def check_rows(raw, rows, err, live, EXPERTS: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile of topk rows (raw (R, BLOCK_K), row numbers `rows` (R,)) as valid_experts, and how many of its
    entries are bad; the tile's first bad row is recorded in the error word `err`, with its first entry
    outside [0, EXPERTS) (and not -1), else the expert it names twice. Any program or tile may record over
    another: one 8-byte store of the whole word, so the host reads one bad row whole."""
    e = valid_experts(raw, live, EXPERTS)
    jj = tl.arange(0, BLOCK_K)
    raw = raw.to(tl.int64)
    outside = live & ((raw < -1) | (raw >= EXPERTS))
    later = (e[:, :, None] == e[:, None, :]) & (jj[None, :, None] < jj[None, None, :]) & (e[:, :, None] >= 0)
    twice = tl.max(later.to(tl.int32), axis=2) > 0
    bad = tl.sum(tl.sum((outside | twice).to(tl.int32), axis=1), axis=0)
    if bad > 0:
        first_row = tl.min(tl.where(tl.max((outside | twice).to(tl.int32), axis=1) > 0, rows, 1 << 30), axis=0)
        here = (rows == first_row)[:, None]
        outside = outside & here
        first = tl.min(tl.min(tl.where(outside, jj[None, :], BLOCK_K), axis=1), axis=0)
        shown = tl.minimum(tl.maximum(raw, -(1 << 31)), (1 << 31) - 1)
        named_twice = tl.max(tl.max(tl.where(twice & here, e, -1), axis=1), axis=0).to(tl.int64)
        expert = tl.where(first < BLOCK_K,
                          tl.sum(tl.sum(tl.where(outside & (jj[None, :] == first), shown, 0), axis=1), axis=0),
                          named_twice)
        kind = (first < BLOCK_K).to(tl.int64)
        tl.store(err, ERROR_SET | (first_row.to(tl.int64) << 33) | (kind << 32) | (expert & 0xFFFFFFFF))
    return e, bad
