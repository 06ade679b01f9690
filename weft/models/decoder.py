"""A dense decoder of the Llama-3 / Qwen3 family, tensor-parallel over a group of ranks, end to end on weft's ops.

    model = weft.models.from_hf("Qwen/Qwen3-8B-local-dir")          # or a transformers config: random weights
    logits = model(input_ids)                                         # (batch, seq, vocab): a full forward
    tokens = model.generate(input_ids, max_new_tokens=128)            # prompt + new tokens, greedy
    baseline = model.with_comm("nccl")                                # the same weights on NCCL + cuBLAS
    replica = weft.models.from_hf(path, tp_group=weft.new_subgroups(2))  # TP=2 replicas, data-parallel
    stage = weft.models.from_hf(path, pp_group=pp)                       # a pipeline stage (Stage, generate)

Every rank of the tensor-parallel group (`tp_group`, default the world) runs the same program on the same
input ids and gets the same logits and tokens; replicas in other groups serve their own batches meanwhile.

Prefill (and the full forward) keeps the residual stream sequence-parallel: the batch's tokens, flattened
and padded to a multiple of the group size W, are split by rows over the group's ranks; each block's QKV and
gate/up projections gather the rows under their GEMM (weft.ops.ag_gemm) and the output and down
projections reduce-scatter theirs (weft.ops.gemm_rs); attention is torch's causal
scaled_dot_product_attention on each rank's heads. Decode (one new token per sequence) is plain tensor
parallelism: every rank holds every token; the row projections all-reduce fused with their GEMM
(weft.ops.gemm_ar), attention runs over the KV cache with weft.ops.flash_decode. The embedding and LM head
split the vocabulary (weft/layers/transformer.py has the layers, weft/layers/comm.py the "weft" and
"nccl" communication).

generate(): prefill into a KV cache, then one decode step per token. Decode steps run in a DecodeSession:
the cache and static input buffers of a batch-size bucket (powers of two), its step captured once in a
CUDA graph and replayed (GPUs); sessions are kept per bucket and reused while their cache is long
enough. Sampling (greedy, or temperature / top-k / top-p with a seeded generator, the same seed on every
rank) runs outside the graph on the gathered logits, which are the same bits on every rank, so the ranks
pick the same tokens.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import weft
from weft import tuning
from weft.layers.comm import Comm, make_comm
from weft.runtime import settings
from weft.layers.transformer import (ParallelLMHead, Positions, RMSNorm, RotaryEmbedding, TensorParallelAttention,
                                     TensorParallelMLP, VocabParallelEmbedding)

from .weights import CheckpointWeights, RandomWeights, StateDictWeights, hf_shapes, read_config

DECODE_PATHS = ("fused", "layers", "persistent")
# KV cache capacity is rounded up to a multiple of this, so that a session serves prompts of nearby lengths.
CACHE_ROUND = 128


def _hf(config, name: str, default=None):
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs of a Hugging Face config (LlamaConfig, Qwen3Config, or their config.json)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # Llama-3's frequency scaling, or None
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3's RMSNorm of q and k over head_dim

    @classmethod
    def from_hf(cls, config) -> "ModelConfig":
        """From a transformers config object or a config.json dict; ValueError for what this decoder lacks."""
        kind = _hf(config, "model_type")
        if kind not in ("llama", "qwen3"):
            raise ValueError(f"model_type {kind!r} is not supported: 'llama' and 'qwen3' are")
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if _hf(config, flag, False):
                raise ValueError(f"config.{flag} is set: not supported")
        if _hf(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {_hf(config, 'hidden_act')!r} is not supported: 'silu' is")
        heads = _hf(config, "num_attention_heads")
        # transformers >= 5 keeps rope θ and scaling in rope_parameters; older configs in rope_theta, rope_scaling.
        rope = _hf(config, "rope_parameters") or {}
        theta = rope.get("rope_theta", _hf(config, "rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", "default") != "default" else _hf(config, "rope_scaling")
        kind_of_rope = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind_of_rope not in ("default", "llama3"):
            raise ValueError(f"rope type {kind_of_rope!r} is not supported: 'default' and 'llama3' are")
        if rope.get("partial_rotary_factor", _hf(config, "partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor other than 1 is not supported")
        hidden = _hf(config, "hidden_size")
        return cls(vocab_size=_hf(config, "vocab_size"), hidden_size=hidden,
                   intermediate_size=_hf(config, "intermediate_size"), num_layers=_hf(config, "num_hidden_layers"),
                   heads=heads, kv_heads=_hf(config, "num_key_value_heads") or heads,
                   head_dim=_hf(config, "head_dim") or hidden // heads, rms_norm_eps=_hf(config, "rms_norm_eps", 1e-6),
                   rope_theta=float(theta), rope_scaling=dict(scaling) if kind_of_rope == "llama3" else None,
                   tie_word_embeddings=bool(_hf(config, "tie_word_embeddings", False)), qk_norm=kind == "qwen3")


class KVCache:
    """Keys and values of up to `batch` sequences of up to `max_len` positions, every layer, this rank's KV
    heads: one tensor (layers, 2, batch, max_len, kv_heads / W, head_dim); layer i's (k, v) are views in
    flash_decode's contiguous layout. A KVCache of a view of another's data (e.g. some of its rows) writes
    into that one's memory."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def batch(self) -> int:
        return self.data.shape[2]

    @property
    def max_len(self) -> int:
        return self.data.shape[3]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]


@dataclass(frozen=True)
class Stage:
    """This rank's place in a pipeline: `group` the pipeline group (one member per stage, group rank = stage
    index), and the model's layers this stage holds, [first_layer, first_layer + its blocks). The first stage
    embeds, the last one holds the final norm and the LM head; between stages the residual stream (x and the
    residual, this TP rank's rows) travels by weft.ops.send / recv to the same TP rank of the next stage."""
    group: object
    index: int
    count: int
    first_layer: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


class Block(nn.Module):
    """One decoder layer, pre-norm: h = x + attention(norm(x)), then h + mlp(norm(h)). The residual stream is
    carried as (x, residual) with the adds fused into the next norm: block(x, residual) returns the MLP's
    output and the stream before it (residual None at the first layer: x is the stream)."""

    def __init__(self, attn_norm: RMSNorm, attn: TensorParallelAttention, mlp_norm: RMSNorm, mlp: TensorParallelMLP):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

    def _norm(self, x, residual):
        return (self.attn_norm(x), x) if residual is None else self.attn_norm(x, residual)

    def forward(self, x, residual, pos, kv=None):
        """Prefill, sequence-parallel (this rank's rows)."""
        x, residual = self._norm(x, residual)
        x, residual = self.mlp_norm(self.attn(x, pos, kv), residual)
        return self.mlp(x), residual

    def decode(self, x, residual, pos, kv):
        """One token per sequence, every token on every rank."""
        x, residual = self._norm(x, residual)
        x, residual = self.mlp_norm(self.attn.decode(x, pos, kv), residual)
        return self.mlp(x, sequence_parallel=False), residual

    def decode_fused(self, h, pos, kv):
        """One token per sequence on the fused decode kernels: h the residual stream (batch, hidden), every token
        on every rank; returns the stream after the block (the adds are in the projections' epilogues)."""
        h = self.attn.decode_fused(h, self.attn_norm, pos, kv)
        return self.mlp.decode_fused(h, self.mlp_norm)

    def fusable(self) -> bool:
        """Whether decode_fused computes this block: norm_qkv_rope takes one eps for the block's norm and q/k's."""
        q_norm = self.attn.q_norm
        return q_norm is None or q_norm.eps == self.attn.k_norm.eps == self.attn_norm.eps


class Transformer(nn.Module):
    """The decoder on this rank (see the module doc). Made by from_hf."""

    def __init__(self, config: ModelConfig, embed: VocabParallelEmbedding | None, blocks: list[Block],
                 norm: RMSNorm | None, lm_head: ParallelLMHead | None, rope: RotaryEmbedding, comm: Comm,
                 stage: Stage | None = None):
        super().__init__()
        self.config, self.comm, self.stage = config, comm, stage
        self.embed, self.blocks, self.norm, self.lm_head, self.rope = embed, nn.ModuleList(blocks), norm, lm_head, rope
        self.world_size = comm.group.size  # the tensor-parallel size
        weight = blocks[0].attn.qkv_weight
        self.dtype, self.device = weight.dtype, weight.device
        self.sessions: dict[tuple[int, bool, str], DecodeSession] = {}

    def with_comm(self, comm) -> "Transformer":
        """This model with another communication ("weft" or "nccl"), sharing its weights (no copy)."""
        comm = make_comm(comm, self.comm.group)
        shared = {id(t): t for t in (*self.parameters(), *self.buffers())}
        shared[id(self.sessions)] = {}  # the twin captures its own decode graphs
        twin = copy.deepcopy(self, memo=shared)
        for m in twin.modules():
            if isinstance(getattr(m, "comm", None), Comm):
                m.comm = comm
        return twin

    def _ids(self, input_ids) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be (batch, seq) with batch, seq >= 1, got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids has dtype {input_ids.dtype}, expected torch.int64 or torch.int32")
        if not 0 <= int(input_ids.min()) <= int(input_ids.max()) < self.config.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size})")
        return input_ids.to(self.device, torch.int64)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        attn = self.blocks[0].attn
        return KVCache(torch.zeros((len(self.blocks), 2, batch, max_len, attn.kv_heads, attn.head_dim),
                                   dtype=self.dtype, device=self.device))

    # -- the pipeline's hand-over between stages (no-ops without a pipeline) --------------------------------------

    def _take(self, rows: int):
        """The previous stage's residual stream for this call: (x, residual), rows x hidden each."""
        stream = torch.empty((2, rows, self.config.hidden_size), dtype=self.dtype, device=self.device)
        weft.ops.recv(stream, self.stage.index - 1, group=self.stage.group)
        return stream[0], stream[1]

    def _hand_on(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        weft.ops.send(torch.stack([x, residual]), self.stage.index + 1, group=self.stage.group)

    def _from_last(self, t: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        """The last stage's tensor `t`, on every stage (a broadcast over the pipeline group)."""
        if self.stage is None or self.stage.count == 1:
            return t
        if not self.stage.last:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        return weft.ops.broadcast(t, root=self.stage.count - 1, group=self.stage.group)

    def _stream_in(self, make, rows: int):
        """(x, residual) at this stage's first block: `make()` (the embedding) on the first stage, else received."""
        if self.stage is None or self.stage.first:
            return make(), None
        return self._take(rows)

    def _stream_out(self, x, residual) -> bool:
        """Hand the stream on if a later stage holds the rest of the model; whether this stage is the last."""
        if self.stage is None or self.stage.last:
            return True
        self._hand_on(x, residual)
        return False

    def _prefill(self, ids: torch.Tensor, cache: KVCache | None) -> torch.Tensor | None:
        """The final norm's output, sequence-parallel: this rank's rows of the batch's tokens, padded to W rows.
        None on a stage before the last."""
        batch, seq = ids.shape
        tokens = batch * seq
        padded = -(-tokens // self.world_size) * self.world_size
        x, residual = self._stream_in(
            lambda: self.embed(F.pad(ids.reshape(-1), (0, padded - tokens)), sequence_parallel=True),
            padded // self.world_size)
        pos = Positions.prefill(batch, seq, self.rope)
        for i, block in enumerate(self.blocks):
            x, residual = block(x, residual, pos, None if cache is None else cache.layer(i))
        if not self._stream_out(x, residual):
            return None
        return self.norm(x, residual)[0]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) of every position, no cache. input_ids (batch, seq), the same on every rank."""
        ids = self._ids(input_ids)
        normed = self._prefill(ids, None)
        logits = None if normed is None else self.lm_head(normed, sequence_parallel=True)[:ids.numel()]
        logits = self._from_last(logits, (ids.numel(), self.config.vocab_size), self.dtype)
        return logits.view(*ids.shape, -1)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run the prompts (batch, seq) into the cache's first `batch` rows; returns the logits of each
        prompt's last token (batch, vocab)."""
        ids = self._ids(input_ids)
        batch, seq = ids.shape
        if batch > cache.batch or seq > cache.max_len:
            raise ValueError(f"the cache holds {cache.batch} sequences of {cache.max_len} positions, the prompts "
                             f"are {batch} x {seq}")
        return self._from_last(self._prefill_logits(ids, cache), (batch, self.config.vocab_size), self.dtype)

    def _prefill_logits(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """The logits of each prompt's last token on the last stage, None before it."""
        batch, seq = ids.shape
        normed = self._prefill(ids, cache)
        if normed is None:
            return None
        return self.lm_head(self.comm.all_gather(normed)[seq - 1:batch * seq:seq])

    def decode_path(self, batch: int, path: str | None = None) -> str:
        """The kernels a decode step of `batch` sequences runs on: "fused" (weft/kernels/decode.py: per layer
        norm + QKV + q/k norm + rotary + cache write, attention, O + residual, norm + gate/up + SiLU, down +
        residual), "layers" (the layers' GEMMs and pointwise kernels) or "persistent" (the fused path's kernels'
        work, every layer in one persistent launch: weft.ops.decode_step, weft/kernels/decode_step.py). `path` if
        given, else WEFT_DECODE, else fused where the batch's bucket is at most weft.tuning's decode.fused_max_m at
        this model's tensor-parallel size.
        Always layers on the NCCL comm (the NCCL+cuBLAS baseline), in a pipeline (the stages hand on the layers
        path's stream) and where a block's norms do not share one eps. "persistent" needs one rank (TP = 1), one
        stage, blocks whose norms share one eps and attention flash_decode takes: a `path` argument of
        "persistent" where that fails is a ValueError saying why; WEFT_DECODE=persistent there gives the default
        choice (so one setting serves a job's models of any TP size)."""
        asked = path
        path = path or settings.decode_path()
        if path is not None and path not in DECODE_PATHS:
            raise ValueError(f"path must be one of {DECODE_PATHS}, got {path!r}")
        if path == "persistent":
            why = self.persistent_refusal()
            if why is None:
                return path
            if asked == "persistent":
                raise ValueError(f"the persistent decode step cannot run this model: {why}")
            path = None
        if self.comm.name != "weft" or (self.stage is not None and self.stage.count > 1) or \
                not all(b.fusable() for b in self.blocks):
            return "layers"
        if path is None:
            bucket = 1 << (batch - 1).bit_length()
            path = "fused" if bucket <= tuning.by_size("decode.fused_max_m", self.device, self.world_size) else "layers"
        return path

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               path: str | None = None) -> torch.Tensor:
        """One decode step of every sequence of the cache: tokens (batch,) int64 at positions (batch,) int64 (each
        sequence's length so far; not checked against the cache, which would need a host sync). Returns the
        logits (batch, vocab). path: "fused", "layers" or "persistent" (decode_path; default: WEFT_DECODE, else by
        batch)."""
        path = self.decode_path(tokens.shape[0], path)
        return self._from_last(self._decode_logits(tokens, positions, cache, path),
                               (tokens.shape[0], self.config.vocab_size), self.dtype)

    def persistent_refusal(self) -> str | None:
        """Why the persistent decode step (weft.ops.decode_step) cannot run this model's decode steps, in words;
        None where it can."""
        attn = self.blocks[0].attn
        eps = {b.attn_norm.eps for b in self.blocks} | {b.mlp_norm.eps for b in self.blocks}
        if self.comm.name != "weft":
            return f"it runs on weft's kernels, this model on {self.comm.name!r} (the baseline's layers path)"
        if self.world_size > 1:
            return f"it runs one rank (TP = 1), this model is split over {self.world_size} ranks"
        if self.stage is not None and self.stage.count > 1:
            return f"it runs every layer, this rank holds one stage of a pipeline of {self.stage.count}"
        if not all(b.fusable() for b in self.blocks) or len(eps) > 1:
            return "it takes one eps for every RMSNorm, this model's norms have several"
        if attn.head_dim not in weft.ops.flash_decode.head_dims or self.dtype not in weft.ops.flash_decode.dtypes:
            return (f"its attention is flash_decode's (head_dim {weft.ops.flash_decode.head_dims}), this model has "
                    f"head_dim {attn.head_dim}, {self.dtype}")
        return None

    def _step_weights(self) -> list:
        """weft.ops.decode_step's weights: 8 a layer (decode_step.LAYER_WEIGHTS)."""
        out = []
        for b in self.blocks:
            qk = b.attn.q_norm is not None
            out += [b.attn_norm.weight, b.attn.qkv_weight, b.attn.q_norm.weight if qk else None,
                    b.attn.k_norm.weight if qk else None, b.attn.o_weight, b.mlp_norm.weight, b.mlp.gate_up_weight,
                    b.mlp.down_weight]
        return out

    def _decode_logits(self, tokens: torch.Tensor | None, positions: torch.Tensor, cache: KVCache,
                       path: str = "layers"):
        """One decode step through this stage: the logits on the last stage, None before it (tokens: the first
        stage's input, None elsewhere)."""
        pos = Positions.decode(positions, self.rope)
        if path == "persistent":  # one rank, one stage (decode_path): every layer in one launch
            attn = self.blocks[0].attn
            h = weft.ops.decode_step(self.embed(tokens), self._step_weights(), pos.inv_freq, pos.positions,
                                     pos.lengths, cache.data, attn.heads, attn.kv_heads, self.blocks[0].attn_norm.eps)
            return self.lm_head(self.norm(h))
        if path == "fused":  # one stage (decode_path): the stream is one tensor, the adds in the epilogues
            h = self.embed(tokens)
            for i, block in enumerate(self.blocks):
                h = block.decode_fused(h, pos, cache.layer(i))
            return self.lm_head(self.norm(h))
        x, residual = self._stream_in(lambda: self.embed(tokens), positions.shape[0])
        for i, block in enumerate(self.blocks):
            x, residual = block.decode(x, residual, pos, cache.layer(i))
        if not self._stream_out(x, residual):
            return None
        return self.lm_head(self.norm(x, residual)[0])

    def decode_bytes(self, batch: int, context: int) -> dict[str, int]:
        """What one decode step of `batch` sequences with `context` tokens already cached must read from memory on
        this rank, in bytes, by kind: "weights" (every block's, the final norm's and the LM head's; of the
        embedding table only the batch's rows) and "kv" (every layer's keys and values of context + 1
        positions, the step's own included). Their sum over the copy bandwidth is the step's floor."""
        attn = self.blocks[0].attn
        ends = [m for m in (self.norm, self.lm_head) if m is not None]
        read = (*self.blocks.parameters(), *(p for m in ends for p in m.parameters()))
        weights = sum(p.nbytes for p in read)
        if self.embed is not None:
            weights += batch * self.embed.weight.shape[1] * self.embed.weight.element_size()
        kv = len(self.blocks) * 2 * batch * (context + 1) * attn.kv_heads * attn.head_dim * self.dtype.itemsize
        return {"weights": weights, "kv": kv}

    def session(self, batch: int, max_len: int, cuda_graph: bool = True, path: str | None = None) -> "DecodeSession":
        """The decode session of `batch`'s bucket (the next power of two: a batch runs padded to it, with or
        without graphs, so both compute the same) with a cache of at least max_len positions, kept and reused.
        path: the decode path ("fused", "layers" or "persistent", decode_path; default: WEFT_DECODE, else by the
        bucket)."""
        graph = cuda_graph and self.device.type == "cuda"
        bucket = 1 << (batch - 1).bit_length()
        path = self.decode_path(bucket, path)
        found = self.sessions.get((bucket, graph, path))
        if found is None or found.cache.max_len < max_len:
            cache = self.new_cache(bucket, -(-max_len // CACHE_ROUND) * CACHE_ROUND)
            found = self.sessions[(bucket, graph, path)] = DecodeSession(self, cache, graph, path)
        return found

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None, seed: int = 0,
                 cuda_graph: bool = True, callback: Callable[[int, torch.Tensor], None] | None = None,
                 micro_batches: int | None = None, decode_path: str | None = None) -> torch.Tensor:
        """The prompts (batch, seq), the same on every rank, followed by up to max_new_tokens new tokens each
        (batch, seq + new), as transformers' generate: greedy, or sampled (do_sample) from the softmax of the
        logits / temperature, cut to the top_k tokens and the top_p probability mass. A sequence that emits
        eos_token_id is padded with pad_token_id (default: the eos) from then on, and generation stops when
        every sequence has; without eos_token_id every sequence gets max_new_tokens. cuda_graph: replay the
        decode steps from a CUDA graph (GPUs). callback(i, tokens): called with each new token i (batch,)
        (on the device, not waited for).

        In a pipeline (from_hf's pp_group) the batch runs as `micro_batches` (default: one per stage) that follow
        each other through the stages, each stage working on one while the next works on the one before; the last
        stage samples (per micro-batch: sampled tokens differ from one stage's for the same seed, greedy ones do
        not) and sends each micro-batch's token back to the first stage; every stage returns the same tokens.
        The steps run eagerly there (cuda_graph is for the one-stage model), callback on the last stage only.
        decode_path: "fused", "layers" or "persistent" (see decode_path; default: WEFT_DECODE, else by the batch's
        bucket)."""
        ids = self._ids(input_ids)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        batch, seq = ids.shape
        if max_new_tokens == 0:
            return ids
        eos = None if eos_token_id is None else torch.tensor(eos_token_id, device=self.device).reshape(-1)
        pad = int(eos[0]) if pad_token_id is None and eos is not None else pad_token_id
        generator = torch.Generator(self.device).manual_seed(seed) if do_sample else None
        if self.stage is not None and self.stage.count > 1:
            def pick(logits):
                return sample(logits, do_sample, temperature, top_k, top_p, generator)
            return self._generate_pipelined(ids, max_new_tokens, pick, eos, pad, micro_batches, callback)
        session = self.session(batch, seq + max_new_tokens, cuda_graph, decode_path)
        logits = self.prefill(ids, session.cache)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        new = []
        for i in range(max_new_tokens):
            if i:
                logits = session.step(new[-1], seq + i - 1)
            token = sample(logits, do_sample, temperature, top_k, top_p, generator)
            if eos is not None:
                token = token.masked_fill(done, pad)
                done |= torch.isin(token, eos)
            new.append(token)
            if callback is not None:
                callback(i, token)
            if eos is not None and bool(done.all()):
                break
        return torch.cat([ids, torch.stack(new, dim=1)], dim=1)

    def _generate_pipelined(self, ids, max_new_tokens, pick, eos, pad, micro_batches, callback) -> torch.Tensor:
        """generate() over the stages of a pipeline (see generate). Each stage issues, per step, micro-batch after
        micro-batch: receive the stream (or, on the first stage, the micro-batch's last token from the last
        stage), run its blocks, hand the stream on; so stage s works on micro-batch j while stage s + 1 works
        on j - 1. Sends and receives are ordered per pair of stages, so the calls match in program order."""
        stage = self.stage
        batch, seq = ids.shape
        m = min(micro_batches or stage.count, batch)
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        bounds = [(j * batch // m, (j + 1) * batch // m) for j in range(m)]
        cache = self.new_cache(batch, seq + max_new_tokens)
        last_stage = stage.count - 1
        new = [[] for _ in range(m)]  # the last stage's tokens of each micro-batch, step by step
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        steps = 0
        for i in range(max_new_tokens):
            for j, (lo, hi) in enumerate(bounds):
                rows = KVCache(cache.data[:, :, lo:hi])
                if i == 0:
                    logits = self._prefill_logits(ids[lo:hi], rows)
                else:
                    tokens = None
                    if stage.first:  # the micro-batch's token of the step before, from the last stage
                        tokens = torch.empty(hi - lo, dtype=torch.int64, device=self.device)
                        weft.ops.recv(tokens, last_stage, group=stage.group)
                    positions = torch.full((hi - lo,), seq + i - 1, dtype=torch.int64, device=self.device)
                    logits = self._decode_logits(tokens, positions, rows)
                if stage.last:
                    token = pick(logits)
                    if eos is not None:
                        token = token.masked_fill(done[lo:hi], pad)
                        done[lo:hi] |= torch.isin(token, eos)
                    new[j].append(token)
                    if eos is None and i + 1 < max_new_tokens:  # at once: the first stage's next step needs it
                        weft.ops.send(token, 0, group=stage.group)
            steps += 1
            if stage.last and callback is not None:
                callback(i, torch.cat([n[-1] for n in new]))
            if eos is not None:
                # Every stage stops after the same step: the last stage's verdict, broadcast. Only then go the
                # step's tokens back to the first stage, so that stopping leaves no message in flight.
                flag = torch.tensor([int(bool(done.all())) if stage.last else 0], device=self.device)
                if bool(weft.ops.broadcast(flag, root=last_stage, group=stage.group).item()):
                    break
                if stage.last and i + 1 < max_new_tokens:
                    for n in new:
                        weft.ops.send(n[-1], 0, group=stage.group)
        tokens = torch.stack([torch.cat([n[k] for n in new]) for k in range(steps)], dim=1) if stage.last else None
        tokens = self._from_last(tokens, (batch, steps), torch.int64)
        return torch.cat([ids, tokens], dim=1)


def sample(logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of logits (batch, vocab): argmax, or drawn from softmax(logits / temperature)
    restricted to the top_k largest and to the smallest set of tokens holding top_p of the probability
    (transformers' order: temperature, top-k, top-p)."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1)
        cut = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        cut[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(cut.scatter(-1, order, cut), float("-inf"))
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)


class DecodeSession:
    """Decode steps of the sequences of one KV cache from static input buffers (tokens, positions), on the decode
    path `path` ("fused", "layers" or "persistent": Transformer.decode_path); on GPUs the step is captured once in
    a CUDA graph and replayed. The capture's warm-up step writes position 0 of every row: make the session before
    prefilling its cache."""

    def __init__(self, model: Transformer, cache: KVCache, cuda_graph: bool = True, path: str | None = None):
        self.model, self.cache = model, cache
        self.path = model.decode_path(cache.batch, path)
        self.tokens = torch.zeros(cache.batch, dtype=torch.int64, device=model.device)
        self.positions = torch.zeros(cache.batch, dtype=torch.int64, device=model.device)
        self.graph = None
        if cuda_graph and model.device.type == "cuda":
            from weft.runtime.graphs import capture

            # The warm-up run (outside capture) creates weft's workspaces, plans and compiled kernels.
            self.graph = capture(self.run, warmups=1)

    def run(self) -> None:
        """One step on the static buffers (what the graph replays): self.logits (batch, vocab)."""
        self.logits = self.model.decode(self.tokens, self.positions, self.cache, self.path)

    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Feed tokens (n,) of the first n sequences, all at `position`; returns their logits (n, vocab), valid
        until the next step."""
        n = tokens.shape[0]
        self.tokens[:n].copy_(tokens)
        self.positions[:n].fill_(position)
        if self.graph is None:
            self.run()
        else:
            self.graph.replay()
        return self.logits[:n]


def from_hf(config_or_path, state_dict: dict | None = None, dtype: torch.dtype | None = None, comm="weft",
            seed: int = 0, std: float = 0.02, tp_group=None, pp_group=None) -> Transformer:
    """This rank's part of the decoder of a Hugging Face config (a transformers LlamaConfig / Qwen3Config, or
    the path of a local checkpoint directory: config.json and *.safetensors). Weights: `state_dict` (Hugging
    Face naming, full tensors) if given, else the checkpoint's, else seeded random ones (normal(0, std),
    the same on every rank). dtype: default the weights' own, bf16 for random weights on GPUs (fp32 on the
    cpu backend). comm: "weft" or "nccl". tp_group: the tensor-parallel group the model is split over (default:
    the world); a data-parallel job makes one per replica (weft.new_subgroups(tp)), each replica serving its own
    batches. pp_group: a pipeline group (one rank per stage, group rank = stage; its members at the same place
    of their tensor-parallel groups): the layers split into consecutive stages (the first ones one layer more
    where they do not divide), stage 0 embedding, the last holding the final norm and the LM head. Collective
    over tp_group (and pp_group): call it on each of their ranks after weft.init()."""
    path = os.fspath(config_or_path) if isinstance(config_or_path, (str, os.PathLike)) else None
    cfg = ModelConfig.from_hf(read_config(path) if path is not None else config_or_path)
    shapes = hf_shapes(cfg)
    device = weft.device()
    if state_dict is not None:
        weights = StateDictWeights(state_dict, shapes)
    elif path is not None:
        weights = CheckpointWeights(path, shapes)
    else:
        weights = RandomWeights(shapes, seed, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32),
                                device, std)
    dtype = dtype or weights.dtype
    comm = make_comm(comm, tp_group)
    local = dict(comm=comm, device=device, dtype=dtype, group=comm.group)

    def norm(name):
        return RMSNorm(weights[name].to(device, dtype, copy=True), cfg.rms_norm_eps)

    stage = None
    layers = range(cfg.num_layers)
    if pp_group is not None:
        pp = weft.get_group(pp_group)
        if cfg.num_layers < pp.size:
            raise ValueError(f"pp_group has {pp.size} stages, more than the model's {cfg.num_layers} layers")
        per, extra = divmod(cfg.num_layers, pp.size)
        first = pp.rank * per + min(pp.rank, extra)
        layers = range(first, first + per + (pp.rank < extra))
        stage = Stage(pp, pp.rank, pp.size, first)
    blocks = []
    for n in layers:
        p = f"model.layers.{n}."
        qk = [weights[p + f"self_attn.{x}_norm.weight"] if cfg.qk_norm else None for x in "qk"]
        attn = TensorParallelAttention.from_dense(*(weights[p + f"self_attn.{x}_proj.weight"] for x in "qkvo"),
                                                  cfg.heads, cfg.kv_heads, q_norm=qk[0], k_norm=qk[1],
                                                  eps=cfg.rms_norm_eps, **local)
        mlp = TensorParallelMLP.from_dense(*(weights[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up", "down")),
                                           **local)
        blocks.append(Block(norm(p + "input_layernorm.weight"), attn, norm(p + "post_attention_layernorm.weight"), mlp))
    embed = lm_head = final_norm = None
    if stage is None or stage.first:
        embed = VocabParallelEmbedding.from_dense(weights["model.embed_tokens.weight"], **local)
    if stage is None or stage.last:
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        lm_head = ParallelLMHead.from_dense(weights[head], **local)
        final_norm = norm("model.norm.weight")
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
    return Transformer(cfg, embed, blocks, final_norm, lm_head, rope, comm, stage)
