"""Mixture-of-experts layers: expert parallel (EPMoE) and tensor parallel (TPMoE).

Both compute the MoE MLP of Qwen3-MoE and Mixtral: a router (logits = x @ router_weightᵀ, softmax in fp32,
top-k, the top-k weights renormalised when `norm_topk_prob`), then for each token the weighted sum over its k
experts of down(SiLU(gate(x)) * up(x)). Weights come as every expert's nn.Linear weights stacked:
router_weight (E, hidden), gate_proj and up_proj (E, inter, hidden), down_proj (E, hidden, inter); or from a
Hugging Face block (`from_dense`: Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, with the experts as one
fused gate_up_proj tensor or as a list of MLPs). The router is replicated; each rank keeps only its share of
the experts' weights.

EPMoE (expert parallel): rank r holds experts [r E / W, (r + 1) E / W) whole; each rank routes its own tokens.
- decode (at most `decode_tokens` tokens on the rank): ep_dispatch_ll puts each token in a fixed-size row of
  each of its experts' receive buffers (L, W decode_tokens, hidden), weft's grouped_gemm runs gate/up and down
  over the valid rows of every local expert, ep_combine_ll brings the k outputs back weighted. No host sync
  (topk_idx is checked on the device): the step can be captured in a CUDA graph.
- prefill: ep_dispatch sends each token once to every rank that holds one of its experts; routed_gemm sorts
  the received (row, local expert) pairs by expert and runs the gate/up GEMM over them, SiLU(gate) * up,
  routed_gemm_sum the down GEMM and each row's weighted sum over its local experts (weft kernels, no host
  sync), and ep_combine returns each rank's sum to the token's rank. ep_dispatch makes one host sync for the
  rows received, unless `max_recv_tokens` bounds them (the same on every rank; rows past it are dropped):
  then the step can be captured too. fp8 experts run the same ops in fp8 (the received rows quantized once);
  fp32 experts take a (L, most pairs of an expert, hidden) buffer and grouped_gemm instead (torch indexing,
  one host sync for that size).
Every rank must take the same path in a call: keep every rank's token count on the same side of
`decode_tokens` (true when ranks run the same batch shape), or pass `mode`.
With fp8=True the experts run in fp8 e4m3 with block scales (DeepSeek-V3's recipe): the weights are quantized per
128 x 128 block when the layer is made (half the memory), the decode dispatch sends fp8 rows with their per-128-
channel scales (half the bytes) straight into the gate/up GEMM, and the activations before the down GEMM (in the
same pass as the SiLU: silu_mul(fp8=True)) and the prefill rows (fp8_rows) are quantized per row and 128 channels;
hidden and inter must be multiples of 128.

TPMoE (tensor parallel, sequence parallel activations): every rank holds every expert's gate/up/down sliced
along the intermediate dimension (inter / W columns each) and its own m tokens (all ranks the same m).
ag_group_gemm gathers every rank's tokens under the grouped gate/up GEMM (gate and up side by side in one
weight), SiLU(gate) * up row by row, group_gemm_rs runs the down GEMM, the weighted top-k sum and the
reduce-scatter back to the tokens' ranks.

Forward only: the weft ops have no autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import weft
import weft.ops


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().contiguous(), requires_grad=False)


from .linear import shard_of


def dense_weights(block: nn.Module):
    """(router_weight, gate_proj, up_proj, down_proj, top_k, norm_topk_prob) of a Hugging Face sparse MoE block
    (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock; transformers 4.x lists of expert MLPs or 5.x fused tensors).
    Shapes: (E, hidden), (E, inter, hidden) twice, (E, hidden, inter)."""
    router = block.gate.weight
    top_k = getattr(block, "top_k", None) or getattr(block.gate, "top_k", None)
    norm = getattr(block, "norm_topk_prob", getattr(block.gate, "norm_topk_prob", True))  # Mixtral: always
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):  # transformers 5: (E, 2 inter, hidden) = [gate; up], down (E, hidden, inter)
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        down = experts.down_proj
    else:  # transformers 4: one MLP per expert (Qwen3: gate/up/down_proj; Mixtral: w1/w3/w2)
        names = ("gate_proj", "up_proj", "down_proj") if hasattr(experts[0], "gate_proj") else ("w1", "w3", "w2")
        gate, up, down = (torch.stack([getattr(mlp, n).weight for mlp in experts]) for n in names)
    if top_k is None or gate.shape[2] != router.shape[1] or down.shape[1] != router.shape[1]:
        raise ValueError(f"{type(block).__name__} is not a sparse MoE block weft can read: router "
                         f"{tuple(router.shape)}, gate {tuple(gate.shape)}, down {tuple(down.shape)}, top_k {top_k}")
    return router, gate, up, down, int(top_k), bool(norm)


class _MoE(nn.Module):
    """The router, shared by both layers."""

    def __init__(self, router_weight, gate_proj, up_proj, down_proj, top_k, norm_topk_prob):
        super().__init__()
        e, hidden = router_weight.shape
        if gate_proj.shape != up_proj.shape or gate_proj.dim() != 3 or gate_proj.shape[0] != e or \
                gate_proj.shape[2] != hidden or tuple(down_proj.shape) != (e, hidden, gate_proj.shape[1]):
            raise ValueError(f"expected gate_proj and up_proj (E, inter, hidden) and down_proj (E, hidden, inter) with "
                             f"E, hidden = {e}, {hidden} (router_weight's), got {tuple(gate_proj.shape)}, "
                             f"{tuple(up_proj.shape)}, {tuple(down_proj.shape)}")
        if not 1 <= top_k <= e:
            raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
        self.num_experts, self.hidden, self.inter = e, hidden, gate_proj.shape[1]
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.router_weight = _param(router_weight)

    def route(self, x: torch.Tensor):
        """(topk_idx (T, k) int64, topk_weights (T, k) fp32) of tokens x (T, hidden): softmax of the router's
        logits in fp32, top-k, renormalised if norm_topk_prob (weft.ops.router_topk: one launch)."""
        return weft.ops.router_topk(F.linear(x, self.router_weight), self.top_k, self.norm_topk_prob)

    @classmethod
    def from_dense(cls, block: nn.Module, **kwargs):
        """This rank's layer from a Hugging Face sparse MoE block (see dense_weights); kwargs go to the constructor."""
        router, gate, up, down, top_k, norm = dense_weights(block)
        return cls(router, gate, up, down, top_k, norm, **kwargs)


class EPMoE(_MoE):
    """Expert-parallel MoE MLP (module doc). forward(x, mode=None): x (..., hidden), this rank's tokens; returns
    the same shape. mode: "ll" (decode path), "ht" (prefill path), None (ll for at most decode_tokens tokens).
    max_recv_tokens: the prefill's bound on the rows a rank receives (ep_dispatch's; None: exact, a host sync).

    Stored: w_gate_up (L, hidden, 2 inter) and w_down (L, inter, hidden) of this rank's L = E / W experts; with
    fp8, as e4m3 with their K dimension contiguous (grouped_gemm's fp8 layout) and the block scales
    w_gate_up_scales (L, hidden / 128, 2 inter / 128), w_down_scales (L, inter / 128, hidden / 128).
    W is the size of `group` (default: the world), the expert-parallel group the tokens travel in.
    """

    def __init__(self, router_weight, gate_proj, up_proj, down_proj, top_k: int, norm_topk_prob: bool = True, *,
                 rank: int | None = None, world_size: int | None = None, decode_tokens: int = 128,
                 fp8: bool = False, max_recv_tokens: int | None = None, group=None):
        super().__init__(router_weight, gate_proj, up_proj, down_proj, top_k, norm_topk_prob)
        rank, world_size = shard_of(group, rank, world_size)
        self.group = weft.get_group(group)
        if self.num_experts % world_size:
            raise ValueError(f"{self.num_experts} experts do not split over {world_size} ranks")
        if fp8 and (self.hidden % 128 or self.inter % 128):
            raise ValueError(f"fp8 experts need hidden and inter multiples of 128 (a scale per 128 channels), got "
                             f"{self.hidden} and {self.inter}")
        if max_recv_tokens is not None and (not isinstance(max_recv_tokens, int) or max_recv_tokens < 1):
            raise ValueError(f"max_recv_tokens must be a positive int or None, got {max_recv_tokens!r}")
        self.rank, self.world_size, self.decode_tokens, self.fp8 = rank, world_size, decode_tokens, fp8
        self.max_recv_tokens = max_recv_tokens
        self.local = self.num_experts // world_size
        mine = slice(rank * self.local, (rank + 1) * self.local)
        gate_up = torch.cat([gate_proj[mine], up_proj[mine]], dim=1).transpose(1, 2)
        down = down_proj[mine].transpose(1, 2)
        if fp8:  # the weights as (L, K, N) views of K-major storage, and their 128 x 128 block scales
            (w_gu, s_gu), (w_dn, s_dn) = weft.ops.fp8_blocks(gate_up), weft.ops.fp8_blocks(down)
            self.w_gate_up = nn.Parameter(w_gu, requires_grad=False)
            self.w_down = nn.Parameter(w_dn, requires_grad=False)
            self.w_gate_up_scales, self.w_down_scales = _param(s_gu), _param(s_dn)
        else:
            self.w_gate_up, self.w_down = _param(gate_up), _param(down)

    def _experts(self, x: torch.Tensor, counts: torch.Tensor, x_scales: torch.Tensor | None = None,
                 config=None) -> torch.Tensor:
        """Each local expert's MLP on rows [0, counts[e]) of x (L, C, hidden); rows past them undefined and never
        computed but inside a GEMM's last row block (silu_mul and fp8_rows take the counts: a decode step's
        buffer holds a few valid rows per expert). fp8: x as fp8 rows with their scales (the LL dispatch's), or
        bf16 rows, quantized here."""
        if not self.fp8:
            h = weft.ops.silu_mul(weft.ops.grouped_gemm(x, self.w_gate_up, counts, config), counts)
            return weft.ops.grouped_gemm(h, self.w_down, counts, config)
        if x_scales is None:
            x, x_scales = weft.ops.fp8_rows(x, counts)
        gate_up = weft.ops.grouped_gemm(x, self.w_gate_up, counts, x_scales=x_scales,
                                        w_scales=self.w_gate_up_scales)
        h, h_scales = weft.ops.silu_mul(gate_up, counts, fp8=True)
        return weft.ops.grouped_gemm(h, self.w_down, counts, x_scales=h_scales, w_scales=self.w_down_scales)

    def _received(self, rx, ridx, rw, counts) -> torch.Tensor:
        """ep_dispatch's rows (R, hidden) -> each row's weighted sum of its local experts' outputs (R, hidden)."""
        rx, ridx, rw = rx.contiguous(), ridx.contiguous(), rw.contiguous()  # (an odd hidden size: a view)
        if self.fp8:  # the rows quantized once, gathered by pair inside the gate/up GEMM
            x, x_scales = weft.ops.fp8_rows(rx)
            inter, layout = weft.ops.routed_gemm(x, self.w_gate_up, ridx, x_scales=x_scales,
                                                 w_scales=self.w_gate_up_scales)
            h, h_scales = weft.ops.silu_mul(inter, fp8=True)
            return weft.ops.routed_gemm_sum(h, self.w_down, ridx, rw, layout, x_scales=h_scales,
                                            w_scales=self.w_down_scales).to(rx.dtype)
        if self.w_gate_up.dtype in (torch.bfloat16, torch.float16):
            inter, layout = weft.ops.routed_gemm(rx, self.w_gate_up, ridx)
            return weft.ops.routed_gemm_sum(weft.ops.silu_mul(inter), self.w_down, ridx, rw, layout)
        # fp32: the (row, expert) pairs sorted by expert into (L, most pairs of an expert, hidden).
        dev, k = rx.device, ridx.shape[1]
        key = torch.where(ridx >= 0, ridx, self.local).reshape(-1)  # no local expert: after every one
        sorted_key, order = torch.sort(key, stable=True)
        sizes = counts.tolist()  # the one host sync: the buffer's size
        pairs = sum(sizes)
        expert = sorted_key[:pairs]
        first = torch.searchsorted(sorted_key, torch.arange(self.local, dtype=sorted_key.dtype, device=dev))
        slot = torch.arange(pairs, device=dev) - first[expert]
        row = order[:pairs] // k
        x = rx.new_empty((self.local, max(sizes, default=0), self.hidden))
        x[expert, slot] = rx[row]
        y = self._experts(x, counts)[expert, slot]
        out = torch.zeros(rx.shape, dtype=torch.float32, device=dev)
        out.index_add_(0, row, y.float() * rw.reshape(-1)[order[:pairs], None])
        return out.to(rx.dtype)

    def forward(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        tokens = x.reshape(-1, self.hidden).contiguous()
        idx, weights = self.route(tokens)
        if mode is None:
            mode = "ll" if tokens.shape[0] <= self.decode_tokens else "ht"
        if mode == "ll":
            recv, counts, scales, handle = weft.ops.ep_dispatch_ll(tokens, idx, self.num_experts, self.decode_tokens,
                                                                   fp8=self.fp8, group=self.group)
            # A few rows of each expert's buffer are valid: the grouped GEMM's tiles for that (few_rows_config).
            config = weft.ops.grouped_gemm.few_rows_config(recv.dtype, recv.device)
            y = self._experts(recv, counts, scales, config).to(tokens.dtype)  # fp8 experts give bf16
            out = weft.ops.ep_combine_ll(y, idx, weights, handle, group=self.group)
        elif mode == "ht":
            rx, ridx, rw, counts, handle = weft.ops.ep_dispatch(tokens, idx, weights, self.num_experts,
                                                                self.max_recv_tokens, group=self.group)
            out = weft.ops.ep_combine(self._received(rx, ridx, rw, counts), handle, group=self.group)
        else:
            raise ValueError(f"mode must be 'll', 'ht' or None, got {mode!r}")
        return out.reshape(x.shape)


class TPMoE(_MoE):
    """Tensor-parallel MoE MLP over sequence-parallel tokens (module doc). forward(x): x (..., hidden), this
    rank's tokens (the same count on every rank); returns the same shape. `method` goes to both ops.

    Stored: w_gate_up (E, hidden, 2 inter / W), columns [gate | up] of this rank's slice of every expert, and
    w_down (E, inter / W, hidden). W is the size of `group` (default: the world).
    """

    def __init__(self, router_weight, gate_proj, up_proj, down_proj, top_k: int, norm_topk_prob: bool = True, *,
                 rank: int | None = None, world_size: int | None = None, method: str = "auto", group=None):
        super().__init__(router_weight, gate_proj, up_proj, down_proj, top_k, norm_topk_prob)
        rank, world_size = shard_of(group, rank, world_size)
        self.group = weft.get_group(group)
        if self.inter % world_size:
            raise ValueError(f"the intermediate size {self.inter} does not split over {world_size} ranks")
        self.rank, self.world_size, self.method = rank, world_size, method
        self.slice = self.inter // world_size
        mine = slice(rank * self.slice, (rank + 1) * self.slice)
        self.w_gate_up = _param(torch.cat([gate_proj[:, mine], up_proj[:, mine]], dim=1).transpose(1, 2))
        self.w_down = _param(down_proj[:, :, mine].transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.hidden).contiguous()
        idx, weights = self.route(tokens)
        inter, layout = weft.ops.ag_group_gemm(tokens, self.w_gate_up, idx, method=self.method, group=self.group)
        h = weft.ops.silu_mul(inter)
        return weft.ops.group_gemm_rs(h, self.w_down, idx, weights, layout, method=self.method,
                                      group=self.group).reshape(x.shape)
