"""A decode step's GEMVs with the pointwise work around them fused in: one kernel where the layers path runs two
to four (weft/models/decoder.py's WEFT_DECODE=fused path, a few tokens per step).

- norm_qkv_rope(x, norm_weight, qkv_weight, ...): RMSNorm of x (prologue), the fused QKV projection, and per head
  (a program owns whole heads) Qwen3's q/k RMSNorm, the rotary embedding and the KV-cache write (epilogue): q out,
  k and v straight into their cache slots;
- linear_residual(x, weight, residual): residual + x @ weight (the O and down projections at one rank);
- norm_gate_up_silu(x, norm_weight, gate_up_weight, eps): RMSNorm of x, the fused [gate | up] projection, and
  silu(gate) * up, a program computing matching gate and up columns.

Weights are (K, N): contiguous, as the layers keep them, or the transpose of a contiguous (N, K) tensor (an
nn.Linear weight's .t(), K contiguous: LAYOUTS' "nk", a constexpr of each kernel, `_weight_at`; settings of their
own). The kernels are memory-bound GEMVs for M = 1..16 rows
(tokens): a program streams a [K range, its columns] slab of the weight once (evict-first: it is read once) through
`tl.range`'s pipelined loads, two runs of columns a program, and multiplies it by the few rows in one of two ways, a
launch setting: tl.dot (rows padded to 16, the weight tile in the dot's operand layout), or dot-free (`dot` false):
fp32 FMAs of the real rows into [rows, K block, columns] accumulators in registers, summed over the K block once
after the loop, so nothing but the loads touches the weight (compute is free here either way). A 4096-wide
projection has too few column tiles for the programs the GPU holds, so K is split as well (the grid is tiles x
splits x row blocks, at most programs_per_sm per SM, or the split that spreads the work most evenly over the SMs
where that one leaves some idle: `balanced_split`): each split stores its fp32 partial sums to a workspace and
counts itself done on the tile's counter; the split that counts last sums the partials in split order
(deterministic, no float atomics; their loads in unrolled groups of splits, in flight together) and runs the
epilogue (then zeroes the counter for the next call, so a CUDA graph replays it). The RMSNorm prologue is folded
into the GEMV: norm(x) @ W = diag(1 / rms(x)) ((x g) @ W) for the norm's weight g, so a program multiplies x g by
its slab and the epilogue applies 1 / rms. The sum of squares behind rms comes from the x blocks the main loop loads
anyway: each split adds up x² over its K range in fp32 and stores it beside its partials (one float a row), and the
last split adds the splits' shares in split order, so the tail does not walk x's rows again after the partials.

Roundings follow the layers path where the fusion allows: the projection's output is rounded to the dtype before
the epilogue's norm, rotary, SiLU and residual add, which round as the pointwise kernels do (pointwise.py); the
prologue rounds x g, not (x / rms) g, before the GEMV (a last-bit difference in the projection's inputs).

Each kernel is a thin wrapper of its program body (`_qkv_program`, `_linear_residual_program`, `_gate_up_program`),
which takes its program ids as arguments: decode_step.py's persistent kernel runs the same bodies as its tasks. So
the bodies read what another program of a launch may have written (x, the residual, the partials) past L1
(.cg): in the persistent kernel the same buffers are rewritten every layer, and an SM's L1 may hold an old line.

Launch settings (columns per run, K block, stages, warps, programs per SM, tl.dot or not) come from weft.tuning's
decode.gemv, per projection (qkv, o, gate_up, down), weight shape and row range where the sweep found them to differ
(`resolve`), and the largest M the decode path takes these kernels at from decode.fused_max_m, per tensor-parallel
size (`tuning.by_size`; the layers' cuBLAS GEMMs above). A QKV program owns whole heads (its epilogue needs them):
block_n // (head_dim / 2) of them, a power of two that divides both head counts.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning
from .blocks import cast
from .common import Launch, Plan, group_name, plan, signature, workspace, world_or_raise
from .common import resolve as resolve_group
from .gemm import num_sms
from .gemm_ar import GemmArWorkspace, gemm_ar
from .pointwise import _check, _rotate
from .registry import declare_op

# Rows a program takes at most (more rows: more row blocks); tl.dot needs 16 at least.
MAX_BLOCK_M = 64
MIN_BLOCK = 16
# Rows the dot-free path takes at most (its accumulators are rows x K block x columns).
FMA_MAX_BLOCK_M = 16
# Launch settings (weft.tuning's decode.gemv; `resolve`): columns per run (a program takes two runs), K block,
# warps, pipeline stages, programs per SM the split-K aims at, tl.dot or dot-free.
FIELDS = ("block_n", "block_k", "num_warps", "num_stages", "programs_per_sm", "dot")
# The projections the settings are chosen for: linear_residual is "down" where K > N (the MLP's down projection),
# else "o".
OPS = ("qkv", "o", "gate_up", "down")
RANGES = ("few", "many")
# How a (K, N) weight is stored: "kn" N contiguous (weft's layout), "nk" K contiguous ((N, K): nn.Linear's layout;
# the op is given its transpose). Settings keys for "nk" weights carry it as a scope part; "kn" is the default.
LAYOUTS = ("kn", "nk")
# Under the interpreter (cpu): small blocks and 4 programs per "SM" (num_sms is 2 there), so that the tests'
# small shapes take the split-K path as well as the direct one; dot-free at few rows, tl.dot above.
CPU_SETTINGS = {"block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 1, "programs_per_sm": 4, "dot": True,
                "few_max_m": 4, "few.dot": False}
# The last split loads the splits' partials a few splits at once (an unrolled group of loads in flight together,
# not one L2 round trip per split): as many as this many fp32 elements (32 registers a thread at 4 warps) hold.
PARTIAL_ELEMENTS = 4096
# The tl.dot path adds x² elementwise (one reduction after the loop) where x's block holds at most this many
# elements (8 fp32 registers a thread at 4 warps), else reduces each block (_gemv_pair_dot). At 16 x 128 the
# elementwise form took the sm_90 compile from 158-168 registers to 198-207 (norm_gate_up_silu, norm_qkv_rope).
SUMSQ_ELEMENTS = tl.constexpr(1024)


# -- device helpers -------------------------------------------------------------

@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; fp32 operands in IEEE fp32 (not TF32). (Triton 3.6's interpreter gets bf16 dots wrong: on the
    cpu backend, multiply in fp32.)"""
    if wl.INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _weight_at(w, k, cols, K, N, K_MAJOR: tl.constexpr):
    """Where the (K, N) weight's elements (k, cols) lie (broadcast together): row k at w + k N, N contiguous
    (weft's layout), or, K_MAJOR, column n at w + n K, K contiguous ((N, K) stored, nn.Linear's layout)."""
    if K_MAJOR:
        return w + cols.to(tl.int64) * K + k
    return w + k.to(tl.int64) * N + cols


@triton.jit
def _gemv_pair(x, w, norm_w, m, m_mask, K, N, cols_a, cols_b, col_mask_a, col_mask_b, k_first, k_blocks,
               NORM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
               DOT: tl.constexpr, K_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """(x[m, K range] @ w[K range, cols_a], ... @ w[K range, cols_b]) in fp32, [BLOCK_M, BLOCK_N] each, the K range
    k_blocks blocks of BLOCK_K from k_first; NORM: x's columns times norm_w (rounded to x's dtype) first, and the
    third result is sum(x[m, K range]²) (fp32, [BLOCK_M]: the RMSNorm's share of this K range, from the x blocks
    the loop loads anyway; zeros without NORM). The (K, N) weight's rows are contiguous along the columns (each
    [BLOCK_K, BLOCK_N] tile BLOCK_K contiguous runs), or, K_MAJOR, its columns are contiguous along K (stored
    (N, K), nn.Linear's layout: a tile is BLOCK_N runs of BLOCK_K); tiles pipelined STAGES deep and loaded
    evict-first (read once). DOT: tl.dot (rows padded to 16); else dot-free (module doc)."""
    if DOT:
        acc_a, acc_b, sumsq = _gemv_pair_dot(x, w, norm_w, m, m_mask, K, N, cols_a, cols_b, col_mask_a,
                                             col_mask_b, k_first, k_blocks, NORM, EVEN_K, EVEN_N, IEEE, K_MAJOR,
                                             BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    else:
        acc_a, acc_b, sumsq = _gemv_pair_fma(x, w, norm_w, m, m_mask, K, N, cols_a, cols_b, col_mask_a,
                                             col_mask_b, k_first, k_blocks, NORM, EVEN_K, EVEN_N, K_MAJOR, BLOCK_M,
                                             BLOCK_N, BLOCK_K, STAGES)
    return acc_a, acc_b, sumsq


@triton.jit
def _gemv_pair_dot(x, w, norm_w, m, m_mask, K, N, cols_a, cols_b, col_mask_a, col_mask_b, k_first, k_blocks,
                   NORM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
                   K_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   STAGES: tl.constexpr):
    """_gemv_pair with tl.dot: x's [BLOCK_M >= 16, BLOCK_K] block times each weight tile. The sum of squares is
    added elementwise and reduced once after the loop where the x block is small (at most SUMSQ_ELEMENTS: the
    QKV projection's 16 x 32 blocks at 8 rows took 18.6 µs a call against 19.1 reducing every block, 1x H200) and
    for IEEE fp32 operands (the FMA dot: the per-block reduction put ptxas into its 32-register mode at 64 rows,
    with ~40 KB of stack); larger 16-bit blocks reduce x² a block at a time (an elementwise accumulator costs ~30
    registers at 16 rows of 128)."""
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    kk = tl.arange(0, BLOCK_K)
    x_rows = x + m[:, None].to(tl.int64) * K
    for i in tl.range(0, k_blocks, num_stages=STAGES):
        k = k_first + i * BLOCK_K + kk
        at_a = _weight_at(w, k[:, None], cols_a[None, :], K, N, K_MAJOR)
        at_b = _weight_at(w, k[:, None], cols_b[None, :], K, N, K_MAJOR)
        if EVEN_K:
            a = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
            if EVEN_N:
                wa = tl.load(at_a, eviction_policy="evict_first")
                wb = tl.load(at_b, eviction_policy="evict_first")
            else:
                wa = tl.load(at_a, mask=col_mask_a[None, :], other=0.0, eviction_policy="evict_first")
                wb = tl.load(at_b, mask=col_mask_b[None, :], other=0.0, eviction_policy="evict_first")
        else:
            k_mask = k < K
            a = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0,
                        cache_modifier=".cg")
            wa = tl.load(at_a, mask=k_mask[:, None] & col_mask_a[None, :], other=0.0, eviction_policy="evict_first")
            wb = tl.load(at_b, mask=k_mask[:, None] & col_mask_b[None, :], other=0.0, eviction_policy="evict_first")
        if NORM:
            if EVEN_K:
                g = tl.load(norm_w + k)
            else:
                g = tl.load(norm_w + k, mask=k < K, other=0.0)
            xf = a.to(tl.float32)
            a = cast(xf * g.to(tl.float32)[None, :], w.dtype.element_ty)
        acc_a = _dot(a, wa, acc_a, IEEE)
        acc_b = _dot(a, wb, acc_b, IEEE)
        if NORM:
            if IEEE or BLOCK_M * BLOCK_K <= SUMSQ_ELEMENTS:
                sq += xf * xf
            else:
                sumsq += tl.sum(xf * xf, axis=1)
    if IEEE or BLOCK_M * BLOCK_K <= SUMSQ_ELEMENTS:
        sumsq = tl.sum(sq, axis=1)
    return acc_a, acc_b, sumsq


@triton.jit
def _gemv_pair_fma(x, w, norm_w, m, m_mask, K, N, cols_a, cols_b, col_mask_a, col_mask_b, k_first, k_blocks,
                   NORM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, K_MAJOR: tl.constexpr,
                   BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """_gemv_pair without tl.dot: acc[m, k, n] += x[m, k] w[k, n] in fp32 registers (every operand built in the
    accumulators' 3D layout, so no layout change in the loop), summed over k once after it; x² likewise."""
    acc_a = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K, 1], tl.float32)
    kk = tl.arange(0, BLOCK_K)[None, :, None]
    x_rows = x + m[:, None, None].to(tl.int64) * K
    row_mask = m_mask[:, None, None]
    ca, cb = cols_a[None, None, :], cols_b[None, None, :]
    mask_a, mask_b = col_mask_a[None, None, :], col_mask_b[None, None, :]
    for i in tl.range(0, k_blocks, num_stages=STAGES):
        k = k_first + i * BLOCK_K + kk
        at_a = _weight_at(w, k, ca, K, N, K_MAJOR)
        at_b = _weight_at(w, k, cb, K, N, K_MAJOR)
        if EVEN_K:
            a = tl.load(x_rows + k, mask=row_mask, other=0.0, cache_modifier=".cg")
            if EVEN_N:
                wa = tl.load(at_a, eviction_policy="evict_first")
                wb = tl.load(at_b, eviction_policy="evict_first")
            else:
                wa = tl.load(at_a, mask=mask_a, other=0.0, eviction_policy="evict_first")
                wb = tl.load(at_b, mask=mask_b, other=0.0, eviction_policy="evict_first")
        else:
            k_mask = k < K
            a = tl.load(x_rows + k, mask=row_mask & k_mask, other=0.0, cache_modifier=".cg")
            wa = tl.load(at_a, mask=k_mask & mask_a, other=0.0, eviction_policy="evict_first")
            wb = tl.load(at_b, mask=k_mask & mask_b, other=0.0, eviction_policy="evict_first")
        a = a.to(tl.float32)
        if NORM:
            if EVEN_K:
                g = tl.load(norm_w + k)
            else:
                g = tl.load(norm_w + k, mask=k < K, other=0.0)
            sq += a * a
            # Rounded to the dtype as the dot path's operand is (the same product of x g and w).
            a = cast(a * g.to(tl.float32), w.dtype.element_ty).to(tl.float32)
        acc_a += a * wa.to(tl.float32)
        acc_b += a * wb.to(tl.float32)
    return tl.sum(acc_a, axis=1), tl.sum(acc_b, axis=1), tl.reshape(tl.sum(sq, axis=1), [BLOCK_M])


@triton.jit
def _store_partials(acc_a, acc_b, partial, row0, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, N,
                    BLOCK_M: tl.constexpr):
    """This split's fp32 sums into its slab of the workspace: rows [row0, +BLOCK_M) of partial (.., N), the valid
    rows only (M = 1 would otherwise write 16 rows)."""
    r = (row0 + tl.arange(0, BLOCK_M))[:, None].to(tl.int64) * N
    tl.store(partial + r + cols_a[None, :], acc_a, mask=m_mask[:, None] & col_mask_a[None, :])
    tl.store(partial + r + cols_b[None, :], acc_b, mask=m_mask[:, None] & col_mask_b[None, :])


@triton.jit
def _sum_partials(partial, slab0, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, N, SPLIT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The sums of every split's slab (slabs slab0 .. slab0 + SPLIT - 1, BLOCK_M rows each, the valid ones read),
    read past L1 (other programs wrote them), added in split order. The loads go in groups of GROUP splits
    (unrolled: independent of each other, in flight together), as many as PARTIAL_ELEMENTS hold."""
    GROUP: tl.constexpr = _splits_at_once(SPLIT, 2 * BLOCK_M * BLOCK_N)
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    rr = tl.arange(0, BLOCK_M)[:, None]
    mask_a = m_mask[:, None] & col_mask_a[None, :]
    mask_b = m_mask[:, None] & col_mask_b[None, :]
    for s0 in range(0, SPLIT, GROUP):
        for i in tl.static_range(GROUP):
            r = ((slab0 + s0 + i) * BLOCK_M + rr).to(tl.int64) * N
            there = s0 + i < SPLIT  # a last group past SPLIT adds zeros
            acc_a += tl.load(partial + r + cols_a[None, :], mask=mask_a & there, other=0.0, cache_modifier=".cg")
            acc_b += tl.load(partial + r + cols_b[None, :], mask=mask_b & there, other=0.0, cache_modifier=".cg")
    return acc_a, acc_b


@triton.constexpr_function
def _splits_at_once(split, elements):
    """Splits whose partials (`elements` fp32 each) the last split loads at once: PARTIAL_ELEMENTS' worth, 1 to
    SPLIT."""
    return max(1, min(split, PARTIAL_ELEMENTS // elements))


@triton.jit
def _sumsq_slots(partial, N, tile, mb, tiles, m_blocks, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Where the splits' sums of squares of x's rows go: past the partial sums of every row block's slabs, one
    float per row, split and tile ((m_blocks, tiles, SPLIT, BLOCK_M); the slots of tile `tile` of row block mb
    first)."""
    slots = partial + tl.cast(m_blocks, tl.int64) * SPLIT * BLOCK_M * N
    return slots + (mb * tiles + tile) * SPLIT * BLOCK_M


@triton.jit
def _store_sumsq(sumsq, slots, split, m_mask, BLOCK_M: tl.constexpr):
    """This split's sums of squares into its slots (before _split_done: its release covers them)."""
    tl.store(slots + split * BLOCK_M + tl.arange(0, BLOCK_M), sumsq, mask=m_mask)


@triton.jit
def _sum_sumsq(slots, m_mask, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows' sums of squares over all of K: the splits' shares, read past L1 and added in split order
    (deterministic), loaded in groups as _sum_partials' are."""
    GROUP: tl.constexpr = _splits_at_once(SPLIT, BLOCK_M)
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    r = tl.arange(0, BLOCK_M)
    for s0 in range(0, SPLIT, GROUP):
        for i in tl.static_range(GROUP):
            there = s0 + i < SPLIT
            sumsq += tl.load(slots + (s0 + i) * BLOCK_M + r, mask=m_mask & there, other=0.0, cache_modifier=".cg")
    return sumsq


@triton.jit
def _inv_rms(sumsq, K, eps):
    """1 / sqrt(mean(x[m]²) + eps) per row (fp32) from the rows' sums of squares, as RMSNorm computes it."""
    return tl.rsqrt(sumsq / K + eps)


@triton.jit
def _split_done(counter, SPLIT: tl.constexpr):
    """Count this split done on its tile's counter; whether it was the last (then the counter is zeroed for the
    next call). The barrier orders every thread's partial stores before the release."""
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = done == SPLIT - 1
    if last:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return last


# -- epilogues ------------------------------------------------------------------

@triton.jit
def _residual_tiles(residual, m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, N):
    """The residual's [rows, columns] tiles of a program's two runs (read past L1). linear_residual loads them
    before the split-K handshake, so that their latency hides under it rather than following it: 1.63 -> 1.44 us
    from the last split's loop to the kernel's end at M = 1 on an H200 (O and down, Qwen3-8B shapes), the decode
    step 4330 -> 4294 us at b1 (graph replay). linear_residual_ar loads them after its all-reduce: loaded before
    the handshake there, the two-GPU step took 3137 us at b1 against 3070 (2x H200; not understood)."""
    r = m[:, None].to(tl.int64) * N
    res_a = tl.load(residual + r + cols_a[None, :], mask=m_mask[:, None] & col_mask_a[None, :], other=0.0,
                    cache_modifier=".cg")
    res_b = tl.load(residual + r + cols_b[None, :], mask=m_mask[:, None] & col_mask_b[None, :], other=0.0,
                    cache_modifier=".cg")
    return res_a, res_b


@triton.jit
def _residual_out(acc_a, acc_b, res_a, res_b, out, m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, N):
    """out = the residual's tiles (_residual_tiles) + the projection (rounded to the dtype first, as the layers
    path rounds x @ W)."""
    dt = out.dtype.element_ty
    r = m[:, None].to(tl.int64) * N
    for_a = m_mask[:, None] & col_mask_a[None, :]
    for_b = m_mask[:, None] & col_mask_b[None, :]
    tl.store(out + r + cols_a[None, :], cast(cast(acc_a, dt).to(tl.float32) + res_a.to(tl.float32), dt), mask=for_a)
    tl.store(out + r + cols_b[None, :], cast(cast(acc_b, dt).to(tl.float32) + res_b.to(tl.float32), dt), mask=for_b)


@triton.jit
def _gate_up_out(acc_a, acc_b, inv_rms, out, m, m_mask, cols_a, col_mask_a, I):
    """out[m, cols] = silu(gate) * up, gate and up the normed projection's columns (the rows' 1 / rms applied)
    rounded to the dtype (rounded as silu_mul rounds them)."""
    dt = out.dtype.element_ty
    inv = inv_rms[:, None]
    gate = cast(acc_a * inv, dt).to(tl.float32)
    up = cast(acc_b * inv, dt).to(tl.float32)
    y = cast(cast(gate / (1.0 + tl.exp(-gate)), dt).to(tl.float32) * up, dt)
    tl.store(out + m[:, None].to(tl.int64) * I + cols_a[None, :], y, mask=m_mask[:, None] & col_mask_a[None, :])


@triton.jit
def _head_norm(x1, x2, weight, eps, j_mask, HALF: tl.constexpr):
    """RMSNorm over head_dim of heads' halves x1, x2 [rows, heads, HALF_P] (fp32): transformers' roundings (as
    pointwise._rms_heads)."""
    j = tl.arange(0, x1.shape[2])[None, None, :]
    rs = tl.rsqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * HALF) + eps)[:, :, None]
    w1 = tl.load(weight + j, mask=j_mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    dt = weight.dtype.element_ty
    return (cast(cast(x1 * rs, dt).to(tl.float32) * w1, dt).to(tl.float32),
            cast(cast(x2 * rs, dt).to(tl.float32) * w2, dt).to(tl.float32))


@triton.jit
def _qkv_out(acc_a, acc_b, head0, inv_rms, q_out, k_dst, v_dst, rows, positions, inv_freq, q_weight, k_weight, m,
             m_mask, eps, dst_sb, dst_sp, dst_sh, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
             QK_NORM: tl.constexpr, BLOCK_M: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr):
    """HEADS_P heads from head0 of the normed projection (their halves acc_a, acc_b [rows, HEADS_P HALF_P], head by
    head, times the rows' 1 / rms), all q, k or v heads: q heads normed (QK_NORM) and rotated into q_out (M, HEADS,
    2 HALF); k heads likewise into k_dst[rows[m], positions[m], h]; v heads as they are into v_dst."""
    dt = q_out.dtype.element_ty
    j = tl.arange(0, HALF_P)[None, None, :]
    h = tl.arange(0, HEADS_P)[None, :, None]
    j_mask = j < HALF
    mask = m_mask[:, None, None] & j_mask & (h < HEADS_P)  # (h: the mask's full shape)
    inv = inv_rms[:, None, None]
    x1 = cast(tl.reshape(acc_a, [BLOCK_M, HEADS_P, HALF_P]) * inv, dt).to(tl.float32)
    x2 = cast(tl.reshape(acc_b, [BLOCK_M, HEADS_P, HALF_P]) * inv, dt).to(tl.float32)
    pos = tl.load(positions + m, mask=m_mask, other=0)[:, None, None]
    slot = tl.load(rows + m, mask=m_mask, other=0)[:, None, None] * dst_sb + pos * dst_sp + j
    if head0 < HEADS + KV_HEADS:
        angle = pos.to(tl.float32) * tl.load(inv_freq + j, mask=j_mask, other=0.0)
        cos = cast(tl.cos(angle), dt).to(tl.float32)
        sin = cast(tl.sin(angle), dt).to(tl.float32)
        if head0 < HEADS:
            if QK_NORM:
                x1, x2 = _head_norm(x1, x2, q_weight, eps, j_mask, HALF)
            y1, y2 = _rotate(x1, x2, cos, sin, dt)
            dst = q_out + (m[:, None, None].to(tl.int64) * HEADS + head0 + h) * 2 * HALF + j
            tl.store(dst, y1, mask=mask)
            tl.store(dst + HALF, y2, mask=mask)
        else:
            if QK_NORM:
                x1, x2 = _head_norm(x1, x2, k_weight, eps, j_mask, HALF)
            y1, y2 = _rotate(x1, x2, cos, sin, dt)
            dst = k_dst + slot + (head0 - HEADS + h) * dst_sh
            tl.store(dst, y1, mask=mask)
            tl.store(dst + HALF, y2, mask=mask)
    else:
        dst = v_dst + slot + (head0 - HEADS - KV_HEADS + h) * dst_sh
        tl.store(dst, cast(x1, dt), mask=mask)
        tl.store(dst + HALF, cast(x2, dt), mask=mask)


# -- program bodies and kernels ------------------------------------------------------
# Grid (column tiles, splits, row blocks). A split covers BPS blocks of BLOCK_K of K's KB blocks. partial: (row
# blocks, SPLIT, BLOCK_M, N) fp32; counter: (row blocks, tiles) int32, zero between calls. Each kernel is a thin
# wrapper of its program body, which takes the program's ids (tile, split, row block) and the grid's tiles and row
# blocks as arguments: decode_step.py's persistent kernel runs the same bodies as its tasks.

@triton.jit
def _linear_share(tile, split, mb, x, w, M, K, N, KB, BPS, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                  K_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """Program (tile, split, mb)'s share of x @ w, columns [2 BLOCK_N tile, +2 BLOCK_N) in two runs of BLOCK_N:
    (the rows m, the two runs' columns and masks, their fp32 sums over the split's K range)."""
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    cols_a = tile * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_b = cols_a + BLOCK_N
    col_mask_a, col_mask_b = cols_a < N, cols_b < N
    kb0 = split * BPS
    acc_a, acc_b, _ = _gemv_pair(x, w, x, m, m_mask, K, N, cols_a, cols_b, col_mask_a, col_mask_b, kb0 * BLOCK_K,
                                 tl.minimum(BPS, KB - kb0), False, EVEN_K, EVEN_N, IEEE, DOT, K_MAJOR, BLOCK_M,
                                 BLOCK_N, BLOCK_K, STAGES)
    return m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, acc_a, acc_b


@triton.jit
def _linear_whole(acc_a, acc_b, tile, split, mb, tiles, partial, counter, m_mask, cols_a, cols_b, col_mask_a,
                  col_mask_b, N, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The split-K handshake of a program's share (_linear_share): (the tile's whole sums, whether this program
    holds them: the only split, or the last split after it summed every split's partials; another split's sums
    are its own share)."""
    whole = tl.full([], 1, tl.int1)
    if SPLIT > 1:
        _store_partials(acc_a, acc_b, partial, (mb * SPLIT + split) * BLOCK_M, m_mask, cols_a, cols_b, col_mask_a,
                        col_mask_b, N, BLOCK_M)
        whole = _split_done(counter + mb * tiles + tile, SPLIT)
        if whole:
            acc_a, acc_b = _sum_partials(partial, mb * SPLIT, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, N,
                                         SPLIT, BLOCK_M, BLOCK_N)
    return acc_a, acc_b, whole


@triton.jit
def _linear_residual_program(tile, split, mb, tiles, x, w, residual, out, partial, counter, M, K, N, KB, BPS,
                             SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                             STAGES: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                             K_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """Program (tile, split, mb) of out = residual + x @ w (_linear_share's columns): the residual's tiles are
    loaded between the program's share and the split-K handshake (_residual_tiles)."""
    m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, acc_a, acc_b = _linear_share(
        tile, split, mb, x, w, M, K, N, KB, BPS, BLOCK_M, BLOCK_K, STAGES, EVEN_K, IEEE, DOT, K_MAJOR, BLOCK_N,
        EVEN_N)
    res_a, res_b = _residual_tiles(residual, m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, N)
    acc_a, acc_b, whole = _linear_whole(acc_a, acc_b, tile, split, mb, tiles, partial, counter, m_mask, cols_a,
                                        cols_b, col_mask_a, col_mask_b, N, SPLIT, BLOCK_M, BLOCK_N)
    if whole:
        _residual_out(acc_a, acc_b, res_a, res_b, out, m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, N)


@triton.jit
def linear_residual_kernel(x, w, residual, out, partial, counter, M, K, N, KB, BPS, SPLIT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                           IEEE: tl.constexpr, DOT: tl.constexpr, K_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr,
                           EVEN_N: tl.constexpr):
    """out = residual + x @ w (_linear_residual_program)."""
    _linear_residual_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), x, w,
                             residual, out, partial, counter, M, K, N, KB, BPS, SPLIT, BLOCK_M, BLOCK_K, STAGES,
                             EVEN_K, IEEE, DOT, K_MAJOR, BLOCK_N, EVEN_N)


@triton.jit(do_not_specialize=["ll_half", "fp"])
def linear_residual_ar_kernel(x, w, residual, out, partial, counter, ll, epochs, heap, sig, err, fp, M, K, N, KB, BPS,
                              ll_half, WORLD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                              DOT: tl.constexpr, K_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr,
                              EVEN_N: tl.constexpr):
    """out = residual + the sum over the group's WORLD ranks of x @ w (each rank its own x and w): the split-K
    GEMV of linear_residual, then the all-reduce in the epilogue, in LL words (wl.pack_ll: a value's fp32 bits and
    the call's epoch in one 8-byte store; gemm_ar's workspace holds them, its `ll` halves by call parity, and its
    epoch counter and signature words). The program that holds a tile's whole sums stores them as LL words into
    slot [me] of the tile in every other rank's half, then waits for every other rank's words of the tile
    (wl.wait_ll polls the words themselves: no flag, no fence) and sums the WORLD ranks' values in rank order, its
    own from registers (the same bits on every rank), rounds the sum to the dtype and adds the residual. Every
    program takes the epoch; the first program of the grid signs (every member's launch has one: the word comes
    whatever the grids; not all ~250 programs storing it to every member); the sum waits on the signature check
    (a mismatch writes no output), whose words are loaded before the split-K handshake, so that its round trip
    is covered by the handshake's (~0.15 µs a call each: docs/design.md, section 4).
    Reuse: a rank writes half e % 2 of a peer in call e only after its call e - 1 received that peer's words of
    call e - 1, which the peer stored after its own call e - 2, the last reader of half e % 2, had ended."""
    tile, split, mb, tiles = tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0)
    epoch = wl.next_epoch(epochs)
    if wl.signature_live(sig, heap):
        if (tile == 0) & (split == 0) & (mb == 0):  # one signature a launch: the first program's
            wl.sign(sig, epoch, fp, heap)
        m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, acc_a, acc_b = _linear_share(
            tile, split, mb, x, w, M, K, N, KB, BPS, BLOCK_M, BLOCK_K, STAGES, EVEN_K, IEEE, DOT, K_MAJOR, BLOCK_N,
            EVEN_N)
        # The members' signature words, loaded before the split-K handshake, whose round trips cover the load's:
        # the check after it needs no round trip of its own where every member had signed by then.
        seen = wl.signature_words(sig, epoch, heap)
        acc_a, acc_b, whole = _linear_whole(acc_a, acc_b, tile, split, mb, tiles, partial, counter, m_mask, cols_a,
                                            cols_b, col_mask_a, col_mask_b, N, SPLIT, BLOCK_M, BLOCK_N)
        if whole:
            me = wl.rank(heap)
            half = ll + (epoch % 2).to(tl.int64) * ll_half
            r = m[:, None].to(tl.int64) * N
            mask_a = m_mask[:, None] & col_mask_a[None, :]
            mask_b = m_mask[:, None] & col_mask_b[None, :]
            words_a = wl.pack_ll(acc_a.to(tl.int32, bitcast=True), epoch)
            words_b = wl.pack_ll(acc_b.to(tl.int32, bitcast=True), epoch)
            for i in tl.static_range(1, WORLD):  # each rank starts with the next one and goes round
                there = wl.symm_at(half + me * M * N, (me + i) % WORLD, heap)
                tl.store(there + r + cols_a[None, :], words_a, mask=mask_a)
                tl.store(there + r + cols_b[None, :], words_b, mask=mask_b)
            if wl.check_signed(sig, epoch, fp, heap, err, op="linear_residual_ar", seen=seen):
                total_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                total_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for q in tl.static_range(WORLD):  # rank order: the same bits on every rank
                    if q == me:
                        total_a += acc_a
                        total_b += acc_b
                    else:
                        slot = half + q * M * N + r
                        got_a = wl.wait_ll(slot + cols_a[None, :], mask_a, epoch, heap, q, op="linear_residual_ar")
                        got_b = wl.wait_ll(slot + cols_b[None, :], mask_b, epoch, heap, q, op="linear_residual_ar")
                        total_a += got_a.to(tl.float32, bitcast=True)
                        total_b += got_b.to(tl.float32, bitcast=True)
                res_a, res_b = _residual_tiles(residual, m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b, N)
                _residual_out(total_a, total_b, res_a, res_b, out, m, m_mask, cols_a, cols_b, col_mask_a, col_mask_b,
                              N)


@triton.jit
def _gate_up_program(tile, split, mb, tiles, m_blocks, x, norm_w, w, out, partial, counter, M, K, I, KB, BPS, eps,
                     SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     EVEN_K: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, K_MAJOR: tl.constexpr,
                     BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """Program (tile, split, mb) of out (M, I) = silu(gate) * up of norm(x) @ w, w (K, 2 I) = [gate | up]: its
    columns are gate's [BLOCK_N tile, +BLOCK_N) and the same of up."""
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    cols_a = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask_a = cols_a < I
    cols_b = cols_a + I
    kb0 = split * BPS
    acc_a, acc_b, sumsq = _gemv_pair(x, w, norm_w, m, m_mask, K, 2 * I, cols_a, cols_b, col_mask_a, col_mask_a,
                                     kb0 * BLOCK_K, tl.minimum(BPS, KB - kb0), True, EVEN_K, EVEN_N, IEEE, DOT,
                                     K_MAJOR, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    if SPLIT == 1:
        _gate_up_out(acc_a, acc_b, _inv_rms(sumsq, K, eps), out, m, m_mask, cols_a, col_mask_a, I)
    else:
        _store_partials(acc_a, acc_b, partial, (mb * SPLIT + split) * BLOCK_M, m_mask, cols_a, cols_b, col_mask_a,
                        col_mask_a, 2 * I, BLOCK_M)
        slots = _sumsq_slots(partial, 2 * I, tile, mb, tiles, m_blocks, SPLIT, BLOCK_M)
        _store_sumsq(sumsq, slots, split, m_mask, BLOCK_M)
        if _split_done(counter + mb * tiles + tile, SPLIT):
            acc_a, acc_b = _sum_partials(partial, mb * SPLIT, m_mask, cols_a, cols_b, col_mask_a, col_mask_a,
                                         2 * I, SPLIT, BLOCK_M, BLOCK_N)
            sumsq = _sum_sumsq(slots, m_mask, SPLIT, BLOCK_M)
            _gate_up_out(acc_a, acc_b, _inv_rms(sumsq, K, eps), out, m, m_mask, cols_a, col_mask_a, I)


@triton.jit
def norm_gate_up_silu_kernel(x, norm_w, w, out, partial, counter, M, K, I, KB, BPS, eps, SPLIT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                             EVEN_K: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, K_MAJOR: tl.constexpr,
                             BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """out (M, I) = silu(gate) * up of norm(x) @ w (_gate_up_program)."""
    _gate_up_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), tl.num_programs(2),
                     x, norm_w, w, out, partial, counter, M, K, I, KB, BPS, eps, SPLIT, BLOCK_M, BLOCK_K, STAGES,
                     EVEN_K, IEEE, DOT, K_MAJOR, BLOCK_N, EVEN_N)


@triton.jit
def _qkv_program(tile, split, mb, tiles, m_blocks, x, norm_w, w, q_out, k_dst, v_dst, rows, positions, inv_freq,
                 q_weight, k_weight, partial, counter, M, K, KB, BPS, eps, dst_sb, dst_sp, dst_sh,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                 EVEN_K: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, K_MAJOR: tl.constexpr,
                 HALF_P: tl.constexpr, HEADS_P: tl.constexpr):
    """Program (tile, split, mb) of q, k, v of norm(x) @ w, w (K, (HEADS + 2 KV_HEADS) 2 HALF) = [q | k | v]: it
    owns heads [HEADS_P tile, +HEADS_P) (HEADS_P divides both head counts: they are all q, k or v heads), its runs
    their first halves and their second halves (HALF columns each, padded to HALF_P), so the heads' norm and
    rotation happen in registers."""
    head0 = tile * HEADS_P
    N: tl.constexpr = (HEADS + 2 * KV_HEADS) * 2 * HALF
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    j = tl.arange(0, HEADS_P * HALF_P)
    cols_a = (head0 + j // HALF_P) * 2 * HALF + j % HALF_P
    cols_b = cols_a + HALF
    j_mask = j % HALF_P < HALF
    kb0 = split * BPS
    acc_a, acc_b, sumsq = _gemv_pair(x, w, norm_w, m, m_mask, K, N, cols_a, cols_b, j_mask, j_mask,
                                     kb0 * BLOCK_K, tl.minimum(BPS, KB - kb0), True, EVEN_K, HALF == HALF_P, IEEE,
                                     DOT, K_MAJOR, BLOCK_M, HEADS_P * HALF_P, BLOCK_K, STAGES)
    if SPLIT == 1:
        _qkv_out(acc_a, acc_b, head0, _inv_rms(sumsq, K, eps), q_out, k_dst, v_dst, rows, positions, inv_freq,
                 q_weight, k_weight, m, m_mask, eps, dst_sb, dst_sp, dst_sh, HEADS, KV_HEADS, HALF, QK_NORM, BLOCK_M,
                 HALF_P, HEADS_P)
    else:
        _store_partials(acc_a, acc_b, partial, (mb * SPLIT + split) * BLOCK_M, m_mask, cols_a, cols_b, j_mask,
                        j_mask, N, BLOCK_M)
        slots = _sumsq_slots(partial, N, tile, mb, tiles, m_blocks, SPLIT, BLOCK_M)
        _store_sumsq(sumsq, slots, split, m_mask, BLOCK_M)
        if _split_done(counter + mb * tiles + tile, SPLIT):
            acc_a, acc_b = _sum_partials(partial, mb * SPLIT, m_mask, cols_a, cols_b, j_mask, j_mask, N, SPLIT,
                                         BLOCK_M, HEADS_P * HALF_P)
            sumsq = _sum_sumsq(slots, m_mask, SPLIT, BLOCK_M)
            _qkv_out(acc_a, acc_b, head0, _inv_rms(sumsq, K, eps), q_out, k_dst, v_dst, rows, positions, inv_freq,
                     q_weight, k_weight, m, m_mask, eps, dst_sb, dst_sp, dst_sh, HEADS, KV_HEADS, HALF, QK_NORM,
                     BLOCK_M, HALF_P, HEADS_P)


@triton.jit
def norm_qkv_rope_kernel(x, norm_w, w, q_out, k_dst, v_dst, rows, positions, inv_freq, q_weight, k_weight, partial,
                         counter, M, K, KB, BPS, eps, dst_sb, dst_sp, dst_sh, HEADS: tl.constexpr,
                         KV_HEADS: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                         IEEE: tl.constexpr, DOT: tl.constexpr, K_MAJOR: tl.constexpr, HALF_P: tl.constexpr,
                         HEADS_P: tl.constexpr):
    """q, k, v of norm(x) @ w (_qkv_program)."""
    _qkv_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), tl.num_programs(2), x,
                 norm_w, w, q_out, k_dst, v_dst, rows, positions, inv_freq, q_weight, k_weight, partial, counter, M,
                 K, KB, BPS, eps, dst_sb, dst_sp, dst_sh, HEADS, KV_HEADS, HALF, QK_NORM, SPLIT, BLOCK_M, BLOCK_K,
                 STAGES, EVEN_K, IEEE, DOT, K_MAJOR, HALF_P, HEADS_P)


# -- host side ------------------------------------------------------------------
# A plan's key holds each weight's strides beside its signature (which says only whether a tensor is contiguous): a
# plan checked one layout (LAYOUTS), and must not serve a weight of the same shape and other strides.

def launch_settings(device: torch.device, op: str, m: int, shape: tuple | None = None, layout: str = "kn") -> dict:
    """The launch settings of `op` (one of OPS) at m rows of a (K, N) weight `shape` stored as `layout` (of
    LAYOUTS): {FIELDS: value}, resolved from weft.tuning's decode.gemv on GPUs (CPU_SETTINGS under the
    interpreter) as `resolve` reads it."""
    table = CPU_SETTINGS if device.type != "cuda" else tuning.value("decode.gemv", device)
    return resolve(table, op, m, shape, layout)


def _shape_scope(part: str) -> bool:
    """Whether a key's scope part names a weight shape, KxN (`4096x12288`)."""
    k, x, n = part.partition("x")
    return bool(x) and k.isdigit() and n.isdigit()


def resolve(table: dict, op: str, m: int, shape: tuple | None = None, layout: str = "kn") -> dict:
    """The settings `table` (decode.gemv's form) gives `op` at m rows of a (K, N) weight `shape` stored as
    `layout`. Its keys are `[op.[KxN.]][nk.][range.]field`: a field of FIELDS for every op and row count, or
    scoped to one op of OPS, to one of its weight shapes (the shapes of one rank at some tensor-parallel size
    differ from one GPU's: a setting swept there), to weights stored K-contiguous ("nk"; a setting swept on one
    layout says nothing of the other, so for an "nk" weight every key with it comes before any without), to a row
    range ("few": m <= the table's few_max_m, else "many"), or to several; the most specific key present wins.
    TuningError naming a key that is none of these, or a field no key gives."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    for key in table:
        if key == "few_max_m":
            continue
        *scope, field = key.split(".")
        op_scope = scope[:1] if scope and scope[0] in OPS else []
        shape_scope = scope[1:2] if op_scope and len(scope) > 1 and _shape_scope(scope[1]) else []
        rest = scope[len(op_scope) + len(shape_scope):]
        if rest and rest[0] == "nk":
            rest = rest[1:]
        if field not in FIELDS or len(rest) > 1 or (rest and rest[0] not in RANGES):
            raise tuning.TuningError(f"decode.gemv: unknown key {key!r} (keys are [op.[KxN.]][nk.][range.]field: op "
                                     f"of {', '.join(OPS)}, a weight shape such as 4096x12288, nk for weights "
                                     f"stored K-contiguous, range of {', '.join(RANGES)}, field of "
                                     f"{', '.join(FIELDS)})")
    rows = "few" if m <= table.get("few_max_m", 0) else "many"
    ops = [f"{op}.{shape[0]}x{shape[1]}.", f"{op}."] if shape is not None else [f"{op}."]
    scopes = [s for at in ops for s in (f"{at}{rows}.", at)] + [f"{rows}.", ""]
    if layout == "nk":
        scopes = [s for at in ops + [""] for s in (f"{at}nk.{rows}.", f"{at}nk.")] + scopes
    out = {}
    for field in FIELDS:
        for key in (scope + field for scope in scopes):
            if key in table:
                out[field] = table[key]
                break
        else:
            raise tuning.TuningError(f"decode.gemv gives {op} at {m} rows no {field!r}")
    return out


def _operand(name: str, t, dtype, shape: tuple) -> None:
    """TypeError/ValueError naming `name` unless t is a contiguous tensor of `dtype` (None: bf16, fp16, fp32) and
    `shape` (None: any size there)."""
    _shaped(name, t, dtype, shape)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _shaped(name: str, t, dtype, shape: tuple) -> None:
    """_check's checks, and `shape` (None: any size there), naming `name`."""
    _check(name, t, dtype, len(shape))
    if any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = tuple("any" if s is None else s for s in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")


def _weight_operand(name: str, t, dtype, shape: tuple) -> bool:
    """_operand's checks for a (K, N) weight, which may be stored either way (LAYOUTS): contiguous, or the
    transpose of a contiguous (N, K) tensor (an nn.Linear weight's .t()); whether it is the latter."""
    _shaped(name, t, dtype, shape)
    if t.is_contiguous():
        return False
    if t.t().is_contiguous():
        return True
    raise ValueError(f"{name} must be contiguous, or the transpose of a contiguous tensor (K contiguous), got "
                     f"strides {t.stride()}")


def _same_device(device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, but this rank's device is {device}")


# A split other than the one-wave one (balanced_split) must save at least this share of the kernel's time.
BALANCE_GAIN = 0.1
# Splits within this share of the least time count as equal to it (balanced_split).
BALANCE_SLACK = 0.03


def balanced_split(units: int, k_blocks: int, sms: int, programs: int) -> int:
    """The K splits of a GEMV of `units` (column tiles x row blocks) whose K is k_blocks blocks, on `sms` SMs.
    By default as far as `programs` (the SMs times programs_per_sm) allow in one wave, rounded down: a tail wave of
    a few programs would cost a whole wave's latency. But the kernel is bound by each SM's share of the copy
    bandwidth, so its time is that of the busiest SM: ceil(programs / sms) programs of bps = ceil(k_blocks / split)
    blocks each (side by side or one after another). When the one-wave split leaves SMs idle or uneven (96 column
    tiles of gate/up at 8 rows on 132 SMs: split 1, 36 SMs idle, 73 % of the ideal), the split with the least such
    time is taken, if it saves BALANCE_GAIN of it: the fewest splits within BALANCE_SLACK of that time (each split
    adds a partial sum of the rows to write and add up)."""
    def busiest_sm(split: int) -> int:
        bps = triton.cdiv(k_blocks, split)
        return triton.cdiv(units * triton.cdiv(k_blocks, bps), sms) * bps

    one_wave = max(1, min(k_blocks, programs // max(units, 1)))
    least = min(busiest_sm(s) for s in range(1, k_blocks + 1))
    best = next(s for s in range(1, k_blocks + 1) if busiest_sm(s) <= (1 + BALANCE_SLACK) * least)
    return best if busiest_sm(best) < (1 - BALANCE_GAIN) * busiest_sm(one_wave) else one_wave


class GemvPlan(Plan):
    """The grid of one fused GEMV call signature: M rows in row blocks, column tiles, K in splits of BPS blocks
    (balanced_split), the split-K workspace and counters. `settings` (`resolve`'s form) replaces the tuned ones:
    the tests run both GEMV paths with it. k_major: the weight is stored K-contiguous (LAYOUTS' "nk")."""

    def __init__(self, group, op: str, m: int, k: int, n: int, dtype: torch.dtype, settings: dict | None,
                 k_major: bool = False):
        super().__init__(group)
        self.k_major = k_major
        s = launch_settings(group.device, op, m, (k, n), "nk" if k_major else "kn") if settings is None else settings
        self.dot = bool(s["dot"])
        # tl.dot takes 16 rows at least; the dot-free path holds just M's (a power of two) in its accumulators.
        rows = triton.next_power_of_2(max(m, 1))
        self.block_m = min(MAX_BLOCK_M, max(MIN_BLOCK, rows)) if self.dot else min(FMA_MAX_BLOCK_M, rows)
        self.block_k = max(MIN_BLOCK, min(s["block_k"], triton.next_power_of_2(max(k, 1))))
        self.block_n = s["block_n"]
        self.m_blocks = triton.cdiv(m, self.block_m)
        self.kb = triton.cdiv(k, self.block_k)
        self.programs = num_sms(group.device) * s["programs_per_sm"]
        self.num_warps, self.stages = s["num_warps"], s["num_stages"]
        self.even_k, self.ieee = k % self.block_k == 0, dtype == torch.float32
        self.launch = None

    def split_k(self, tiles: int, n: int, norm: bool = False) -> None:
        """The grid for `tiles` column tiles of an n-column weight: K split as `balanced_split` says, the workspace
        (norm: with the splits' sums of squares of x's rows after the partial sums, _sumsq_slots) and counters."""
        device = self.group.device
        split = balanced_split(tiles * self.m_blocks, self.kb, num_sms(device), self.programs)
        self.bps = triton.cdiv(self.kb, split)
        self.split = triton.cdiv(self.kb, self.bps)
        self.grid = (tiles, self.split, self.m_blocks)
        size = 1
        if self.split > 1:
            size = self.m_blocks * self.split * self.block_m * (n + (tiles if norm else 0))
        self.partial = torch.empty((size,), dtype=torch.float32, device=device)
        self.counter = torch.zeros((self.m_blocks, tiles), dtype=torch.int32, device=device)
        self.common = dict(SPLIT=self.split, BLOCK_M=self.block_m, BLOCK_K=self.block_k, STAGES=self.stages,
                           EVEN_K=self.even_k, IEEE=self.ieee, DOT=self.dot, K_MAJOR=self.k_major)


@declare_op()
def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight in one kernel: x (M, K), weight (K, N), residual (M, N), one dtype (bf16, fp16, fp32),
    contiguous (weight: or the transpose of a contiguous (N, K), an nn.Linear weight's .t()); x @ weight is
    rounded to the dtype before the add (as `x @ weight + residual` rounds). A decode step's O and down
    projections at one rank, M a few tokens (module doc)."""
    world = world_or_raise()
    found = plan(world, lambda: ("linear_residual", signature(x), signature(weight), weight.stride(),
                                 signature(residual)),
                 lambda: LinearResidualPlan(world, x, weight, residual))
    return found.run(x, weight, residual)


class LinearResidualPlan(GemvPlan):
    def __init__(self, group, x, weight, residual, settings=None):
        _operand("x", x, None, (None, None))
        m, k = x.shape
        k_major = _weight_operand("weight", weight, x.dtype, (k, None))
        n = weight.shape[1]
        _operand("residual", residual, x.dtype, (m, n))
        _same_device(group.device, x=x, weight=weight, residual=residual)
        if k == 0:
            raise ValueError("x has no columns (K = 0): nothing to project")
        self.shape = (m, n)
        super().__init__(group, "down" if k > n else "o", m, k, n, x.dtype, settings, k_major)
        self.split_k(triton.cdiv(n, 2 * self.block_n), n)
        self.args = (m, k, n, self.kb, self.bps)
        self.consts = dict(**self.common, BLOCK_N=self.block_n, EVEN_N=n % (2 * self.block_n) == 0)
        if min(m, n) > 0:
            self.prepare(x, weight, residual, torch.empty(self.shape, dtype=x.dtype, device=x.device))

    def prepare(self, x, weight, residual, out):
        self.launch = Launch(linear_residual_kernel, self.grid,
                             (x, weight, residual, out, self.partial, self.counter, *self.args), self.consts,
                             self.num_warps)

    def run(self, x, weight, residual):
        out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        if self.launch is not None:
            a = self.launch.address
            self.launch(a(x), a(weight), a(residual), a(out), a(self.partial), a(self.counter), *self.args)
        return out


@declare_op(collective=True)
def linear_residual_ar(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, group=None) -> torch.Tensor:
    """residual + the sum over the members of `group` (default: the world) of x @ weight, in one kernel: the
    row-parallel O and down projections of a decode step at tensor-parallel size > 1 (gemm_ar and the residual
    add, on linear_residual's split-K GEMV). Each member passes its x (M, K) and weight (K, N) shards and the same
    residual (M, N); one dtype (bf16, fp16, fp32), contiguous (weight: or the transpose of a contiguous (N, K)).
    The sum is rounded to the dtype before the add
    (as `gemm_ar(x, weight) + residual` rounds); every member gets the same bits. On a group of one it is
    linear_residual; on a group that spans nodes, or where the members' rows x columns exceed gemm_ar's workspace's
    LL words (2M a call at the default 128 MiB workspace), gemm_ar (the node's kernel, then the rail) and the add.
    Collective: every member calls it with the same shapes and dtype."""
    g = resolve_group(group)
    found = plan(g, lambda: ("linear_residual_ar", signature(x), signature(weight), weight.stride(),
                             signature(residual)),
                 lambda: LinearResidualArPlan(g, x, weight, residual))
    return found.run(x, weight, residual)


class LinearResidualArPlan(LinearResidualPlan):
    """linear_residual's grid with the all-reduce in its epilogue (linear_residual_ar_kernel), on gemm_ar's
    workspace; linear_residual's own on a group of one."""

    def prepare(self, x, weight, residual, out):
        group = self.group
        if group.size == 1:
            return super().prepare(x, weight, residual, out)
        if group.topology.spans_nodes:
            self.launch, self.run = None, self.run_unfused
            return
        ws = workspace(group, "gemm_ar", GemmArWorkspace)
        m, k, n = self.args[:3]
        if group.size * m * n > ws.ll_half:  # beyond the LL words: the all-reduce as gemm_ar's, then the add
            self.launch, self.run = None, self.run_unfused
            return
        self.fp = self.sign("linear_residual_ar", m=m, n=n, k=k, dtype=str(x.dtype).removeprefix("torch."))
        self.errors = ws.errors
        fixed = (ws.ll, ws.counter, group.heap.descriptor, ws.sig, ws.errors.tensor, self.fp)
        self.tail = (*self.args, ws.ll_half)
        self.launch = Launch(linear_residual_ar_kernel, self.grid,
                             (x, weight, residual, out, self.partial, self.counter, *fixed, *self.tail),
                             dict(WORLD=group.size, **self.consts), self.num_warps)
        self.fixed = self.launch.arguments(fixed)
        self.run = self.run_all_reduce

    def run_all_reduce(self, x, weight, residual):
        out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        a = self.launch.address
        self.launch(a(x), a(weight), a(residual), a(out), a(self.partial), a(self.counter), *self.fixed, *self.tail)
        self.errors.raise_recorded()
        return out

    def run_unfused(self, x, weight, residual):
        return gemm_ar.eager(x, weight, group=self.group) + residual


@declare_op()
def norm_gate_up_silu(x: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                      eps: float = 1e-6) -> torch.Tensor:
    """silu(gate) * up of RMSNorm(x) @ gate_up_weight, in one kernel: x (M, K), norm_weight (K,) (the norm's
    weight, transformers' LlamaRMSNorm), gate_up_weight (K, 2 I) = [gate | up] columns; returns (M, I). One dtype
    (bf16, fp16, fp32), contiguous (gate_up_weight: or the transpose of a contiguous (2 I, K)). A decode step's
    MLP up to the down projection (module doc for the roundings)."""
    world = world_or_raise()
    found = plan(world, lambda: ("norm_gate_up_silu", signature(x), signature(norm_weight), signature(gate_up_weight),
                                 gate_up_weight.stride()),
                 lambda: GateUpPlan(world, x, norm_weight, gate_up_weight, eps))
    return found.run(x, norm_weight, gate_up_weight, eps)


def _eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return float(eps)


class GateUpPlan(GemvPlan):
    def __init__(self, group, x, norm_weight, gate_up_weight, eps, settings=None):
        _operand("x", x, None, (None, None))
        m, k = x.shape
        _operand("norm_weight", norm_weight, x.dtype, (k,))
        k_major = _weight_operand("gate_up_weight", gate_up_weight, x.dtype, (k, None))
        _same_device(group.device, x=x, norm_weight=norm_weight, gate_up_weight=gate_up_weight)
        if gate_up_weight.shape[1] % 2:
            raise ValueError(f"gate_up_weight's columns ({gate_up_weight.shape[1]}) must be even: [gate | up]")
        _eps(eps)
        if k == 0:
            raise ValueError("x has no columns: RMSNorm of an empty row is undefined")
        inter = gate_up_weight.shape[1] // 2
        self.shape = (m, inter)
        super().__init__(group, "gate_up", m, k, gate_up_weight.shape[1], x.dtype, settings, k_major)
        self.split_k(triton.cdiv(inter, self.block_n), 2 * inter, norm=True)
        self.args = (m, k, inter, self.kb, self.bps)
        if min(m, inter) > 0:
            out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
            self.launch = Launch(norm_gate_up_silu_kernel, self.grid,
                                 (x, norm_weight, gate_up_weight, out, self.partial, self.counter, *self.args, eps),
                                 dict(**self.common, BLOCK_N=self.block_n, EVEN_N=inter % self.block_n == 0),
                                 self.num_warps)

    def run(self, x, norm_weight, gate_up_weight, eps):
        out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        if self.launch is not None:
            a = self.launch.address
            self.launch(a(x), a(norm_weight), a(gate_up_weight), a(out), a(self.partial), a(self.counter),
                        *self.args, _eps(eps))
        return out


@declare_op()
def norm_qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor, heads: int, kv_heads: int,
                  inv_freq: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k_dst: torch.Tensor,
                  v_dst: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm(x) @ qkv_weight, then per head what qk_norm_rope does with it, in one kernel: x (M, K),
    norm_weight (K,), qkv_weight (K, (heads + 2 kv_heads) head_dim) = [q | k | v] columns, head_dim =
    2 inv_freq.shape[0]. Returns q (M, heads, head_dim), RMS-normed over head_dim by q_weight (if given, Qwen3) and
    rotated (angles positions[t] * inv_freq, rotate_half form); k (normed by k_weight, rotated) and v go to
    k_dst / v_dst[rows[t], positions[t]] ((sequences, positions, kv_heads, head_dim), head_dim contiguous).
    rows, positions: (M,) int64 (not checked against k_dst's size: that would need a host sync). eps: both
    norms'. One dtype (bf16, fp16, fp32), x and the weights contiguous (qkv_weight: or the transpose of a
    contiguous ((heads + 2 kv_heads) head_dim, K), nn.Linear's layout)."""
    world = world_or_raise()
    _head_counts(heads, kv_heads)  # before the plan's key, where 2.0 would find the plan of 2
    found = plan(world, lambda: ("norm_qkv_rope", signature(x), signature(norm_weight), signature(qkv_weight),
                                 qkv_weight.stride(), heads,
                                 kv_heads, signature(inv_freq), signature(rows), signature(positions), signature(k_dst),
                                 k_dst.stride(), signature(v_dst), v_dst.stride(),
                                 *(None if t is None else signature(t) for t in (q_weight, k_weight))),
                 lambda: QkvPlan(world, x, norm_weight, qkv_weight, heads, kv_heads, inv_freq, rows, positions, k_dst,
                                 v_dst, q_weight, k_weight, eps))
    return found.run(x, norm_weight, qkv_weight, inv_freq, rows, positions, k_dst, v_dst, q_weight, k_weight, eps)


def _head_counts(heads, kv_heads) -> None:
    for name, v in (("heads", heads), ("kv_heads", kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def heads_per_program(block_n: int, half_p: int, heads: int, kv_heads: int) -> int:
    """A QKV program's heads: block_n columns a run, half a head (half_p, padded) each, as a power of two that
    divides both head counts (a program's heads are then all q, k or v heads)."""
    heads_p = 1
    while heads_p * 2 * half_p <= block_n and heads % (heads_p * 2) == 0 and kv_heads % (heads_p * 2) == 0:
        heads_p *= 2
    return heads_p


class QkvPlan(GemvPlan):
    def __init__(self, group, x, norm_weight, qkv_weight, heads, kv_heads, inv_freq, rows, positions, k_dst, v_dst,
                 q_weight, k_weight, eps, settings=None):
        _operand("x", x, None, (None, None))
        m, k = x.shape
        _head_counts(heads, kv_heads)
        _operand("inv_freq", inv_freq, torch.float32, (None,))
        half = inv_freq.shape[0]
        if half < 1:
            raise ValueError("inv_freq is empty: head_dim = 2 inv_freq.shape[0] must be >= 2")
        d = 2 * half
        _operand("norm_weight", norm_weight, x.dtype, (k,))
        k_major = _weight_operand("qkv_weight", qkv_weight, x.dtype, (k, (heads + 2 * kv_heads) * d))
        for name, t in (("rows", rows), ("positions", positions)):
            _operand(name, t, torch.int64, (m,))
        for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
            _check(name, t, x.dtype, 4)
            if t.shape[2:] != (kv_heads, d) or t.stride(3) != 1:
                raise ValueError(f"{name} must be (sequences, positions, {kv_heads}, {d}) with head_dim contiguous, "
                                 f"got {tuple(t.shape)}, strides {t.stride()}")
        if k_dst.stride() != v_dst.stride():
            raise ValueError(f"k_dst and v_dst must have the same strides, got {k_dst.stride()} and {v_dst.stride()}")
        for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
            if t is not None:
                _operand(name, t, x.dtype, (d,))
        if (q_weight is None) != (k_weight is None):
            raise ValueError("give both q_weight and k_weight, or neither")
        _same_device(group.device, x=x, norm_weight=norm_weight, qkv_weight=qkv_weight, inv_freq=inv_freq,
                     rows=rows, positions=positions, k_dst=k_dst, v_dst=v_dst, q_weight=q_weight, k_weight=k_weight)
        _eps(eps)
        if k == 0:
            raise ValueError("x has no columns: RMSNorm of an empty row is undefined")
        self.q_shape, self.dtype = (m, heads, d), x.dtype
        self.qk_norm = q_weight is not None
        half_p = max(MIN_BLOCK, triton.next_power_of_2(half))
        super().__init__(group, "qkv", m, k, qkv_weight.shape[1], x.dtype, settings, k_major)
        self.heads_p = heads_p = heads_per_program(self.block_n, half_p, heads, kv_heads)
        self.split_k((heads + 2 * kv_heads) // heads_p, (heads + 2 * kv_heads) * d, norm=True)
        self.args = (m, k, self.kb, self.bps)
        self.strides = k_dst.stride()[:3]
        if m > 0:
            q = torch.empty(self.q_shape, dtype=x.dtype, device=x.device)
            norms = (q_weight, k_weight) if self.qk_norm else (norm_weight, norm_weight)  # not read without QK_NORM
            self.launch = Launch(norm_qkv_rope_kernel, self.grid,
                                 (x, norm_weight, qkv_weight, q, k_dst, v_dst, rows, positions, inv_freq, *norms,
                                  self.partial, self.counter, *self.args, eps, *self.strides),
                                 dict(HEADS=heads, KV_HEADS=kv_heads, HALF=half, QK_NORM=self.qk_norm, **self.common,
                                      HALF_P=half_p, HEADS_P=heads_p), self.num_warps)

    def run(self, x, norm_weight, qkv_weight, inv_freq, rows, positions, k_dst, v_dst, q_weight, k_weight, eps):
        q = torch.empty(self.q_shape, dtype=self.dtype, device=x.device)
        if self.launch is not None:
            a = self.launch.address
            norms = (q_weight, k_weight) if self.qk_norm else (norm_weight, norm_weight)
            self.launch(a(x), a(norm_weight), a(qkv_weight), a(q), a(k_dst), a(v_dst), a(rows), a(positions),
                        a(inv_freq), *(a(t) for t in norms), a(self.partial), a(self.counter), *self.args, _eps(eps),
                        *self.strides)
        return q


# -- the operators (inference only: not differentiable) ---------------------------------------------------------
#   torch.ops.weft.linear_residual(x, weight, residual) -> out
#   torch.ops.weft.linear_residual_ar(x, weight, residual, group_name) -> out
#   torch.ops.weft.norm_gate_up_silu(x, norm_weight, gate_up_weight, eps) -> out
#   torch.ops.weft.norm_qkv_rope(x, norm_weight, qkv_weight, heads, kv_heads, inv_freq, rows, positions, k_dst!,
#                                v_dst!, q_weight, k_weight, eps) -> q   (k and v written into k_dst / v_dst)

@linear_residual.define
def linear_residual_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return linear_residual.eager(x, weight, residual)


@linear_residual_op.register_fake
def _(x, weight, residual):
    return x.new_empty((x.shape[0], weight.shape[1]))


@linear_residual_ar.define
def linear_residual_ar_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                          group_name: str) -> torch.Tensor:
    return linear_residual_ar.eager(x, weight, residual, group=group_name)


@linear_residual_ar_op.register_fake
def _(x, weight, residual, group_name):
    return x.new_empty((x.shape[0], weight.shape[1]))


@linear_residual_ar.traced
def _(x, weight, residual, group=None):
    return torch.ops.weft.linear_residual_ar(x, weight, residual, group_name(group))


@norm_gate_up_silu.define
def norm_gate_up_silu_op(x: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                         eps: float = 1e-6) -> torch.Tensor:
    return norm_gate_up_silu.eager(x, norm_weight, gate_up_weight, eps)


@norm_gate_up_silu_op.register_fake
def _(x, norm_weight, gate_up_weight, eps=1e-6):
    return x.new_empty((x.shape[0], gate_up_weight.shape[1] // 2))


@norm_qkv_rope.define(mutates_args=("k_dst", "v_dst"))
def norm_qkv_rope_op(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor, heads: int, kv_heads: int,
                     inv_freq: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k_dst: torch.Tensor,
                     v_dst: torch.Tensor, q_weight: Optional[torch.Tensor] = None,
                     k_weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    return norm_qkv_rope.eager(x, norm_weight, qkv_weight, heads, kv_heads, inv_freq, rows, positions, k_dst, v_dst,
                               q_weight, k_weight, eps)


@norm_qkv_rope_op.register_fake
def _(x, norm_weight, qkv_weight, heads, kv_heads, inv_freq, rows, positions, k_dst, v_dst, q_weight=None,
      k_weight=None, eps=1e-6):
    return x.new_empty((x.shape[0], heads, 2 * inv_freq.shape[0]))


def _compile_cases():
    """Qwen3-8B's decode shapes at one rank (hidden 4096, 32 + 2 x 8 heads of 128, intermediate 12288), bf16 and
    fp32: the tl.dot path at M = 1 and 16 rows in a block (16 rows) and 64, split-K and not; the dot-free path at 1
    row (wide column runs, two heads a QKV program) and 8 (on 8 warps); a Llama-shaped QKV without the q/k norm."""
    out = []
    dot = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True)
    fma = dict(block_n=128, block_k=32, num_warps=4, num_stages=3, dot=False)  # two heads a QKV program
    fma8 = dict(block_n=64, block_k=32, num_warps=8, num_stages=4, dot=False)  # 8 rows: 128 accumulators a thread
    for t, ieee in (("*bf16", False), ("*fp32", True)):
        for s, block_m, split in ((dot, 16, 8), (dot, 16, 1), (dot, 64, 2), (fma, 1, 4), (fma8, 8, 1)):
            common = dict(SPLIT=split, BLOCK_M=block_m, BLOCK_K=s["block_k"], STAGES=s["num_stages"], EVEN_K=True,
                          IEEE=ieee, DOT=s["dot"], K_MAJOR=False)
            options = dict(num_warps=s["num_warps"])
            out.append((linear_residual_kernel,
                        dict(x=t, w=t, residual=t, out=t, partial="*fp32", counter="*i32", M="i32", K="i32", N="i32",
                             KB="i32", BPS="i32"),
                        dict(**common, BLOCK_N=s["block_n"], EVEN_N=True), dict(options, divisible=("K", "N"))))
            if t == "*bf16":  # at 2 and 8 ranks
                for world in (2, 8):
                    out.append((linear_residual_ar_kernel,
                                dict(x=t, w=t, residual=t, out=t, partial="*fp32", counter="*i32", ll="*i64",
                                     epochs="*i64", heap="*i64", sig="*i64", err="*i64", fp="i32", M="i32", K="i32",
                                     N="i32", KB="i32", BPS="i32", ll_half="i32"),
                                dict(WORLD=world, **common, BLOCK_N=s["block_n"], EVEN_N=True),
                                dict(options, divisible=("K", "N"))))
            out.append((norm_gate_up_silu_kernel,
                        dict(x=t, norm_w=t, w=t, out=t, partial="*fp32", counter="*i32", M="i32", K="i32", I="i32",
                             KB="i32", BPS="i32", eps="fp32"),
                        dict(**common, BLOCK_N=s["block_n"], EVEN_N=True),
                        dict(options, divisible=("K", "I"))))
            for qk_norm, k_major in ((True, False), (False, False), (True, True)):  # K-major: the model's QKV
                out.append((norm_qkv_rope_kernel,
                            dict(x=t, norm_w=t, w=t, q_out=t, k_dst=t, v_dst=t, rows="*i64", positions="*i64",
                                 inv_freq="*fp32", q_weight=t, k_weight=t, partial="*fp32", counter="*i32", M="i32",
                                 K="i32", KB="i32", BPS="i32", eps="fp32", dst_sb="i64", dst_sp="i64", dst_sh="i64"),
                            dict(HEADS=32, KV_HEADS=8, HALF=64, QK_NORM=qk_norm, **dict(common, K_MAJOR=k_major),
                                 HALF_P=64, HEADS_P=s["block_n"] // 64),
                            dict(options, divisible=("K",))))
    return out


COMPILE_CASES = _compile_cases()
