"""EP prefill's local grouped MLP: routed_gemm and routed_gemm_sum.

routed_gemm and routed_gemm_sum are the two ops' one-rank baseline as local ops (not collective; each rank
its own token count, and k may pass E): the grouped MLP of rows routed to this rank's experts, as an EP rank
computes it on what ep_dispatch received (EPMoE's prefill): the layout sort, the same grouped GEMM kernel, the
weighted top-k sum, with no host sync and no torch indexing. In fp8 (e4m3 rows with a scale per 128 channels,
weights per 128 x 128 block: EPMoE(fp8=True)'s prefill) they run grouped_gemm's fp8 kernel over the layout's
expert segments (its ROUTED form: the tokens gathered by pair for routed_gemm, h's rows by TMA for
routed_gemm_sum), then the same weighted sum.

The bf16 / fp16 forms are the tensor-parallel plans on one rank (tp: ag_group_gemm's and group_gemm_rs's
baseline); topk_idx's values are checked on the device as those ops check them (routing._RoutingCheck).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ..common import Launch, Plan, check_tensor, plan, signature, world_or_raise
from ..gemm import descriptor, num_sms
from ..registry import declare_op, into
from .group_layout import GroupLayout, LayoutLaunches, _check_layout, _topk_sum_launch
from .grouped_gemm import FP8, check_fp8_operands, fp8_tma_aligned, grouped_config, grouped_gemm_fp8_kernel
from .routing import INDEX_DTYPES, _checked, _RoutingCheck
from .tp import AgGroupGemmPlan, _check_out, _check_topk, GroupGemmRsPlan


class _RoutedFp8Plan(Plan):
    """routed_gemm / routed_gemm_sum (`summed`) with fp8 operands: this rank's pairs sorted by expert
    (LayoutLaunches, one chunk), then grouped_gemm_fp8_kernel over the layout's expert segments (ROUTED): the
    tokens gathered by pair (routed_gemm), or h's rows in layout order by TMA (routed_gemm_sum, whose
    topk_sum_kernel then sums each token's k rows). Outputs bf16."""

    def __init__(self, world, x, w, topk_idx, x_scales, w_scales, topk_weights, out, summed: bool,
                 make_layout: bool):
        super().__init__(world)
        x_name, w_name = ("h", "w_down") if summed else ("tokens", "w_experts")
        check_tensor(x_name, x, world, dtypes=(FP8,))
        check_tensor(w_name, w, world, dtypes=(FP8,), contiguous=False)
        if x.dim() != 2 or w.dim() != 3 or w.shape[0] < 1 or w.shape[1] != x.shape[1]:
            raise ValueError(f"{x_name} must be (rows, K) and {w_name} (experts, K, N) with K = {x_name}'s columns, "
                             f"got {tuple(x.shape)} and {tuple(w.shape)}")
        check_fp8_operands(world, x_name, x, x_scales, w_name, w, w_scales)
        check_tensor("topk_idx", topk_idx, world, dtypes=INDEX_DTYPES)
        if topk_idx.dim() != 2:
            raise ValueError(f"topk_idx must be (tokens, k), got shape {tuple(topk_idx.shape)}")
        m, k = topk_idx.shape
        e, kdim, n = w.shape
        _check_topk(world, topk_idx, m, e, topk_weights)
        if x.shape[0] != (m * k if summed else m):
            want = f"tokens x k = {m * k} (as routed_gemm returns them)" if summed else f"{m} (topk_idx's tokens)"
            raise ValueError(f"{x_name} has {x.shape[0]} rows, expected {want}")
        self.m, self.k, self.e, self.n, self.kdim, self.summed = m, k, e, n, kdim, summed
        self.dev = x.device
        self.out_shape = (m, n) if summed else (m * k, n)
        _check_out(world, out, self.out_shape, torch.bfloat16)
        self.routing = _RoutingCheck(world, topk_idx, e)
        self.layouts = LayoutLaunches(topk_idx, e, 1, copy=False) if make_layout else None
        self.empty = min(m, n, kdim) == 0
        if self.empty:
            return
        cfg = grouped_config(0, FP8, world.device, True)
        pairs = m * k
        tiles = (triton.cdiv(pairs, cfg.block_m) + e) * triton.cdiv(n, cfg.block_n)  # at most
        programs = max(1, min(num_sms(world.device) * cfg.programs_per_sm, tiles))
        # TMA operands start 16-byte aligned: one that does not is copied per call (the plan's key has it).
        self.realign = summed and x.data_ptr() % 16 != 0, w.data_ptr() % 16 != 0
        x, w = self._aligned(x, w)
        self.w_desc = descriptor(w.transpose(1, 2).reshape(e * n, kdim), (cfg.block_n, cfg.block_k))
        self.x_desc = descriptor(x, (cfg.block_m, cfg.block_k)) if summed else None
        y = torch.empty((pairs, n), dtype=torch.bfloat16, device=self.dev)
        meta = torch.empty((1, e + 2 + pairs), dtype=torch.int32, device=self.dev)
        self.gemm = Launch(grouped_gemm_fp8_kernel, (programs,),
                           self._gemm_args(x, w, y, x_scales, w_scales, meta),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                                BLOCK_E=triton.next_power_of_2(e), NUM_STAGES=cfg.num_stages, PROGRAMS=programs,
                                FLATTEN=cfg.flatten, OUT_TMA=False, ROUTED=True, GATHER=not summed, TOP_K=k),
                           cfg.num_warps)
        self._off()
        if summed:
            self.sums = _topk_sum_launch(world, y, torch.empty((m, k), dtype=torch.int32, device=self.dev),
                                         topk_weights, torch.empty(self.out_shape, dtype=torch.bfloat16,
                                                                   device=self.dev), m)

    def _aligned(self, x, w):
        return fp8_tma_aligned(x, w, self.realign)

    def _gemm_args(self, x, w, y, x_scales, w_scales, meta):
        e, n, kdim = self.e, self.n, self.kdim
        xs = self.x_desc.on(x) if self.summed else x
        return (xs, self.w_desc.on(w.transpose(1, 2).reshape(e * n, kdim)), y, x_scales, w_scales, meta, e,
                self.m * self.k, n, kdim, *w_scales.stride())

    def _off(self) -> None:
        for d in (self.x_desc, self.w_desc):
            if d is not None:
                d.off()

    def check_layout(self, layout) -> None:
        _check_layout(layout, (1, self.e, self.k, self.m), self.dev)

    def run(self, x, w, topk_idx, x_scales, w_scales, topk_weights, layout, out):
        if layout is None:
            self.routing.run(topk_idx)
            layout = self.layouts.all_gathered(topk_idx)
        if out is None:
            out = torch.empty(self.out_shape, dtype=torch.bfloat16, device=self.dev)
        if self.empty:
            out.zero_()
        else:
            x, w = self._aligned(x, w)
            y = out if not self.summed else torch.empty((self.m * self.k, self.n), dtype=torch.bfloat16,
                                                        device=self.dev)
            a = self.gemm.address
            self.gemm(*(a(t) if isinstance(t, torch.Tensor) else t
                        for t in self._gemm_args(x, w, y, x_scales, w_scales, layout.meta)))
            self._off()
            if self.summed:
                a = self.sums.address
                self.sums(a(y), a(layout.row_of_pair), a(topk_weights), a(out), self.m, self.n)
        return out if self.summed else (out, layout)


@declare_op()
def routed_gemm(tokens: torch.Tensor, w_experts: torch.Tensor, topk_idx: torch.Tensor,
                out: torch.Tensor | None = None, *, x_scales: torch.Tensor | None = None,
                w_scales: torch.Tensor | None = None) -> tuple:
    """Multiply every (token, expert) pair of this rank's routed tokens by its expert's weights: ag_group_gemm
    without the all-gather. Local, not collective: each rank its own token count (an EP rank's received rows:
    EPMoE's prefill).

    tokens (m, hidden) bf16/fp16; w_experts (E, hidden, N) of that dtype; topk_idx (m, k) int64/int32: each
    token's experts in [0, E), -1 for none (k may pass E: -1 for the experts held elsewhere; a row must not name
    an expert twice). Contiguous. Returns (inter (m k, N), layout): inter's rows are the pairs sorted by expert
    (GroupLayout, one chunk), inter[row] = token @ w_experts[expert] (fp32 accumulation, rounded to the dtype),
    zeros for the pairs without expert; pass `layout` on to routed_gemm_sum. `out`: a contiguous (m k, N)
    tensor to write inter into. topk_idx's values are checked on the device, as ag_group_gemm checks them.

    fp8 (tokens and w_experts torch.float8_e4m3fn, inter bf16): tokens with x_scales (m, hidden / 128) fp32 (per
    row and 128 channels: fp8_rows), w_experts (E, hidden, N) with its K dimension contiguous and w_scales (E,
    hidden / 128, cdiv(N, 128)) per 128 x 128 block (fp8_blocks); hidden a multiple of 128. Each 128-channel
    slice's product is scaled by both operands' scales, as grouped_gemm's fp8 form.
    """
    world = world_or_raise()
    if isinstance(tokens, torch.Tensor) and tokens.dtype == FP8:
        found = plan(world, lambda: ("routed_gemm_fp8", signature(tokens), signature(w_experts), w_experts.stride(),
                                     signature(topk_idx), _scales_key(x_scales, w_scales),
                                     None if out is None else signature(out)),
                     lambda: _RoutedFp8Plan(world, tokens, w_experts, topk_idx, x_scales, w_scales, None, out,
                                            summed=False, make_layout=True))
        return _checked(found, tokens, w_experts, topk_idx, x_scales, w_scales, None, None, out)
    _no_scales(x_scales, w_scales, tokens)
    found = plan(world, lambda: ("routed_gemm", signature(tokens), signature(w_experts), signature(topk_idx),
                                 None if out is None else signature(out)),
                 lambda: AgGroupGemmPlan(world, tokens, w_experts, topk_idx, "baseline", out, local=True))
    return _checked(found, tokens, w_experts, topk_idx, out)


@declare_op()
def routed_gemm_sum(h: torch.Tensor, w_down: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    layout: GroupLayout | None = None, out: torch.Tensor | None = None, *,
                    x_scales: torch.Tensor | None = None, w_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Multiply every pair's row of h by its expert's down projection and sum each token's k results with its
    routing weights: group_gemm_rs without the reduce-scatter. Local, not collective.

    h (m k, N') bf16/fp16 in the order of routed_gemm's layout (its output after the activation); w_down (E, N',
    hidden) of that dtype; topk_idx (m, k) and topk_weights (m, k) fp32: the routing given to routed_gemm;
    layout: what routed_gemm returned (None: made again from topk_idx). Contiguous. Returns (m, hidden): sum
    over j of topk_weights[t, j] * (h[row of (t, j)] @ w_down[expert], rounded to the dtype), in fp32, rounded
    once; pairs with topk_idx -1 add nothing. `out`: a contiguous (m, hidden) tensor to write it into.

    fp8 (h and w_down torch.float8_e4m3fn, the result bf16): h with x_scales (m k, N' / 128) (silu_mul(fp8=True)
    gives both), w_down with its K dimension contiguous and w_scales (E, N' / 128, cdiv(hidden, 128)), as in
    routed_gemm.
    """
    world = world_or_raise()
    if isinstance(h, torch.Tensor) and h.dtype == FP8:
        found = plan(world, lambda: ("routed_gemm_sum_fp8", signature(h), signature(w_down), w_down.stride(),
                                     signature(topk_idx), signature(topk_weights), _scales_key(x_scales, w_scales),
                                     layout is None, None if out is None else signature(out)),
                     lambda: _RoutedFp8Plan(world, h, w_down, topk_idx, x_scales, w_scales, topk_weights, out,
                                            summed=True, make_layout=layout is None))
        found.check_layout(layout)
        return _checked(found, h, w_down, topk_idx, x_scales, w_scales, topk_weights, layout, out)
    _no_scales(x_scales, w_scales, h)
    found = plan(world, lambda: ("routed_gemm_sum", signature(h), signature(w_down), signature(topk_idx),
                                 signature(topk_weights), layout is None, None if out is None else signature(out)),
                 lambda: GroupGemmRsPlan(world, h, w_down, topk_idx, topk_weights, "baseline", out, layout is None,
                                 local=True))
    found.check_layout(layout)
    return _checked(found, h, w_down, topk_idx, topk_weights, layout, out)


# -- the operators (inference) ---------------------------------------------------------------------------------
#   torch.ops.weft.routed_gemm(tokens, w_experts, topk_idx, x_scales, w_scales) -> (inter, the layout's meta,
#                                                                                  row_of_pair)
#   torch.ops.weft.routed_gemm_sum(h, w_down, topk_idx, topk_weights, meta, row_of_pair, x_scales, w_scales)
#                                                                                 -> (m, hidden)
# (meta, row_of_pair: the GroupLayout routed_gemm returned, or None both.)

def _out_dtype(x):
    return torch.bfloat16 if x.dtype == FP8 else x.dtype


@routed_gemm.define
def routed_gemm_op(tokens: torch.Tensor, w_experts: torch.Tensor, topk_idx: torch.Tensor,
                   x_scales: Optional[torch.Tensor] = None,
                   w_scales: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inter, layout = routed_gemm.eager(tokens, w_experts, topk_idx, x_scales=x_scales, w_scales=w_scales)
    return inter, layout.meta, layout.row_of_pair


@routed_gemm_op.register_fake
def _(tokens, w_experts, topk_idx, x_scales=None, w_scales=None):
    m, k = topk_idx.shape
    experts, _, n = w_experts.shape
    return (tokens.new_empty((m * k, n), dtype=_out_dtype(tokens)),
            topk_idx.new_empty((1, experts + 2 + m * k), dtype=torch.int32),
            topk_idx.new_empty((m, k), dtype=torch.int32))


@routed_gemm.traced
def _(tokens, w_experts, topk_idx, out=None, *, x_scales=None, w_scales=None):
    inter, meta, row_of_pair = torch.ops.weft.routed_gemm(tokens, w_experts, topk_idx, x_scales, w_scales)
    return into(out, inter), GroupLayout(meta, w_experts.shape[0], topk_idx.shape[1], topk_idx.shape[0], row_of_pair)


@routed_gemm_sum.define
def routed_gemm_sum_op(h: torch.Tensor, w_down: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       meta: Optional[torch.Tensor] = None, row_of_pair: Optional[torch.Tensor] = None,
                       x_scales: Optional[torch.Tensor] = None,
                       w_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    layout = None if meta is None else GroupLayout(meta, w_down.shape[0], topk_idx.shape[1], topk_idx.shape[0],
                                                   row_of_pair)
    return routed_gemm_sum.eager(h, w_down, topk_idx, topk_weights, layout, x_scales=x_scales, w_scales=w_scales)


@routed_gemm_sum_op.register_fake
def _(h, w_down, topk_idx, topk_weights, meta=None, row_of_pair=None, x_scales=None, w_scales=None):
    return h.new_empty((topk_idx.shape[0], w_down.shape[2]), dtype=_out_dtype(h))


@routed_gemm_sum.traced
def _(h, w_down, topk_idx, topk_weights, layout=None, out=None, *, x_scales=None, w_scales=None):
    meta, row_of_pair = (None, None) if layout is None else (layout.meta, layout.row_of_pair)
    return into(out, torch.ops.weft.routed_gemm_sum(h, w_down, topk_idx, topk_weights, meta, row_of_pair, x_scales,
                                                    w_scales))


def _scales_key(x_scales, w_scales):
    """The fp8 scales' part of a plan key (their layout; None where missing, which the plan rejects)."""
    return tuple(None if s is None else (signature(s), s.stride()) for s in (x_scales, w_scales))


def _no_scales(x_scales, w_scales, x) -> None:
    if x_scales is not None or w_scales is not None:
        raise ValueError(f"x_scales and w_scales go with fp8 operands (torch.float8_e4m3fn), not "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
