"""Grouped GEMM: every expert's rows times its own weights, in one persistent kernel.

grouped_gemm(x, w, counts): out[e, :counts[e]] = x[e, :counts[e]] @ w[e], x (E, C, K) holding each expert's
rows (C of them, the first counts[e] valid: what the EP dispatches give), counts read on the device (no host
sync). Only the tiles under each expert's count are dealt out, round-robin to a persistent grid, and within an
expert GROUP_M row blocks are walked column by column, so that the weights are read from memory once.

- bf16 / fp16 / fp32: grouped_gemm_tma_kernel runs the dense GEMM's mainloop (gemm.py: TMA loads from one host
  descriptor per operand, x as (E C, K) and w as (E K, N), pipelined; the output's 3-D descriptor clips each
  expert's tile at its capacity). Where TMA cannot take the operands (rows not whole 16 bytes, K not whole
  BLOCK_Ks, unaligned) the plan takes grouped_gemm_kernel, pointer loads through group_tile (the tile
  tp's grouped GEMMs use, whose rows are gathered by token).
- fp8 e4m3 with block scales (DeepSeek-V3's recipe, what ep_dispatch_ll(fp8=True) delivers): x with one fp32
  scale per row and 128 channels, w with one per 128 x 128 block, stored K-major (the nn.Linear layout, which
  Hopper's fp8 MMA takes for its second operand). grouped_gemm_fp8_kernel multiplies a 128-channel slice at
  a time in fp8 and adds it to the fp32 accumulator scaled by both operands' scales, so every slice is
  promoted to full precision. fp8_blocks quantizes the weights, pointwise.fp8_rows the activations, as the
  dispatch does (amax / 448 per block).

scripts/probe_grouped_gemm.py sweeps the configs against torch._grouped_mm.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import tuning
from ..blocks import cast
from ..common import Launch, Plan, check_tensor, plan, signature, world_or_raise
from ..gemm import GemmConfig, descriptor, dot, num_sms, tile_of
from ..registry import declare_op

FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128  # channels a scale covers (and rows of w, per 128 x 128 block)
FP8_MAX = 448.0  # e4m3's largest finite value


@triton.jit
def group_tile(a, pairs, w, out, a_row0, a_rows, out_row0, row0, rows, e, pm, pn, N, K,
               GATHER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               A_TMA: tl.constexpr = False, W_TMA: tl.constexpr = False):
    """One tile of a grouped GEMM: row block pm x column block pn of a segment of rows (rows [row0, row0 + rows),
    all of expert e): out[out_row0 + row, cols] = (A row) @ w[e][:, cols], fp32 accumulation rounded to
    out's dtype. A row: row a_row0 + pairs[row] // TOP_K of `a` (GATHER: a token picked by a (token, expert)
    pair index, kept in [0, a_rows): the pair index may be what a peer sent), else row a_row0 + row. a (·, K),
    w (E, K, N), out (·, N) row-major.
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
            src = a_row0 + tl.minimum(tl.maximum(tl.load(pairs + row) // TOP_K, 0), a_rows - 1)
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


@triton.jit
def _expert_tiles(counts, experts, capacity, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_E: tl.constexpr, ROUTED: tl.constexpr = False):
    """The tiles under each expert's count, numbered expert after expert: per expert (a BLOCK_E vector) its
    rows, row blocks and first tile; and the tiles in all. ROUTED: `counts` are segment starts (expert e's
    rows are [counts[e], counts[e + 1]) of a flat row space), not counts."""
    s = tl.arange(0, BLOCK_E)
    if ROUTED:
        rows = tl.load(counts + s + 1, mask=s < experts, other=0) - tl.load(counts + s, mask=s < experts, other=0)
    else:
        rows = tl.minimum(tl.maximum(tl.load(counts + s, mask=s < experts, other=0), 0), capacity)
    blocks = (rows + BLOCK_M - 1) // BLOCK_M
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_tile = (tl.cumsum(blocks, axis=0) - blocks) * tiles_n
    return rows, blocks, first_tile, tl.sum(blocks, axis=0) * tiles_n


@triton.jit
def _tile_of_expert(tile, experts, rows, blocks, first_tile, N, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """(expert, its rows, row block, column block) of the tile-th tile: within an expert, GROUP_M row blocks
    are walked column by column (gemm.tile_of), so the programs at work at once share w[e]'s column blocks
    (read from memory once, then from L2) and an expert's rows stay in L2 across its column blocks."""
    s = tl.arange(0, BLOCK_E)
    e = tl.sum(((first_tile <= tile) & (s < experts)).to(tl.int32), axis=0) - 1  # empty experts share a start
    this = s == e
    pm, pn = tile_of(tile - tl.sum(tl.where(this, first_tile, 0), axis=0), tl.sum(tl.where(this, blocks, 0), axis=0),
                     tl.cdiv(N, BLOCK_N), GROUP_M)
    return e, tl.sum(tl.where(this, rows, 0), axis=0), pm, pn


@triton.jit
def grouped_gemm_tma_kernel(x_desc, w_desc, out_desc, counts, experts, capacity, N, K, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            BLOCK_E: tl.constexpr, NUM_STAGES: tl.constexpr, PROGRAMS: tl.constexpr,
                            FLATTEN: tl.constexpr):
    """out[e, m] = x[e, m] @ w[e] for m < counts[e], the dense GEMM's mainloop (gemm.py) on grouped tiles.

    Operands arrive by TMA: x as (E C, K) at row e C + m, w as (E K, N) at row e K + k (K is whole BLOCK_Ks,
    so a K block never reaches into w[e + 1]); out is (E, C, N), whose descriptor clips a tile's stores at the
    expert's capacity. A tile's rows past counts[e] read whatever follows (the next expert's rows, or zeros
    past the end): a row of the product depends only on the same row of x, so they change only rows past the
    count, which are left undefined. FLATTEN as in gemm.matmul_kernel.
    """
    rows, blocks, first_tile, tiles = _expert_tiles(counts, experts, capacity, N, BLOCK_M, BLOCK_N, BLOCK_E)
    k_tiles = K // BLOCK_K
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN):
        e, _, pm, pn = _tile_of_expert(tile, experts, rows, blocks, first_tile, N, BLOCK_N, BLOCK_E, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.range(k_tiles, num_stages=NUM_STAGES):
            a = x_desc.load([e * capacity + pm * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([e * K + k * BLOCK_K, pn * BLOCK_N])
            acc = dot(a, b, acc)
        out_desc.store([e, pm * BLOCK_M, pn * BLOCK_N], cast(acc, out_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))


@triton.jit
def grouped_gemm_kernel(x, w, out, counts, experts, capacity, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
                        NUM_STAGES: tl.constexpr, PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr,
                        EVEN_N: tl.constexpr):
    """grouped_gemm_tma_kernel's product with pointer loads (group_tile), for the shapes TMA cannot
    take: rows not whole 16 bytes, K not whole BLOCK_Ks, operands not 16-byte aligned."""
    rows, blocks, first_tile, tiles = _expert_tiles(counts, experts, capacity, N, BLOCK_M, BLOCK_N, BLOCK_E)
    for tile in range(tl.program_id(0), tiles, PROGRAMS):
        e, n, pm, pn = _tile_of_expert(tile, experts, rows, blocks, first_tile, N, BLOCK_N, BLOCK_E, GROUP_M)
        group_tile(x, x, w, out, 0, 0, 0, e * capacity, n, e, pm, pn, N, K, False, 1, BLOCK_M, BLOCK_N, BLOCK_K,
                   NUM_STAGES, EVEN_K, EVEN_N)


@triton.jit
def grouped_gemm_fp8_kernel(x, w_desc, out, x_scales, w_scales, counts, experts, capacity, N, K,
                            ws_e, ws_k, ws_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr, NUM_STAGES: tl.constexpr,
                            PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, OUT_TMA: tl.constexpr,
                            ROUTED: tl.constexpr, GATHER: tl.constexpr, TOP_K: tl.constexpr):
    """out[e, m, n] = sum over 128-channel blocks b of (x[e, m, b] @ w[e, b, n]) * x_scales[e, m, b] *
    w_scales[e, b, n // 128] for m < counts[e] (fp8 e4m3 operands, fp32 accumulation, out rounded to its dtype).

    x arrives by TMA as (E C, K) fp8 at row e C + m; w as (E N, K), K-major, at row e N + n (the layout of
    Hopper's fp8 MMA's second operand): a block of columns past N reads the next expert's (or zeros), which
    only changes columns past N, never stored. A BLOCK_K slice lies within one 128-channel block (BLOCK_K
    divides 128): its product goes to the accumulator scaled by that block's scales, a full-precision add per
    slice. BLOCK_N divides 128 too, so a tile's columns share one weight scale: a slice's scale is a vector over
    the rows, one FMA per accumulator element (the product of a row and a column vector of scales took a
    multiply more per element, and 241 registers against 181 at 128x128). x_scales (E, C, K / 128) contiguous;
    w_scales (E, K / 128, cdiv(N, 128)) with strides ws_e, ws_k, ws_n.
    Rows past counts[e] are not scaled (NaN there stays in its row). OUT_TMA: out is a descriptor of (E, C, N),
    which clips a tile at the expert's capacity, as in grouped_gemm_tma_kernel (else a pointer, for N rows not
    whole 16 bytes: its tile of addresses spills 292 bytes at the GPU config, ptxas says; the TMA store none).

    ROUTED (routed_gemm's fp8 form; OUT_TMA off): `counts` is a GroupLayout chunk (group_layout): starts (E + 2),
    then pair_of_row; expert e's rows are [starts[e], starts[e + 1]) of a flat row space of `capacity` rows (x,
    x_scales and out as (rows, ·)). GATHER (with ROUTED; routed_gemm): x is a pointer to the tokens (·, K) and
    x_scales (·, K / 128) theirs, row i computes token pair_of_row[i] // TOP_K (pointer loads: Hopper's TMA has
    no gather), and the rows from starts[E] on (the pairs without expert) are stored as zeros, routed_gemm's
    output; without it (routed_gemm_sum's y, read only at routed rows) they are left alone, as in
    tp._chunk_tiles.
    """
    rows, blocks, first_tile, tiles = _expert_tiles(counts, experts, capacity, N, BLOCK_M, BLOCK_N, BLOCK_E, ROUTED)
    k_tiles = K // BLOCK_K
    groups = K // 128
    kk = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN):
        e, n_rows, pm, pn = _tile_of_expert(tile, experts, rows, blocks, first_tile, N, BLOCK_N, BLOCK_E, GROUP_M)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        if ROUTED:
            row0 = tl.load(counts + e)
        else:
            row0 = e * capacity
        # int64: E C K/128 scales may pass 2^31 words
        if GATHER:  # dead rows read the segment's first token: in bounds, never stored
            src = (tl.load(counts + experts + 2 + row0 + tl.where(rm < n_rows, rm, 0)) // TOP_K).to(tl.int64)
            row_scales = x_scales + src * groups
            a_ptrs = x + src[:, None] * K + kk[None, :]
        else:
            row_scales = x_scales + (row0 + rm).to(tl.int64) * groups
        col_scale = w_scales + e.to(tl.int64) * ws_e + (pn * BLOCK_N // 128) * ws_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.range(k_tiles, num_stages=NUM_STAGES):
            if GATHER:
                a = tl.load(a_ptrs + k * BLOCK_K)
            else:
                a = x.load([row0 + pm * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([e * N + pn * BLOCK_N, k * BLOCK_K])
            g = k * BLOCK_K // 128
            sa = tl.load(row_scales + g, mask=rm < n_rows, other=0.0)
            sb = tl.load(col_scale + g * ws_k)
            acc += dot(a, b.T, tl.zeros([BLOCK_M, BLOCK_N], tl.float32)) * (sa * sb)[:, None]
        if OUT_TMA:
            out.store([e, pm * BLOCK_M, pn * BLOCK_N], cast(acc, out.dtype).reshape(1, BLOCK_M, BLOCK_N))
        else:
            tl.store(out + (row0 + rm).to(tl.int64)[:, None] * N + rn[None, :], cast(acc, out.dtype.element_ty),
                     mask=(rm < n_rows)[:, None] & (rn < N)[None, :])
    if GATHER:  # the pairs without expert: zeros
        lo = tl.load(counts + experts)
        hi = tl.load(counts + experts + 1)
        for blk in range(tl.program_id(0), tl.cdiv(hi - lo, BLOCK_M), PROGRAMS):
            r = lo + blk * BLOCK_M + tl.arange(0, BLOCK_M)
            for n0 in range(0, N, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                tl.store(out + r.to(tl.int64)[:, None] * N + cols[None, :],
                         tl.zeros([BLOCK_M, BLOCK_N], out.dtype.element_ty),
                         mask=(r < hi)[:, None] & (cols < N)[None, :])


GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8)

# The GPU configs are tuning data (weft.tuning, with the sweeps they came from: scripts/probe_grouped_gemm.py):
# grouped_gemm.configs by name ("large": the dense GEMM's 128x256x64 tiles, flattened loop; "skinny": 64-row blocks
# with the tile and K loops fused, for experts of at most 128 rows and for callers whose experts hold a few rows of
# a larger buffer (grouped_gemm.few_rows_config: EPMoE's decode); "fp32": small tiles whose stages and output tile
# fit in shared memory; "fp8": 128-channel K slices, one scale each, 64 x 128 tiles of one warp group, 2 programs
# per SM so that one program's MMAs run while the other scales its last slice), grouped_gemm.pointer_config (the
# pointer kernel's, for shapes TMA cannot take). flatten applies to the TMA kernels alone.
CPU_CONFIG = GemmConfig(16, 32, 32, 2, 1, 4, False)


def gpu_configs(device: torch.device) -> dict[str, GemmConfig]:
    """The grouped GEMM's GPU configs by name for `device`'s GPU model (weft.tuning grouped_gemm.configs)."""
    return {name: GemmConfig(**fields) for name, fields in tuning.value("grouped_gemm.configs", device).items()}


def grouped_config(capacity: int, dtype: torch.dtype, device: torch.device, tma: bool) -> GemmConfig:
    """The default config of a grouped GEMM of experts of `capacity` rows on `device`."""
    if device.type != "cuda":
        return CPU_CONFIG
    if not tma and dtype != FP8:
        return GemmConfig(**tuning.value("grouped_gemm.pointer_config", device))
    configs = gpu_configs(device)
    if dtype == FP8:
        return configs["fp8"]
    if dtype == torch.float32:
        return configs["fp32"]
    return configs["skinny" if capacity <= 128 else "large"]


def few_rows_config(dtype: torch.dtype, device: torch.device) -> GemmConfig | None:
    """The config for experts that hold a few rows of a larger buffer (an EP decode step's receive buffers:
    ~8-32 valid rows of W x 128), whatever the capacity, where it is not the default anyway (None there)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return gpu_configs(device)[tuning.value("grouped_gemm.few_rows_config", device)]


def tma_refusal(x: torch.Tensor, w: torch.Tensor, block_k: int) -> str | None:
    """Why the TMA kernel cannot take x (E, C, K) and w (E, K, N) (contiguous, one dtype), or None."""
    size = x.element_size()
    for name, t in (("x", x), ("w", w)):
        if t.data_ptr() % 16:
            return f"{name} does not start 16-byte aligned"
    for name, cols in (("K", x.shape[2]), ("N", w.shape[2])):
        if cols * size % 16:
            return f"{name} = {cols} is not a multiple of 16 bytes"
    if x.shape[2] % block_k:
        return f"K = {x.shape[2]} is not a multiple of BLOCK_K = {block_k} (a K block would reach the next expert)"
    return None


@declare_op()
def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights w (E, K, N) quantized to fp8 e4m3 per 128 x 128 block, in the layout grouped_gemm takes: (q (E, K,
    N) e4m3 whose K dimension is contiguous (a transposed (E, N, K) tensor), scales (E, K / 128, cdiv(N, 128))
    fp32, scale = max(amax, 1e-4) / 448 per block)."""
    e, k, n = w.shape
    if k % FP8_BLOCK:
        raise ValueError(f"w's K ({k}) must be a multiple of {FP8_BLOCK} to quantize in {FP8_BLOCK}-row blocks")
    nb = triton.cdiv(n, FP8_BLOCK)
    padded = torch.zeros((e, k, nb * FP8_BLOCK), dtype=torch.float32, device=w.device)
    padded[..., :n] = w.float()
    g = padded.reshape(e, k // FP8_BLOCK, FP8_BLOCK, nb, FP8_BLOCK)
    scales = g.abs().amax(dim=(2, 4)).clamp(min=1e-4) / FP8_MAX
    q = (g / scales[:, :, None, :, None]).reshape(e, k, nb * FP8_BLOCK)[..., :n]
    return q.transpose(1, 2).contiguous().to(FP8).transpose(1, 2), scales


@declare_op()
def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, config: GemmConfig | None = None,
                 x_scales: torch.Tensor | None = None, w_scales: torch.Tensor | None = None) -> torch.Tensor:
    """out (E, C, N) with out[e, :counts[e]] = x[e, :counts[e]] @ w[e] (fp32 accumulation); rows past
    counts[e] are left undefined. Local (not collective); counts (E,) int32 on the device (read there: no host
    sync). `config` (a gemm.GemmConfig) overrides the default tiling (for tuning).

    bf16 / fp16 / fp32: x (E, C, K), w (E, K, N) of one dtype, contiguous; out of that dtype. The TMA kernel
    where the operands allow it (16-byte aligned, K and N rows of whole 16 bytes, K a multiple of BLOCK_K),
    else pointer loads.

    fp8 (x and w torch.float8_e4m3fn, with both scales; out bf16): x (E, C, K) contiguous with x_scales (E, C,
    K / 128) fp32 (per row and 128 channels: ep_dispatch_ll(fp8=True)'s recv and scales, or fp8_rows); w (E, K,
    N) with its K dimension contiguous (a transposed contiguous (E, N, K): the nn.Linear layout) with w_scales
    (E, K / 128, cdiv(N, 128)) fp32 per 128 x 128 block, any strides (fp8_blocks makes both). K a multiple of
    128. out = sum over 128-channel blocks of the fp8 product times both scales.
    """
    world = world_or_raise()
    found = plan(world, lambda: ("grouped_gemm", signature(x), signature(w), signature(counts), config,
                                 None if w_scales is None else (signature(x_scales), signature(w_scales),
                                                                w.stride(), w_scales.stride())),
                 lambda: _GroupedGemmPlan(world, x, w, counts, config, x_scales, w_scales))
    return found.run(x, w, counts, x_scales, w_scales)


# What a caller may pass as `config` (EPMoE's decode: experts holding a few rows of a larger buffer).
grouped_gemm.few_rows_config = few_rows_config


# -- the operators (inference) ---------------------------------------------------------------------------------
#   torch.ops.weft.grouped_gemm(x, w, counts, config, x_scales, w_scales) -> out (E, C, N)
#       config: None, or a GemmConfig's fields as a list of ints (dataclasses.astuple)
#   torch.ops.weft.fp8_blocks(w) -> (q (E, K, N) K-major, scales)

@grouped_gemm.define
def grouped_gemm_op(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, config: Optional[list[int]] = None,
                    x_scales: Optional[torch.Tensor] = None, w_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    return grouped_gemm.eager(x, w, counts, None if config is None else GemmConfig(*config), x_scales, w_scales)


@grouped_gemm_op.register_fake
def _(x, w, counts, config=None, x_scales=None, w_scales=None):
    return x.new_empty((x.shape[0], x.shape[1], w.shape[2]), dtype=torch.bfloat16 if x.dtype == FP8 else x.dtype)


@grouped_gemm.traced
def _(x, w, counts, config=None, x_scales=None, w_scales=None):
    fields = None if config is None else [int(v) for v in dataclasses.astuple(config)]
    return torch.ops.weft.grouped_gemm(x, w, counts, fields, x_scales, w_scales)


@fp8_blocks.define
def fp8_blocks_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_blocks.eager(w)


@fp8_blocks_op.register_fake
def _(w):
    e, k, n = w.shape
    q = w.new_empty((e, n, k), dtype=FP8).transpose(1, 2)
    return q, w.new_empty((e, k // FP8_BLOCK, -(-n // FP8_BLOCK)), dtype=torch.float32)


def check_fp8_operands(world, x_name: str, x, x_scales, w_name: str, w, w_scales) -> None:
    """fp8 operands with block scales, checked before anything runs: x (..., K) with x_scales (..., K / 128) fp32
    contiguous; w (E, K, N) with its K dimension contiguous with w_scales (E, K / 128, cdiv(N, 128)) fp32."""
    k, n = x.shape[-1], w.shape[2]
    if k % FP8_BLOCK:
        raise ValueError(f"fp8 {x_name} needs K a multiple of {FP8_BLOCK} (a scale per {FP8_BLOCK} channels), "
                         f"got K = {k}")
    if not w.transpose(1, 2).is_contiguous():
        raise ValueError(f"{w_name} (fp8) must have its K dimension contiguous: the transpose of a contiguous (E, N, "
                         f"K) tensor (w_nk.transpose(1, 2)), got strides {tuple(w.stride())}")
    for name, s, shape, contiguous in (("x_scales", x_scales, (*x.shape[:-1], k // FP8_BLOCK), True),
                                       ("w_scales", w_scales, (w.shape[0], k // FP8_BLOCK, triton.cdiv(n, FP8_BLOCK)),
                                        False)):
        if s is None:
            raise ValueError(f"fp8 {x_name} and {w_name} need {name}")
        check_tensor(name, s, world, dtypes=(torch.float32,), contiguous=contiguous)
        if tuple(s.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(s.shape)}")


def fp8_tma_aligned(x, w, realign: tuple) -> tuple:
    """fp8 x and w (K-major) as TMA takes them: a copy of each operand `realign` says does not start 16-byte
    aligned."""
    if realign[0]:
        x = x.clone()
    if realign[1]:
        w = w.transpose(1, 2).clone().transpose(1, 2)
    return x, w


def _check_fp8(world, x, w, x_scales, w_scales, config) -> None:
    """The fp8 operands' layout and scales (grouped_gemm's doc), checked before anything runs."""
    check_fp8_operands(world, "x", x, x_scales, "w", w, w_scales)
    if config is not None:
        for name, block, what in (("block_k", config.block_k, "a K slice"), ("block_n", config.block_n, "a tile")):
            if FP8_BLOCK % block:
                raise ValueError(f"config.{name} must divide {FP8_BLOCK} for fp8 ({what} within one scale block), "
                                 f"got {block}")


class _GroupedGemmPlan(Plan):
    """grouped_gemm of one signature: the checks, the tiling, the launch; `run` runs a call."""

    def __init__(self, world, x, w, counts, config, x_scales=None, w_scales=None):
        super().__init__(world)
        check_tensor("x", x, world, dtypes=GEMM_DTYPES)
        self.fp8 = x.dtype == FP8
        check_tensor("w", w, world, dtypes=GEMM_DTYPES, contiguous=not self.fp8)
        check_tensor("counts", counts, world, dtypes=(torch.int32,))
        if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
            raise ValueError(f"x must be (E, C, K) and w (E, K, N), got {tuple(x.shape)} and {tuple(w.shape)}")
        if x.dtype != w.dtype:
            raise TypeError(f"x and w must have the same dtype, got {x.dtype} and {w.dtype}")
        if tuple(counts.shape) != (x.shape[0],):
            raise ValueError(f"counts must be ({x.shape[0]},), got {tuple(counts.shape)}")
        if config is not None and not isinstance(config, GemmConfig):
            raise TypeError(f"config must be a weft.kernels.gemm.GemmConfig, got {type(config).__name__}")
        if self.fp8:
            _check_fp8(world, x, w, x_scales, w_scales, config)
        elif x_scales is not None or w_scales is not None:
            raise ValueError(f"x_scales and w_scales go with fp8 operands (torch.float8_e4m3fn), not {x.dtype}")
        self.e, self.c, self.k = e, c, k = x.shape
        self.n = n = w.shape[2]
        self.out_dtype = torch.bfloat16 if self.fp8 else x.dtype
        self.out_shape = (e, c, n)
        self.empty = e == 0 or c == 0 or n == 0
        block_k = (config or grouped_config(c, x.dtype, world.device, True)).block_k
        # fp8 always by TMA: K is whole 128s (rows of whole 16 bytes); an unaligned operand is copied per call.
        self.tma = not self.empty and k > 0 and (self.fp8 or tma_refusal(x, w, block_k) is None)
        cfg = self.config = config or grouped_config(c, x.dtype, world.device, self.tma)
        tiles = e * triton.cdiv(c, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        self.programs = max(1, min(num_sms(world.device) * cfg.programs_per_sm, tiles))
        common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      BLOCK_E=triton.next_power_of_2(max(e, 1)), NUM_STAGES=cfg.num_stages, PROGRAMS=self.programs)
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=x.device)
        self.launch = self.x_desc = self.w_desc = self.out_desc = None
        if self.fp8 and self.tma:
            self.realign = x.data_ptr() % 16 != 0, w.data_ptr() % 16 != 0
            x, w = self._aligned(x, w)
            self.x_desc = descriptor(x.view(e * c, k), (cfg.block_m, cfg.block_k))
            self.w_desc = descriptor(w.transpose(1, 2).reshape(e * n, k), (cfg.block_n, cfg.block_k))
            out_tma = n * out.element_size() % 16 == 0
            self.out_desc = descriptor(out, (1, cfg.block_m, cfg.block_n)) if out_tma else None
            self.launch = Launch(grouped_gemm_fp8_kernel, (self.programs,),
                                 (self.x_desc, self.w_desc, self._out(out), x_scales, w_scales, counts, e, c, n, k,
                                  *w_scales.stride()),
                                 dict(**common, FLATTEN=cfg.flatten, OUT_TMA=out_tma, ROUTED=False, GATHER=False,
                                      TOP_K=1),
                                 cfg.num_warps)
            self._off()
        elif self.tma:
            # One descriptor per operand, its base swapped per call (gemm.Descriptor).
            self.x_desc = descriptor(x.view(e * c, k), (cfg.block_m, cfg.block_k))
            self.w_desc = descriptor(w.view(e * k, n), (cfg.block_k, cfg.block_n))
            self.out_desc = descriptor(out, (1, cfg.block_m, cfg.block_n))
            self.launch = Launch(grouped_gemm_tma_kernel, (self.programs,),
                                 (self.x_desc, self.w_desc, self.out_desc, counts, e, c, n, k),
                                 dict(**common, FLATTEN=cfg.flatten),
                                 cfg.num_warps)
            self._off()
        elif not self.empty:
            self.launch = Launch(grouped_gemm_kernel, (self.programs,), (x, w, out, counts, e, c, n, k),
                                 dict(**common, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0),
                                 cfg.num_warps)

    def _out(self, out):
        """The output as the kernel takes it: the plan's descriptor on it, or the tensor."""
        return out if self.out_desc is None else self.out_desc.on(out)

    def _off(self) -> None:
        """Let go of the call's tensors (gemm.Descriptor): the plan keeps none between calls."""
        for d in (self.x_desc, self.w_desc, self.out_desc):
            if d is not None:
                d.off()

    def _aligned(self, x, w):
        return fp8_tma_aligned(x, w, self.realign)

    def run(self, x, w, counts, x_scales=None, w_scales=None):
        e, c, n, k = self.e, self.c, self.n, self.k
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=x.device)
        if self.fp8 and self.tma:
            x, w = self._aligned(x, w)
            self.launch(self.x_desc.on(x.view(e * c, k)), self.w_desc.on(w.transpose(1, 2).reshape(e * n, k)),
                        self._out(out), x_scales, w_scales, counts, e, c, n, k, *w_scales.stride())
            self._off()
        elif self.tma:
            self.launch(self.x_desc.on(x.view(e * c, k)), self.w_desc.on(w.view(e * k, n)), self.out_desc.on(out),
                        counts, e, c, n, k)
            self._off()
        elif self.launch is not None:
            self.launch(x, w, out, counts, e, c, n, k)
        elif self.fp8 and not self.empty:  # K = 0: nothing to add up
            out.zero_()
        return out


# Signatures for the sm_90 compile check (weft.testing.compile).
# The compile check's configs: every one of the shipped tables (by name; the first table's where names repeat).
_SHIPPED = {name: GemmConfig(**fields) for configs in reversed(tuning.shipped("grouped_gemm.configs"))
            for name, fields in configs.items()}
COMPILE_CASES = [
    (grouped_gemm_kernel, dict(x=t, w=t, out=t, counts="*i32", experts="i32", capacity="i32", N="i32", K="i32"),
     dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, BLOCK_E=32, NUM_STAGES=4, PROGRAMS=132, EVEN_K=even,
          EVEN_N=even), dict(num_warps=4, divisible=("capacity", "N", "K") if even else ()))  # the JIT's view
    for t in ("*bf16", "*fp16", "*fp32") for even in (True, False)
] + [
    (grouped_gemm_tma_kernel,
     dict(x_desc=f"tensordesc<{t}[{c.block_m}, {c.block_k}]>", w_desc=f"tensordesc<{t}[{c.block_k}, {c.block_n}]>",
          out_desc=f"tensordesc<{t}[1, {c.block_m}, {c.block_n}]>", counts="*i32", experts="i32", capacity="i32",
          N="i32", K="i32"),
     dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, BLOCK_E=128,
          NUM_STAGES=c.num_stages, PROGRAMS=132, FLATTEN=c.flatten),
     dict(num_warps=c.num_warps, min_arch=90))
    for name, c in _SHIPPED.items() if not name.startswith("fp8")
    for t in (("fp32",) if name == "fp32" else ("bf16", "fp16"))
] + [
    (grouped_gemm_fp8_kernel,
     dict(x=f"tensordesc<fp8e4nv[{c.block_m}, {c.block_k}]>",
          w_desc=f"tensordesc<fp8e4nv[{c.block_n}, {c.block_k}]>",
          out=f"tensordesc<bf16[1, {c.block_m}, {c.block_n}]>" if out_tma else "*bf16", x_scales="*fp32",
          w_scales="*fp32", counts="*i32", experts="i32", capacity="i32", N="i32", K="i32", ws_e="i32", ws_k="i32",
          ws_n="i32"),
     dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, BLOCK_E=128,
          NUM_STAGES=c.num_stages, PROGRAMS=132, FLATTEN=c.flatten, OUT_TMA=out_tma, ROUTED=False, GATHER=False,
          TOP_K=1),
     dict(num_warps=c.num_warps, min_arch=90, divisible=("N", "K") if out_tma else ("K",)))
    for name, c in _SHIPPED.items() if name.startswith("fp8") for out_tma in (True, False)
] + [  # routed_gemm's fp8 form (routed): the tokens gathered by pair, or h's rows by TMA
    (grouped_gemm_fp8_kernel,
     dict(x="*fp8e4nv" if gather else f"tensordesc<fp8e4nv[{c.block_m}, {c.block_k}]>",
          w_desc=f"tensordesc<fp8e4nv[{c.block_n}, {c.block_k}]>", out="*bf16", x_scales="*fp32", w_scales="*fp32",
          counts="*i32", experts="i32", capacity="i32", N="i32", K="i32", ws_e="i32", ws_k="i32", ws_n="i32"),
     dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, BLOCK_E=64,
          NUM_STAGES=c.num_stages, PROGRAMS=264, FLATTEN=c.flatten, OUT_TMA=False, ROUTED=True, GATHER=gather,
          TOP_K=8), dict(num_warps=c.num_warps, min_arch=90, divisible=("K",)))
    for c in (_SHIPPED["fp8"],) for gather in (True, False)
]
