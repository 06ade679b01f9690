"""Disaggregated MoE serving (MegaScale-Infer's design): a Qwen3-MoE decoder whose attention runs on one set of
ranks and whose experts run on another, the tokens shuttled between them by M2N, in k >= 2 micro-batches that
ping-pong so that each side computes while the other side's tokens travel or compute.

    model = weft.models.disaggregated.from_hf(hf_config, state_dict, attention_ranks=[0, 1])  # the rest: experts
    tokens = model.generate(input_ids, max_new_tokens=16, micro_batches=2)   # every rank calls it, same ids
    baseline = weft.models.disaggregated.from_hf(hf_config, state_dict, colocated=True)  # DP attention + EPMoE

Placement. The attention side (A ranks) holds the embedding, every layer's attention (q/k norm, rotary, GQA),
norms and router, the final norm and the LM head, whole: it is data-parallel, attention rank a serving rows
[a B / A, (a + 1) B / A) of the batch with its own KV cache. The expert side (N ranks) holds the experts, split:
expert rank r has experts [r E / N, (r + 1) E / N) of every layer.

One layer of one micro-batch: the attention side computes the attention block and the router (top-k experts and
weights per token), then m2n_dispatch sends each (token, expert) entry's row to the expert rank holding the
expert, the local expert's index riding in a spare column of the row; each expert rank sorts what it received by
local expert (on the device: no host sync), runs its experts' SiLU-gated MLPs on weft's grouped GEMM, and
m2n_combine returns the rows, each scaled by its router weight; the attention side sums a token's k rows.

Ping-pong. An attention rank's rows are cut into k micro-batches; per layer it runs micro-batch i's attention and
dispatch, then goes on to micro-batch i + 1 before waiting for micro-batch i's experts: while one micro-batch is
on the expert side, the attention side computes the next one (docs/disaggregation.md has the schedule and its
cost model). Each micro-batch has its own M2N channel (a group over the world with its own workspace: M2N
acknowledges one call deep, so micro-batches sharing one would wait on each other in a cycle from k = 4 on); on
each channel both sides issue the same calls: per layer a dispatch, later its combine (prefill: chunk by chunk,
each combined before the next dispatch, no ping-pong). On GPUs the calls are stream-ordered kernels, so the
attention side runs ahead of its experts by whole micro-batches; on cpu ranks every call completes before it
returns, which gives the same overlap between processes.

colocated=True builds the baseline at the same rank count: every rank attention (data-parallel, its own rows) and
an EP rank of weft's EPMoE (experts split over all ranks, ep_dispatch_ll / ep_combine_ll); its micro-batches, if
more than one, run one after the other (nothing to overlap).

Weights: a transformers Qwen3MoeForCausalLM's state dict (every layer sparse, no shared expert), or seeded random
ones of its config's shapes. Greedy decoding; every rank returns the whole batch's tokens.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import weft
import weft.ops
from weft.layers.comm import Comm
from weft.layers.moe import EPMoE
from weft.layers.transformer import Positions, RMSNorm, RotaryEmbedding, TensorParallelAttention

from .decoder import _hf
from .weights import RandomWeights, StateDictWeights


@dataclass(frozen=True)
class MoEConfig:
    """What the model needs of a transformers Qwen3MoeConfig (or its config.json dict)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool

    @classmethod
    def from_hf(cls, config) -> "MoEConfig":
        if _hf(config, "model_type") != "qwen3_moe":
            raise ValueError(f"model_type {_hf(config, 'model_type')!r} is not supported: 'qwen3_moe' is")
        if _hf(config, "mlp_only_layers") or _hf(config, "decoder_sparse_step", 1) != 1:
            raise ValueError("every layer must be sparse (decoder_sparse_step 1, no mlp_only_layers)")
        if _hf(config, "attention_bias", False) or _hf(config, "use_sliding_window", False):
            raise ValueError("attention_bias and use_sliding_window are not supported")
        rope = _hf(config, "rope_parameters") or _hf(config, "rope_scaling") or {}  # transformers >= 5, older
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError("only the default rotary embedding is supported")
        heads, hidden = _hf(config, "num_attention_heads"), _hf(config, "hidden_size")
        return cls(vocab_size=_hf(config, "vocab_size"), hidden_size=hidden,
                   num_layers=_hf(config, "num_hidden_layers"), heads=heads,
                   kv_heads=_hf(config, "num_key_value_heads") or heads,
                   head_dim=_hf(config, "head_dim") or hidden // heads,
                   rms_norm_eps=_hf(config, "rms_norm_eps", 1e-6),
                   rope_theta=float(rope.get("rope_theta", _hf(config, "rope_theta", 10000.0))),
                   tie_word_embeddings=bool(_hf(config, "tie_word_embeddings", False)),
                   num_experts=_hf(config, "num_experts"), top_k=_hf(config, "num_experts_per_tok"),
                   moe_intermediate_size=_hf(config, "moe_intermediate_size"),
                   norm_topk_prob=bool(_hf(config, "norm_topk_prob", True)))

    def shapes(self) -> dict:
        """Hugging Face names and shapes of the weights, in model order."""
        h, d, e, i = self.hidden_size, self.head_dim, self.num_experts, self.moe_intermediate_size
        out = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out.update({p + "self_attn.q_proj.weight": (self.heads * d, h),
                        p + "self_attn.k_proj.weight": (self.kv_heads * d, h),
                        p + "self_attn.v_proj.weight": (self.kv_heads * d, h),
                        p + "self_attn.o_proj.weight": (h, self.heads * d),
                        p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                        p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * i, h),
                        p + "mlp.experts.down_proj": (e, h, i),
                        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        return out


class LocalComm(Comm):
    """The tensor-parallel layers' communication on a group of one (a data-parallel attention rank): nothing to
    communicate, the GEMMs local."""
    name = "local"

    def __init__(self):
        self.group = None

    def ag_gemm(self, x, w):
        return x @ w

    gemm_rs = gemm_ar = ag_gemm

    def all_reduce(self, x):
        return x

    reduce_scatter = all_gather = all_reduce


class AttentionLayer(nn.Module):
    """A layer's attention half, pre-norm, and its router. forward: (x, residual) -> the post-attention norm's
    output h (the experts' input) and the stream before it; route(h): each row's top-k experts and weights."""

    def __init__(self, attn_norm: RMSNorm, attn: TensorParallelAttention, mlp_norm: RMSNorm,
                 router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm = attn_norm, attn, mlp_norm
        self.router_weight = nn.Parameter(router_weight, requires_grad=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x, residual, pos: Positions, kv, decode: bool):
        x, residual = (self.attn_norm(x), x) if residual is None else self.attn_norm(x, residual)
        a = self.attn.decode(x, pos, kv) if decode else self.attn(x, pos, kv)
        h, residual = self.mlp_norm(a, residual)
        return h, residual

    def route(self, h: torch.Tensor):
        """(topk_idx (T, k) int64, topk_weights (T, k) fp32): softmax of the router's logits in fp32, top-k,
        renormalised if norm_topk_prob (weft.ops.router_topk, as EPMoE routes)."""
        return weft.ops.router_topk(F.linear(h, self.router_weight), self.top_k, self.norm_topk_prob)


class ExpertShard(nn.Module):
    """This expert rank's L experts of one layer: w_gate_up (L, hidden, 2 inter) = [gate | up], w_down
    (L, inter, hidden), as weft's grouped GEMM takes them."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.w_gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.w_down = nn.Parameter(down, requires_grad=False)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (L, C, hidden), rows [0, counts[e]) of expert e valid -> down(SiLU(gate x) * up x) on them."""
        h = weft.ops.silu_mul(weft.ops.grouped_gemm(x, self.w_gate_up, counts), counts)
        return weft.ops.grouped_gemm(h, self.w_down, counts)


class DisaggregatedMoE(nn.Module):
    """This rank's part of the model (module doc): `role` "attention", "expert" or "colocated". Made by from_hf."""

    def __init__(self, config: MoEConfig, role: str, attention_ranks: tuple, expert_ranks: tuple, layers, experts,
                 embed, final_norm, lm_head, rope, dtype):
        super().__init__()
        self.config, self.role, self.dtype = config, role, dtype
        self.attention_ranks, self.expert_ranks = attention_ranks, expert_ranks
        self.layers = nn.ModuleList(layers)  # attention side: AttentionLayer per layer
        self.experts = nn.ModuleList(experts)  # expert side: ExpertShard per layer; colocated: EPMoE per layer
        self.embed, self.final_norm, self.lm_head, self.rope = embed, final_norm, lm_head, rope
        # The spare columns of a dispatched row (the local expert's index in the first): 16 bytes keep rows aligned.
        self.pad = max(1, 16 // torch.empty((), dtype=dtype).element_size())
        self.local_experts = config.num_experts // len(expert_ranks)

    # -- the pieces of a step ----------------------------------------------------------------------------------

    def _send(self, h, idx, weights, capacity, channel):
        """m2n_dispatch on group `channel` of rows h (T <= capacity, hidden) routed by idx / weights (T, k): each
        (token, expert) entry its own row, dest its expert's rank, the local index in the spare column (so an
        expert rank knows which of its experts a row is for). Returns (handle, weights, T) for _receive."""
        k, hidden = idx.shape[1], self.config.hidden_size
        rows = torch.empty((h.shape[0], k, hidden + self.pad), dtype=h.dtype, device=h.device)
        rows[..., :hidden] = h.unsqueeze(1)
        rows[..., hidden:] = 0
        rows[..., hidden] = (idx % self.local_experts).to(h.dtype)
        dest = (idx // self.local_experts).reshape(-1, 1)
        _, _, handle = weft.ops.m2n_dispatch(rows.reshape(-1, hidden + self.pad), dest, self.attention_ranks,
                                             self.expert_ranks, capacity * k, group=channel)
        return handle, weights.reshape(-1, 1), h.shape[0]

    def _receive(self, sent):
        """m2n_combine of a _send: each token's k weighted rows summed in fp32, (T, hidden)."""
        handle, weights, tokens = sent
        k, hidden = self.config.top_k, self.config.hidden_size
        out = weft.ops.m2n_combine(None, weights, handle)[:, :hidden]
        return out.reshape(tokens, k, hidden).float().sum(1).to(self.dtype)

    def _serve(self, layer: int, capacity: int, channel, span):
        """The expert side of one dispatch / combine: the rows received sorted by local expert into (L, C, hidden)
        on the device (C = every sender's capacity: a token names an expert once), the experts, the rows back."""
        hidden, dev = self.config.hidden_size, weft.device()
        empty = torch.empty((0, hidden + self.pad), dtype=self.dtype, device=dev)
        recv, counts, handle = weft.ops.m2n_dispatch(empty, torch.empty((0, 1), dtype=torch.int64, device=dev),
                                                     self.attention_ranks, self.expert_ranks,
                                                     capacity * self.config.top_k, group=channel)
        with span():
            y = self._experts(layer, recv, counts, capacity)
        weft.ops.m2n_combine(y, None, handle)

    def _experts(self, layer, recv, counts, capacity):
        """The rows received (M, capacity k, hidden + pad), sorted by local expert, through the experts; back in
        recv's layout."""
        hidden, m, n_local = self.config.hidden_size, len(self.attention_ranks), self.local_experts
        dev = recv.device
        rows = recv.reshape(-1, hidden + self.pad)
        valid = (torch.arange(recv.shape[1], device=dev) < counts.unsqueeze(1)).reshape(-1)
        expert = torch.where(valid, rows[:, hidden].to(torch.int64), n_local)  # n_local: no row
        one_hot = F.one_hot(expert, n_local + 1)[:, :n_local]
        slot = (one_hot.cumsum(0) - 1).gather(1, expert.clamp(max=n_local - 1).unsqueeze(1)).squeeze(1)
        cap = m * capacity
        where = torch.where(valid, expert * cap + slot, n_local * cap)  # the last row: a sink for the invalid ones
        x = rows.new_empty((n_local * cap + 1, hidden))
        x.index_copy_(0, where, rows[:, :hidden])
        y = self.experts[layer](x[:-1].view(n_local, cap, hidden), one_hot.sum(0).to(torch.int32))
        y = torch.cat([y.reshape(-1, hidden), y.new_zeros((1, hidden))])[where]
        return F.pad(y, (0, self.pad)).view(recv.shape)

    # -- generation --------------------------------------------------------------------------------------------

    def _channels(self, micro_batches: int, capacity: int) -> list:
        """One group over the world per micro-batch, each with its own M2N workspace. M2N acknowledges one call
        deep (a writer waits for the readers of its previous call); on one group, micro-batch 3's dispatch would
        wait for the expert side to take micro-batch 2's, which comes after its combine of micro-batch 1, which
        waits for the attention side to take micro-batch 0's, which it does after dispatching micro-batch 3: a
        cycle from k = 4 on. Made on first need (collective: every rank calls generate alike), kept while big
        enough."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        need = 2 * weft.world_size() * capacity * self.config.top_k * (self.config.hidden_size + self.pad) * elt
        have = getattr(self, "_channel_groups", [])
        if len(have) < micro_batches or have[0].workspace_bytes < need:
            ws = -(-max(need, 1 << 20) // 4096) * 4096
            self._channel_groups = have = [weft.new_group(list(range(weft.world_size())), heap_size=2 * ws + (1 << 20),
                                                          workspace_bytes=ws) for _ in range(micro_batches)]
        return have[:micro_batches]

    def _plan(self, batch: int, micro_batches: int, prefill_chunk: int):
        """(this attention rank's rows, micro-batch size, tokens per M2N call in prefill) of a batch (decode: the
        micro-batch size, which bounds the expert side's buffers: they are sized by the call's capacity)."""
        sides = len(self.attention_ranks) if self.role != "colocated" else weft.world_size()
        if micro_batches < 1 or batch % (sides * micro_batches):
            raise ValueError(f"a batch of {batch} sequences does not split into {micro_batches} equal micro-batches "
                             f"on each of {sides} attention ranks")
        per_rank = batch // sides
        mb = per_rank // micro_batches
        return per_rank, mb, max(mb, prefill_chunk)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, micro_batches: int = 2,
                 prefill_chunk: int = 64, timeline=None) -> torch.Tensor:
        """Greedy: prompts (batch, seq) + max_new_tokens tokens, (batch, seq + max_new_tokens), on every rank.
        Collective over the world: every rank calls it with the same ids. The batch must split into
        `micro_batches` equal micro-batches on each attention rank. prefill_chunk: tokens per M2N call in
        prefill. timeline: an object whose span(side, what, layer, micro_batch) is a context manager around
        each compute (weft/bench/disagg.py records times with it)."""
        ids = torch.as_tensor(input_ids).to(weft.device())
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be (batch, seq) integers, got {tuple(ids.shape)} {ids.dtype}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        batch, seq = ids.shape
        per_rank, mb, chunk = self._plan(batch, micro_batches, prefill_chunk)
        span = timeline.span if timeline is not None else (lambda *a: contextlib.nullcontext())
        mine = None
        channels = self._channels(micro_batches, chunk) if self.role != "colocated" else None
        if self.role == "expert":
            # The attention side's calls, mirrored: per step and layer, each micro-batch's calls on its channel
            # (prefill: its chunks; decode: one call).
            for step in range(max_new_tokens):
                calls, capacity = (-(-mb * seq // chunk), chunk) if step == 0 else (1, mb)
                what = "prefill" if step == 0 else "decode"
                for layer in range(self.config.num_layers):
                    for i in range(micro_batches):
                        for _ in range(calls):
                            self._serve(layer, capacity, channels[i], lambda: span("expert", what, layer, i))
        else:
            me = (self.attention_ranks.index(weft.rank()) if self.role == "attention" else weft.rank())
            mine = self._generate_rows(ids[me * per_rank:(me + 1) * per_rank], max_new_tokens, micro_batches,
                                       chunk, span, channels)
        gathered = [None] * weft.world_size()
        dist.all_gather_object(gathered, None if mine is None else mine.cpu(), group=weft.world().process_group)
        return torch.cat([t for t in gathered if t is not None]).to(ids.device)

    def _generate_rows(self, ids, max_new_tokens, micro_batches, chunk, span, channels):
        """An attention (or colocated) rank's rows: prefill, then decode steps, each layer in ping-pong (prefill:
        each chunk's experts taken right after its dispatch, no ping-pong)."""
        cfg = self.config
        rows, seq = ids.shape
        mb = rows // micro_batches
        cache = torch.zeros((cfg.num_layers, 2, rows, seq + max_new_tokens, cfg.kv_heads, cfg.head_dim),
                            dtype=self.dtype, device=ids.device)
        groups = [slice(i * mb, (i + 1) * mb) for i in range(micro_batches)]
        out = ids
        tokens = ids
        for step in range(max_new_tokens):
            decode = step > 0
            if decode:
                positions = torch.full((mb,), seq + step - 1, dtype=torch.int64, device=ids.device)
                pos = Positions.decode(positions, self.rope)
            else:
                pos = Positions.prefill(mb, seq, self.rope)
            what = "decode" if decode else "prefill"
            capacity = mb if decode else chunk  # tokens per M2N call
            carry = [None] * micro_batches
            pending = [None] * micro_batches
            for layer in range(cfg.num_layers):
                for i, g in enumerate(groups):
                    if pending[i] is not None:  # micro-batch i's experts of the layer before
                        carry[i] = (self._receive(pending[i]), carry[i][1])
                    with span("attention", what, layer, i):
                        x, residual = carry[i] if layer > 0 else (F.embedding(tokens[g].reshape(-1), self.embed),
                                                                  None)
                        h, residual = self.layers[layer](x, residual, pos, (cache[layer, 0, g], cache[layer, 1, g]),
                                                         decode)
                        if self.role != "colocated":
                            idx, weights = self.layers[layer].route(h)
                    if self.role == "colocated":  # EPMoE over every rank, in chunks of `capacity` tokens
                        with span("expert", what, layer, i):
                            moe = self.experts[layer]
                            moe.decode_tokens = capacity  # ep_dispatch_ll's rows per rank
                            carry[i] = (torch.cat([moe(h[lo:lo + capacity], mode="ll")
                                                   for lo in range(0, h.shape[0], capacity)]), residual)
                        continue
                    if decode:  # micro-batch i's experts are taken at the next layer, after the others' attention
                        carry[i], pending[i] = (None, residual), self._send(h, idx, weights, capacity, channels[i])
                    else:  # chunk by chunk, each dispatch's experts taken before the next (M2N's one-deep acks)
                        carry[i] = (torch.cat([self._receive(self._send(h[lo:lo + capacity], idx[lo:lo + capacity],
                                                                        weights[lo:lo + capacity], capacity,
                                                                        channels[i]))
                                               for lo in range(0, h.shape[0], capacity)]), residual)
            picks = []
            for i in range(micro_batches):
                if pending[i] is not None:
                    carry[i] = (self._receive(pending[i]), carry[i][1])
                x, residual = carry[i]
                last = self.final_norm(x, residual)[0].view(mb, -1, cfg.hidden_size)[:, -1]
                picks.append((last @ self.lm_head.t()).argmax(-1))
            tokens = torch.cat(picks).unsqueeze(1)
            out = torch.cat([out, tokens], dim=1)
        return out


def from_hf(config, state_dict: dict | None = None, attention_ranks=None, colocated: bool = False,
            dtype: torch.dtype | None = None, seed: int = 0, std: float = 0.02) -> DisaggregatedMoE:
    """This rank's part of a Qwen3-MoE model (a transformers Qwen3MoeConfig or config.json dict), from a Hugging
    Face `state_dict` (full tensors, transformers 5 naming: each layer's experts as the fused
    mlp.experts.gate_up_proj and mlp.experts.down_proj) or seeded random weights (normal(0, std), norms ones; the same on every rank).
    attention_ranks: the world ranks of the attention side (default: the first half), the others the expert side;
    the experts must split evenly over it. colocated: the baseline instead (module doc). dtype: default the state
    dict's, else bf16 on GPUs and fp32 on the cpu backend. Collective over the world."""
    cfg = MoEConfig.from_hf(config)
    device = weft.device()
    world = weft.world_size()
    if state_dict is not None:
        weights = StateDictWeights(state_dict, cfg.shapes())
    else:
        weights = RandomWeights(cfg.shapes(), seed, dtype or (torch.bfloat16 if device.type == "cuda"
                                                               else torch.float32), device, std)
    dtype = dtype or weights.dtype
    if colocated:
        attention, experts, role = tuple(range(world)), tuple(range(world)), "colocated"
    else:
        attention = tuple(sorted(int(r) for r in (attention_ranks if attention_ranks is not None
                                                  else range(world // 2))))
        experts = tuple(r for r in range(world) if r not in attention)
        if not attention or not experts or len(set(attention)) != len(attention) or \
                not all(0 <= r < world for r in attention):
            raise ValueError(f"attention_ranks must be distinct world ranks leaving at least one expert rank, got "
                             f"{list(attention)} of {world}")
        role = "attention" if weft.rank() in attention else "expert"
    if cfg.num_experts % len(experts):
        raise ValueError(f"{cfg.num_experts} experts do not split over {len(experts)} expert ranks")
    local = cfg.num_experts // len(experts)
    if not colocated and dtype == torch.bfloat16 and local > 256:
        raise ValueError(f"{local} experts per rank: a bf16 row's spare column holds a local index up to 256")

    def get(name):
        return weights[name].to(device, dtype, copy=True)

    def norm(name):
        return RMSNorm(get(name), cfg.rms_norm_eps)

    layers, shards = [], []
    holds_attention = role != "expert"
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        experts_of = (lambda: (weights[p + "mlp.experts.gate_up_proj"].to(device, dtype),  # noqa: E731
                               weights[p + "mlp.experts.down_proj"].to(device, dtype)))
        if holds_attention:
            attn = TensorParallelAttention.from_dense(*(weights[p + f"self_attn.{x}_proj.weight"] for x in "qkvo"),
                                                      cfg.heads, cfg.kv_heads, rank=0, world_size=1,
                                                      q_norm=weights[p + "self_attn.q_norm.weight"],
                                                      k_norm=weights[p + "self_attn.k_norm.weight"],
                                                      eps=cfg.rms_norm_eps, comm=LocalComm(), device=device,
                                                      dtype=dtype)
            layers.append(AttentionLayer(norm(p + "input_layernorm.weight"), attn,
                                         norm(p + "post_attention_layernorm.weight"), get(p + "mlp.gate.weight"),
                                         cfg.top_k, cfg.norm_topk_prob))
        if role == "colocated":
            gate_up, down = experts_of()
            gate, up = gate_up.chunk(2, dim=1)
            shards.append(EPMoE(get(p + "mlp.gate.weight"), gate, up, down, cfg.top_k,
                                cfg.norm_topk_prob))  # decode_tokens: set per generate
        elif role == "expert":
            r = experts.index(weft.rank())
            mine = slice(r * local, (r + 1) * local)
            gate_up, down = experts_of()
            shards.append(ExpertShard(gate_up[mine].transpose(1, 2).contiguous(),
                                      down[mine].transpose(1, 2).contiguous()))
    embed = final_norm = lm_head = None
    if holds_attention:
        embed = get("model.embed_tokens.weight")
        final_norm = norm("model.norm.weight")
        lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, None, device)
    return DisaggregatedMoE(cfg, role, attention, experts, layers, shards, embed, final_norm, lm_head, rope, dtype)
