"""The pointwise work of a decoder layer, fused: one kernel each where torch runs five to twenty.

- rms_norm(x, weight, eps, residual): the residual add and the RMSNorm after it (transformers' order of
  roundings: the sum rounded to x's dtype, the norm in fp32, rounded before the weight multiplies it);
- silu_mul(h, counts, fp8): silu(gate) * up of the fused gate/up projection's output [gate | up], optionally
  only the valid rows of each expert (a grouped GEMM's output) and quantized to fp8 per 128 channels;
- fp8_rows(x, counts): rows quantized to fp8 e4m3 per 128 channels (DeepSeek-V3's activations; the same kernel);
- qk_norm_rope(qkv, ...): from the fused QKV projection's output, per token: q and k heads RMS-normed over
  head_dim (Qwen3), rotated by the rotary embedding of the token's position (cos and sin rounded to the
  dtype as transformers does), q written out, k and v written straight into their KV-cache slots.

A decode step of a Qwen3-8B-shaped layer is ~50 kernels of a few µs in torch; with these, 10 (its GEMMs,
attention and collectives included). The kernels are memory-bound and simple: a program handles BLOCK_R
rows (tokens); on GPUs one, under the interpreter (cpu) many, since the interpreter's cost is per operation,
not per element.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .blocks import cast, fp8_quantize
from .common import Launch, Plan, plan, signature, world_or_raise
from .registry import declare_op

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Rows x columns a program of silu_mul / fp8_rows takes on GPUs.
SILU_BLOCK = (4, 1024)
FP8_BLOCK = 128  # channels an fp8 scale covers
# Rows (tokens) per program under the interpreter.
CPU_ROWS = 16


# -- kernels --------------------------------------------------------------------

@triton.jit
def rms_norm_kernel(x, residual, weight, out, res_out, rows, cols, eps, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out = weight * norm(s), s = x (+ residual, rounded; written to res_out), rows [pid BLOCK_R, +BLOCK_R)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None].to(tl.int64)
    c = tl.arange(0, BLOCK_C)[None, :]
    mask = (r < rows) & (c < cols)
    s = tl.load(x + r * cols + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        s = cast(s.to(tl.float32) + tl.load(residual + r * cols + c, mask=mask, other=0.0).to(tl.float32),
                 out.dtype.element_ty)
        tl.store(res_out + r * cols + c, s, mask=mask)
    h = s.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=1) / cols + eps)[:, None]
    w = tl.load(weight + c, mask=c < cols, other=0.0)
    y = cast(cast(h, out.dtype.element_ty).to(tl.float32) * w.to(tl.float32), out.dtype.element_ty)
    tl.store(out + r * cols + c, y, mask=mask)


@triton.jit
def silu_mul_kernel(h, out, scales, counts, capacity, blocks, cols, GATED: tl.constexpr, FP8: tl.constexpr,
                    COUNTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [b BLOCK_R, +BLOCK_R) of group g's `capacity` rows (g, b = divmod(pid0, blocks)), columns
    [pid1 BLOCK_C, +BLOCK_C) of out: GATED, silu(gate) * up of h's rows [gate | up] (each rounded to h's dtype, as
    torch rounds F.silu(gate) * up), else h's rows themselves; FP8, quantized per 128 channels as fp8_rows does
    (blocks.fp8_quantize: the bits of fp8_rows_torch), the scales into scales (rows, cols / 128). COUNTS: the groups are experts and only their first
    counts[g] rows are computed (a block past them ends at once: a decode step's experts hold a few valid rows
    of a large buffer)."""
    pid = tl.program_id(0)
    g = pid // blocks
    first = (pid % blocks) * BLOCK_R
    n = capacity
    if COUNTS:
        n = tl.minimum(tl.load(counts + g), capacity)
    if first < n:
        i = first + tl.arange(0, BLOCK_R)
        r = (g.to(tl.int64) * capacity + i)[:, None]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        mask = (i[:, None] < n) & (c < cols)
        dt = h.dtype.element_ty
        if GATED:
            gate = tl.load(h + r * 2 * cols + c, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h + r * 2 * cols + cols + c, mask=mask, other=0.0).to(tl.float32)
            y = cast(cast(gate / (1.0 + tl.exp(-gate)), dt).to(tl.float32) * up, dt)
        else:
            y = tl.load(h + r * cols + c, mask=mask, other=0.0)
        if FP8:
            G: tl.constexpr = BLOCK_C // 128
            q, scale = fp8_quantize(tl.reshape(y.to(tl.float32), [BLOCK_R * G, 128]))
            tl.store(out + r * cols + c, tl.reshape(q, [BLOCK_R, BLOCK_C]).to(tl.uint8), mask=mask)
            gg = tl.program_id(1) * G + tl.arange(0, G)[None, :]
            tl.store(scales + r * (cols // 128) + gg, tl.reshape(scale, [BLOCK_R, G]),
                     mask=(i[:, None] < n) & (gg < cols // 128))
        else:
            tl.store(out + r * cols + c, y, mask=mask)


@triton.jit
def _rms_heads(x1, x2, weight, eps, d_mask, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """RMSNorm over head_dim of heads given as halves x1, x2 [R, H, HALF_P] (fp32), weight (head_dim,):
    transformers' roundings (normed, rounded, times the weight, rounded)."""
    j = tl.arange(0, HALF_P)[None, None, :]
    rs = tl.rsqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * HALF) + eps)[:, :, None]
    w1 = tl.load(weight + j, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight + HALF + j, mask=d_mask, other=0.0).to(tl.float32)
    dt = weight.dtype.element_ty
    return (cast(cast(x1 * rs, dt).to(tl.float32) * w1, dt).to(tl.float32),
            cast(cast(x2 * rs, dt).to(tl.float32) * w2, dt).to(tl.float32))


@triton.jit
def _rotate(x1, x2, cos, sin, dt: tl.constexpr):
    """rotate_half form: (x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded to dt as in torch."""
    y1 = cast(x1 * cos, dt).to(tl.float32) - cast(x2 * sin, dt).to(tl.float32)
    y2 = cast(x2 * cos, dt).to(tl.float32) + cast(x1 * sin, dt).to(tl.float32)
    return cast(y1, dt), cast(y2, dt)


@triton.jit
def qk_norm_rope_kernel(qkv, q_out, k_dst, v_dst, rows, positions, inv_freq, q_weight, k_weight, tokens, qkv_stride,
                        dst_sb, dst_sp, dst_sh, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                        HALF: tl.constexpr, HEADS_P: tl.constexpr, KV_P: tl.constexpr, HALF_P: tl.constexpr,
                        NORM: tl.constexpr, BLOCK_R: tl.constexpr):
    """Tokens [pid BLOCK_R, +BLOCK_R) of qkv (tokens, (HEADS + 2 KV_HEADS) 2 HALF): q heads normed (NORM) and
    rotated into q_out (tokens, HEADS, 2 HALF); k heads likewise and v heads as they are into
    k_dst / v_dst[rows[t], positions[t]] (strides dst_sb, dst_sp, dst_sh; head_dim contiguous)."""
    t = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None, None]
    j = tl.arange(0, HALF_P)[None, None, :]
    t_mask = t < tokens
    d_mask = j < HALF
    pos = tl.load(positions + t, mask=t_mask, other=0)
    angle = pos.to(tl.float32) * tl.load(inv_freq + j, mask=d_mask, other=0.0)
    dt = q_out.dtype.element_ty
    cos = cast(tl.cos(angle), dt).to(tl.float32)
    sin = cast(tl.sin(angle), dt).to(tl.float32)
    src = qkv + t.to(tl.int64) * qkv_stride
    # q heads
    h = tl.arange(0, HEADS_P)[None, :, None]
    mask = t_mask & (h < HEADS) & d_mask
    x1 = tl.load(src + h * 2 * HALF + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * 2 * HALF + HALF + j, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _rms_heads(x1, x2, q_weight, eps, d_mask, HALF, HALF_P)
    y1, y2 = _rotate(x1, x2, cos, sin, dt)
    dst = q_out + (t.to(tl.int64) * HEADS + h) * 2 * HALF + j
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)
    # k and v heads, into their cache slots
    h = tl.arange(0, KV_P)[None, :, None]
    mask = t_mask & (h < KV_HEADS) & d_mask
    slot = tl.load(rows + t, mask=t_mask, other=0) * dst_sb + pos * dst_sp + h * dst_sh + j
    k_src = src + (HEADS + h) * 2 * HALF + j
    x1 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_src + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _rms_heads(x1, x2, k_weight, eps, d_mask, HALF, HALF_P)
    y1, y2 = _rotate(x1, x2, cos, sin, dt)
    tl.store(k_dst + slot, y1, mask=mask)
    tl.store(k_dst + slot + HALF, y2, mask=mask)
    v_src = src + (HEADS + KV_HEADS + h) * 2 * HALF + j
    tl.store(v_dst + slot, tl.load(v_src, mask=mask), mask=mask)
    tl.store(v_dst + slot + HALF, tl.load(v_src + HALF, mask=mask), mask=mask)


# -- host side ------------------------------------------------------------------

def _check(name: str, t, dtype=None, dims=None) -> None:
    """TypeError/ValueError naming `name` unless t is a tensor of `dtype` (default: one of DTYPES) and `dims`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = DTYPES if dtype is None else (dtype,)
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {' or '.join(str(d) for d in allowed)}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")


def _rows_per_program(rows: int, device: torch.device) -> int:
    return 1 if device.type == "cuda" else min(CPU_ROWS, triton.next_power_of_2(max(rows, 1)))


@declare_op()
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / sqrt(mean(x²) + eps) over the last dimension (transformers' LlamaRMSNorm). With `residual`
    (x's shape and dtype): s = x + residual first, and returns (norm(s), s), as a pre-norm block's residual
    stream needs them."""
    _check("x", x)
    _check("weight", weight, x.dtype, 1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} elements, x's rows {x.shape[-1]}")
    if residual is not None:
        _check("residual", residual, x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}")
    cols = x.shape[-1]
    rows = x.numel() // max(cols, 1)
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if x.numel():
        block_r = _rows_per_program(rows, x.device)
        block_c = triton.next_power_of_2(cols)
        rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            x, x if residual is None else residual.contiguous(), weight, out, res_out, rows, cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=4 if block_c <= 2048 else 8)
    return out if residual is None else (out, res_out)


@declare_op(tensors=("h",))
def silu_mul(h: torch.Tensor, counts: torch.Tensor | None = None,
             fp8: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of h (..., 2 n) = [gate | up]: (..., n) of h's dtype (bf16, fp16, fp32), rounded as torch
    rounds F.silu(gate) * up, NaN and inf included (NaN in gives NaN; silu(-inf) is NaN, silu(inf) inf).

    counts (E,) int32 on the device: h is (E, C, 2 n), each expert's rows (what grouped_gemm gives), and only
    rows [0, counts[e]) of expert e are computed; the others are left undefined (no host sync; a decode step's
    few valid rows of a large buffer cost only themselves). fp8=True (n a multiple of 128): returns
    fp8_rows(silu_mul(h)) in one pass: (q (..., n) float8_e4m3fn, scales (..., n / 128) fp32), bit for bit."""
    return _rows_op("h", h, counts, fp8, gated=True)


@declare_op()
def fp8_rows(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) quantized to fp8 e4m3 per row and 128 channels, as ep_dispatch_ll(fp8=True) does it: (q (..., K)
    e4m3, scales (..., K / 128) fp32), scale = max(amax, 1e-4) / 448 and q = x / scale rounded to nearest even,
    so x ~ q * scale (fp8_rows_torch: the same bits in torch's ops, NaN where it gives NaN: a group of 128
    holding NaN is all NaN, its scale NaN; one holding inf has scale inf, q 0 but NaN at the inf). counts as in
    silu_mul."""
    return _rows_op("x", x, counts, True, gated=False)


def silu_mul_torch(h: torch.Tensor, fp8: bool = False):
    """silu_mul in torch's own ops (every row: those past counts are left undefined anyway), for calls that torch
    traces or differentiates (weft.ops)."""
    gate, up = h.chunk(2, dim=-1)
    y = F.silu(gate) * up
    return fp8_rows_torch(y) if fp8 else y


def fp8_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_rows in torch's own ops (the same bits): x (..., K) per row and 128 channels, scale = max(amax, 1e-4) /
    448, q = (x / scale) in float8_e4m3fn, both divisions IEEE."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // FP8_BLOCK, FP8_BLOCK)
    amax = g.abs().amax(-1).clamp(min=1e-4)
    # Divided by a tensor, not the number 448: on GPUs torch divides by a number as a product with its rounded
    # reciprocal, 1 ulp off the IEEE quotient that the kernels (and torch on the CPU) compute.
    scales = amax / torch.full_like(amax, 448.0)
    return (g / scales[..., None]).to(torch.float8_e4m3fn).reshape(x.shape), scales


def _rows_op(name, x, counts, fp8, gated):
    world = world_or_raise()  # a local op: its plans are the world's
    found = plan(world, lambda: ("rows", gated, signature(x), None if counts is None else signature(counts), fp8),
                 lambda: RowsPlan(world, name, x, counts, fp8, gated))
    return found.run(x, counts)


class RowsPlan(Plan):
    """silu_mul / fp8_rows of one call signature: the checks, the grid, the compiled launch."""

    def __init__(self, group, name, x, counts, fp8, gated):
        super().__init__(group)
        _check(name, x)
        if x.device != group.device:
            raise ValueError(f"{name} is on {x.device}, but this rank's device is {group.device}")
        if not isinstance(fp8, bool):
            raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
        if x.dim() == 0:
            raise ValueError(f"{name} must have at least one dimension")
        cols = x.shape[-1]
        if gated:
            if cols % 2:
                raise ValueError(f"{name}'s last dimension ({cols}) must be even: [gate | up]")
            cols //= 2
        if fp8 and cols % FP8_BLOCK:
            what = "silu_mul(fp8=True) needs n" if gated else f"{name}'s last dimension"
            raise ValueError(f"{what} ({cols}) must be a multiple of {FP8_BLOCK} to quantize per {FP8_BLOCK} channels")
        if counts is not None:
            _check("counts", counts, torch.int32, 1)
            if counts.device != x.device:
                raise ValueError(f"counts is on {counts.device}, {name} on {x.device}")
            if x.dim() != 3 or counts.shape[0] != x.shape[0]:
                raise ValueError(f"with counts, {name} must be (E, C, columns) and counts (E,), got {tuple(x.shape)} "
                                 f"and {tuple(counts.shape)}")
        self.shape = (*x.shape[:-1], cols)
        self.fp8, self.dtype = fp8, x.dtype
        self.contiguous = x.is_contiguous()
        rows = x.numel() // max(x.shape[-1], 1)
        groups, capacity = (x.shape[0], x.shape[1]) if counts is not None else (1, rows)
        gpu = x.device.type == "cuda"
        block_r, block_c = SILU_BLOCK if gpu else (min(CPU_ROWS, triton.next_power_of_2(max(capacity, 1))),
                                                   triton.next_power_of_2(max(cols, 1)))
        block_c = min(block_c, triton.next_power_of_2(max(cols, 1)))
        if fp8:
            block_c = max(block_c, FP8_BLOCK)
        self.blocks = triton.cdiv(capacity, block_r)
        self.args = (capacity, self.blocks, cols)
        self.launch = None
        if min(rows, cols) > 0:
            x = x if self.contiguous else x.contiguous()
            out, scales = self._outputs(x.device)
            self.launch = Launch(silu_mul_kernel, (groups * self.blocks, triton.cdiv(cols, block_c)),
                                 (x, out, scales, x if counts is None else counts, *self.args),
                                 dict(GATED=gated, FP8=fp8, COUNTS=counts is not None, BLOCK_R=block_r,
                                      BLOCK_C=block_c), 4)
            self.counts_arg = counts is not None

    def _outputs(self, dev):
        """(out as the kernel takes it, scales), new: out's bytes (fp8 bits as uint8)."""
        if not self.fp8:
            out = torch.empty(self.shape, dtype=self.dtype, device=dev)
            return out, out
        q = torch.empty(self.shape, dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.empty((*self.shape[:-1], self.shape[-1] // FP8_BLOCK), dtype=torch.float32, device=dev)
        return q.view(torch.uint8), scales

    def run(self, x, counts):
        out, scales = self._outputs(x.device)
        if self.launch is not None:
            a = self.launch.address
            if not self.contiguous:
                x = x.contiguous()
            self.launch(a(x), a(out), a(scales), a(counts if self.counts_arg else x), *self.args)
        if self.fp8:
            return out.view(torch.float8_e4m3fn), scales
        return out


@declare_op()
def qk_norm_rope(qkv: torch.Tensor, tokens: int, heads: int, kv_heads: int, inv_freq: torch.Tensor,
                 rows: torch.Tensor, positions: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """The first `tokens` rows of qkv (rows, (heads + 2 kv_heads) head_dim), columns [q | k | v]: returns q
    (tokens, heads, head_dim), normed by q_weight (if given) and rotated; k (normed by k_weight) and rotated,
    and v as it is, go to k_dst / v_dst[rows[t], positions[t]] ((sequences, positions, kv_heads, head_dim),
    head_dim contiguous). Rotation of token t: angles positions[t] * inv_freq (head_dim / 2 fp32), rotate_half
    form. rows, positions: (tokens,) int64 (not checked against k_dst's size: that would need a host sync)."""
    _check("qkv", qkv, dims=2)
    _check("inv_freq", inv_freq, torch.float32, 1)
    for name, t in (("rows", rows), ("positions", positions)):
        _check(name, t, torch.int64, 1)
        if t.shape[0] != tokens:
            raise ValueError(f"{name} has {t.shape[0]} entries, expected tokens = {tokens}")
    half = inv_freq.shape[0]
    if qkv.shape[1] != (heads + 2 * kv_heads) * 2 * half or qkv.stride(1) != 1 or not 0 <= tokens <= qkv.shape[0]:
        raise ValueError(f"qkv must be (>= {tokens}, (heads + 2 kv_heads) head_dim = "
                         f"{(heads + 2 * kv_heads) * 2 * half}) with contiguous rows, got {tuple(qkv.shape)}, "
                         f"strides {qkv.stride()}")
    for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
        _check(name, t, qkv.dtype, 4)
        if t.shape[2:] != (kv_heads, 2 * half) or t.stride(3) != 1:
            raise ValueError(f"{name} must be (sequences, positions, {kv_heads}, {2 * half}) with head_dim contiguous, "
                             f"got {tuple(t.shape)}")
    if k_dst.stride() != v_dst.stride():
        raise ValueError(f"k_dst and v_dst must have the same strides, got {k_dst.stride()} and {v_dst.stride()}")
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
        if t is not None:
            _check(name, t, qkv.dtype, 1)
            if t.shape[0] != 2 * half:
                raise ValueError(f"{name} has {t.shape[0]} elements, head_dim is {2 * half}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight, or neither")
    q = torch.empty((tokens, heads, 2 * half), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        block_r = _rows_per_program(tokens, qkv.device)
        norm = q_weight is not None
        qkv_norm_w = (q_weight, k_weight) if norm else (inv_freq, inv_freq)  # not read without NORM
        qk_norm_rope_kernel[(triton.cdiv(tokens, block_r),)](
            qkv, q, k_dst, v_dst, rows, positions, inv_freq, *qkv_norm_w, tokens, qkv.stride(0), *k_dst.stride()[:3],
            eps, HEADS=heads, KV_HEADS=kv_heads, HALF=half, HEADS_P=triton.next_power_of_2(heads),
            KV_P=triton.next_power_of_2(kv_heads), HALF_P=triton.next_power_of_2(half), NORM=norm, BLOCK_R=block_r,
            num_warps=4)
    return q


# -- the operators (inference: rms_norm, qk_norm_rope and fp8_rows are not differentiable; silu_mul is, by its
# formula) ----------------------------------------------------------------------------------------------------
#   torch.ops.weft.rms_norm(x, weight, eps, residual) -> (out, x + residual, or an empty (0,) without residual)
#   torch.ops.weft.qk_norm_rope(qkv, tokens, heads, kv_heads, inv_freq, rows, positions, k_dst!, v_dst!, q_weight,
#                               k_weight, eps) -> q   (k and v written into k_dst / v_dst)
#   torch.ops.weft.silu_mul(h, counts, fp8) -> (y, scales: empty (0,) unless fp8)
#   torch.ops.weft.fp8_rows(x, counts) -> (q, scales)

@rms_norm.define
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return rms_norm.eager(x, weight, eps), x.new_empty((0,))
    return rms_norm.eager(x, weight, eps, residual)


@rms_norm_op.register_fake
def _(x, weight, eps, residual=None):
    return x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,))


@rms_norm.traced
def _(x, weight, eps, residual=None):
    out, summed = torch.ops.weft.rms_norm(x, weight, eps, residual)
    return out if residual is None else (out, summed)


@qk_norm_rope.define(mutates_args=("k_dst", "v_dst"))
def qk_norm_rope_op(qkv: torch.Tensor, tokens: int, heads: int, kv_heads: int, inv_freq: torch.Tensor,
                    rows: torch.Tensor, positions: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                    q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                    eps: float = 1e-6) -> torch.Tensor:
    return qk_norm_rope.eager(qkv, tokens, heads, kv_heads, inv_freq, rows, positions, k_dst, v_dst, q_weight,
                              k_weight, eps)


@qk_norm_rope_op.register_fake
def _(qkv, tokens, heads, kv_heads, inv_freq, rows, positions, k_dst, v_dst, q_weight=None, k_weight=None,
      eps=1e-6):
    return qkv.new_empty((tokens, heads, 2 * inv_freq.shape[0]))


@silu_mul.define
def silu_mul_op(h: torch.Tensor, counts: Optional[torch.Tensor] = None,
                fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if fp8:
        return silu_mul.eager(h, counts, fp8=True)
    return silu_mul.eager(h, counts), h.new_empty((0,), dtype=torch.float32)


@silu_mul_op.register_fake
def _(h, counts=None, fp8=False):
    shape = (*h.shape[:-1], h.shape[-1] // 2)
    if fp8:
        return (h.new_empty(shape, dtype=torch.float8_e4m3fn),
                h.new_empty((*shape[:-1], shape[-1] // FP8_BLOCK), dtype=torch.float32))
    return h.new_empty(shape), h.new_empty((0,), dtype=torch.float32)


@silu_mul.traced
def _(h, counts=None, fp8=False):
    y, scales = torch.ops.weft.silu_mul(h, counts, fp8)
    return (y, scales) if fp8 else y


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_mul_backward(ctx, grad, grad_scales):
    # d/dgate silu(gate) * up = up * s (1 + gate (1 - s)), s = sigmoid(gate); d/dup = silu(gate). Rows past counts
    # are undefined in the output, so their gradient is too (as the forward's).
    h, = ctx.saved_tensors
    gate, up = h.float().chunk(2, dim=-1)
    g = grad.float()
    s = torch.sigmoid(gate)
    return torch.cat([g * up * s * (1 + gate * (1 - s)), g * gate * s], dim=-1).to(h.dtype), None, None


silu_mul_op.register_autograd(_silu_mul_backward, setup_context=_silu_mul_setup)


@fp8_rows.define
def fp8_rows_op(x: torch.Tensor, counts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_rows.eager(x, counts)


@fp8_rows_op.register_fake
def _(x, counts=None):
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], x.shape[-1] // FP8_BLOCK), dtype=torch.float32))


def _compile_cases():
    out = []
    for t in ("*bf16", "*fp32"):
        out.append((rms_norm_kernel, dict(x=t, residual=t, weight=t, out=t, res_out=t, rows="i32", cols="i32",
                                          eps="fp32"), dict(HAS_RESIDUAL=True, BLOCK_R=1, BLOCK_C=8192),
                    dict(num_warps=8)))
        out.append((rms_norm_kernel, dict(x=t, residual=t, weight=t, out=t, res_out=t, rows="i32", cols="i32",
                                          eps="fp32"), dict(HAS_RESIDUAL=False, BLOCK_R=1, BLOCK_C=128)))
        for gated, fp8, counts in ((True, False, False), (True, False, True), (True, True, True), (False, True, False)):
            out.append((silu_mul_kernel, dict(h=t, out="*u8" if fp8 else t, scales="*fp32", counts="*i32",
                                              capacity="i32", blocks="i32", cols="i32"),
                        dict(GATED=gated, FP8=fp8, COUNTS=counts, BLOCK_R=SILU_BLOCK[0], BLOCK_C=SILU_BLOCK[1]),
                        dict(num_warps=4, divisible=("cols",), **({"min_arch": 89} if fp8 else {}))))
        for heads, kv, half, norm in ((16, 4, 64, True), (64, 8, 64, True), (3, 1, 40, False)):
            out.append((qk_norm_rope_kernel,
                        dict(qkv=t, q_out=t, k_dst=t, v_dst=t, rows="*i64", positions="*i64", inv_freq="*fp32",
                             q_weight=t, k_weight=t, tokens="i32", qkv_stride="i32", dst_sb="i64", dst_sp="i64",
                             dst_sh="i64", eps="fp32"),
                        dict(HEADS=heads, KV_HEADS=kv, HALF=half, HEADS_P=triton.next_power_of_2(heads),
                             KV_P=triton.next_power_of_2(kv), HALF_P=triton.next_power_of_2(half), NORM=norm,
                             BLOCK_R=1)))
    return out


# Signatures for the compile check (weft.testing.compile): Qwen3-8B at 2 ranks and Qwen3-32B at 1 (with q/k norm),
# an odd head_dim without; bf16 and fp32.
COMPILE_CASES = _compile_cases()
