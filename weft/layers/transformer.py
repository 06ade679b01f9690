"""The layers of a tensor-parallel decoder (Llama-3 / Qwen3 family), each built from the dense weights by
`from_dense(..., comm=, group=)`, each rank keeping its slice. The tensor-parallel group (`group`, default
the world; W its size, r this rank's rank in it) is what the layers split over and communicate in: a
data-parallel job makes one per replica (weft.new_subgroups(W)).

Two layouts of the activations between layers, as in Megatron-LM:
- sequence-parallel (prefill, full forward): the batch's T tokens, flattened and padded to a multiple of
  the group size W, are split by rows: rank r holds rows [r T / W, (r + 1) T / W). Norms and residual adds
  are local; a column-parallel projection gathers the rows under its GEMM (`comm.ag_gemm`), a row-parallel
  one reduce-scatters its partial sums back to rows (`comm.gemm_rs`). The embedding reduce-scatters.
- plain tensor parallelism (decode, one token per sequence): every rank holds every token; the column
  projection is a local GEMM, the row projection all-reduces (`comm.gemm_ar`), as does the embedding.
Either way the LM head gathers every rank's slice of the vocabulary.

Weights are kept as the GEMMs take them: (in, out) slices, contiguous (the transpose of nn.Linear's).
Heads, KV heads and the MLP's intermediate size must divide by the group size; the vocabulary need not
(its last slice is padded with zero rows). `comm` is "weft" (weft's ops) or "nccl" (the process group's
collectives around torch.matmul: weft/layers/comm.py). Inference only: the weights do not require grad.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import weft
from weft import ops

from .comm import make_comm
from .linear import shard_of

DECODE_ATTENTION = ("auto", "flash_decode", "sdpa")


def _weight(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _local(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """A contiguous copy of `t` (a slice of a dense weight) on `device` (default: weft's) in `dtype`."""
    out = torch.empty(t.shape, device=device or weft.device(), dtype=dtype or t.dtype)
    return out.copy_(t)


def _split_size(total: int, world_size: int, what: str) -> int:
    """total / world_size, or a ValueError naming `what` where it does not divide."""
    if total % world_size:
        raise ValueError(f"{what} = {total} is not divisible by the group size {world_size}")
    return total // world_size


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def _check_dense(name: str, t, shape: tuple) -> None:
    """A TypeError/ValueError naming `name` unless t is a tensor of `shape` (None: any size there)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(want not in (None, got) for got, want in zip(t.shape, shape)):
        want = tuple("any" if n is None else n for n in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")


def _vocab_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank r's rows [r n, (r + 1) n) of a (vocab, hidden) table, n = ceil(vocab / W), padded with zero rows."""
    _check_rank(rank, world_size)
    _check_dense("weight", weight, (None, None))
    n = -(-weight.shape[0] // world_size)
    rows = weight[rank * n:(rank + 1) * n]
    return F.pad(rows, (0, 0, 0, n - rows.shape[0]))


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x²) + eps) over the last dimension, as transformers' LlamaRMSNorm computes it:
    in fp32, rounded to x's dtype before the weight multiplies it. Local: every rank holds the weight.

    norm(x), or norm(x, residual) -> (norm(x + residual), x + residual): a pre-norm block's residual add
    fused with the norm after it (one kernel: weft.ops.rms_norm)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = _weight(weight), eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """The rotary position embedding's frequencies, inv_freq (head_dim / 2,) fp32: θ^(-2j / head_dim), with
    Llama-3's scaling if `scaling` says so ({"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}). The attention layers rotate q and k by them in
    their fused kernel (weft.ops.qk_norm_rope), in transformers' rotate_half form."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None, device=None):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        if scaling is not None:
            inv_freq = _llama3_frequencies(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)


def _llama3_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's rescaled frequencies: long wavelengths divided by `factor`, short ones kept, the band between
    interpolated smoothly (transformers' _compute_llama3_parameters)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class VocabParallelEmbedding(nn.Module):
    """Token embeddings, the vocabulary split over ranks: rank r holds rows [r n, (r + 1) n) of the table,
    n = ceil(vocab / W), the last slice padded with zero rows. A token outside a rank's rows embeds to zero
    there, so the sum over ranks is the token's row, exactly."""

    def __init__(self, weight_shard: torch.Tensor, vocab_size: int, rank: int | None = None,
                 world_size: int | None = None, comm="weft", group=None):
        rank, world_size = shard_of(group, rank, world_size)
        super().__init__()
        self.weight = _weight(weight_shard)
        self.vocab_size, self.rank, self.world_size = vocab_size, rank, world_size
        self.start = rank * weight_shard.shape[0]
        self.comm = make_comm(comm, group)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, rank: int | None = None, world_size: int | None = None, comm="weft",
                   device=None, dtype=None, group=None):
        """From the whole table (vocab, hidden)."""
        rank, world_size = shard_of(group, rank, world_size)
        shard = _vocab_shard(weight, rank, world_size)
        return cls(_local(shard, device, dtype), weight.shape[0], rank, world_size, comm, group)

    def forward(self, ids: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """ids (N,), every token on every rank. Returns (N, hidden), the same on every rank, or with
        sequence_parallel this rank's rows [r N / W, (r + 1) N / W) (N a multiple of W)."""
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        x = x * inside.unsqueeze(-1).to(x.dtype)
        return self.comm.reduce_scatter(x) if sequence_parallel else self.comm.all_reduce(x)


class ParallelLMHead(nn.Module):
    """logits = x @ Wᵀ, the vocabulary split over ranks as in VocabParallelEmbedding: `weight` (hidden, n) is
    this rank's slice of Wᵀ's columns; every rank's logits are gathered and the padding cut off."""

    def __init__(self, weight_shard: torch.Tensor, vocab_size: int, rank: int | None = None,
                 world_size: int | None = None, comm="weft", group=None):
        rank, world_size = shard_of(group, rank, world_size)
        super().__init__()
        self.weight = _weight(weight_shard)
        self.vocab_size, self.rank, self.world_size = vocab_size, rank, world_size
        self.comm = make_comm(comm, group)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, rank: int | None = None, world_size: int | None = None, comm="weft",
                   device=None, dtype=None, group=None):
        """From the whole (vocab, hidden) weight (nn.Linear's layout, or the tied embedding table)."""
        rank, world_size = shard_of(group, rank, world_size)
        shard = _vocab_shard(weight, rank, world_size)
        return cls(_local(shard.t(), device, dtype), weight.shape[0], rank, world_size, comm, group)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """x (N, hidden), the same on every rank, or with sequence_parallel this rank's rows of the N tokens.
        Returns the logits (N, vocab) of every token on every rank."""
        local = self.comm.ag_gemm(x, self.weight) if sequence_parallel else x @ self.weight
        n, cols = local.shape
        gathered = self.comm.all_gather(local).view(self.world_size, n, cols)
        return gathered.transpose(0, 1).reshape(n, self.world_size * cols)[:, :self.vocab_size]


@dataclass
class Positions:
    """Where the tokens of a call go, computed once per call for every layer: token t belongs to sequence
    rows[t] (its KV-cache row) at position positions[t] (its rotary angle and cache slot), int64; the
    rotary frequencies; and in decode each sequence's length after the step (flash_decode's seqlens, int32).
    A prefill call holds `batch` sequences of `seq` tokens, token t = b * seq + i; a decode step one token
    of each of `batch` sequences (seq = 1)."""
    rows: torch.Tensor
    positions: torch.Tensor
    inv_freq: torch.Tensor
    batch: int
    seq: int
    lengths: torch.Tensor | None = None

    @classmethod
    def prefill(cls, batch: int, seq: int, rope: RotaryEmbedding) -> "Positions":
        """Prompts of `seq` tokens from position 0."""
        t = torch.arange(batch * seq, device=rope.inv_freq.device)
        return cls(t // seq, t % seq, rope.inv_freq, batch, seq)

    @classmethod
    def decode(cls, positions: torch.Tensor, rope: RotaryEmbedding) -> "Positions":
        """One new token per sequence at positions (batch,) int64 (each sequence's length so far)."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        return cls(rows, positions, rope.inv_freq, positions.shape[0], 1, (positions + 1).to(torch.int32))


class TensorParallelAttention(nn.Module):
    """Grouped-query self-attention with the heads split over ranks: rank r holds query heads
    [r h / W, (r + 1) h / W) and KV heads [r kv / W, (r + 1) kv / W) (so each rank's query heads keep their
    KV heads), as one fused QKV projection (hidden, (h + 2 kv) d / W), columns [q | k | v], and the matching
    rows of the output projection. After the projection one kernel (weft.ops.qk_norm_rope)
    RMS-norms q and k over head_dim (Qwen3's q_norm / k_norm, if given), rotates them (rotary embedding at
    each token's position) and writes k and v into their KV-cache slots.

    forward (prefill): sequence-parallel in and out; QKV by comm.ag_gemm, causal
    scaled_dot_product_attention per sequence, output projection by comm.gemm_rs.
    decode: one token per sequence, plain TP; QKV a local GEMM, the new keys and values written into the
    cache, attention over it (weft.ops.flash_decode, or scaled_dot_product_attention with a length mask
    where flash_decode cannot take the head_dim or dtype, and on the cpu backend, where its interpreted
    run is slow), output projection by comm.gemm_ar. A layer's KV cache is (k, v), each (batch, max_len,
    kv / W, d), flash_decode's contiguous layout.
    """

    def __init__(self, qkv_weight: torch.Tensor, o_weight: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                 rank: int | None = None, world_size: int | None = None, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None, comm="weft", decode_attention: str = "auto", group=None):
        super().__init__()
        rank, world_size = shard_of(group, rank, world_size)
        self.heads = _split_size(heads, world_size, "heads")
        self.kv_heads = _split_size(kv_heads, world_size, "kv_heads")
        self.head_dim, self.rank, self.world_size = head_dim, rank, world_size
        self.qkv_weight, self.o_weight = _weight(qkv_weight), _weight(o_weight)
        self.q_norm, self.k_norm = q_norm, k_norm
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        flash_ok = head_dim in ops.flash_decode.head_dims and qkv_weight.dtype in ops.flash_decode.dtypes
        if decode_attention == "flash_decode" and not flash_ok:
            raise ValueError(f"decode_attention='flash_decode' needs head_dim in {ops.flash_decode.head_dims} and a "
                             f"dtype in {ops.flash_decode.dtypes}, got head_dim {head_dim}, {qkv_weight.dtype}")
        if decode_attention == "auto":
            decode_attention = "flash_decode" if flash_ok and qkv_weight.device.type == "cuda" else "sdpa"
        self.decode_attention = decode_attention
        self.comm = make_comm(comm, group)  # after the checks, which need no world

    @classmethod
    def from_dense(cls, q_weight: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor,
                   o_weight: torch.Tensor, heads: int, kv_heads: int, rank: int | None = None,
                   world_size: int | None = None, q_norm: torch.Tensor | None = None,
                   k_norm: torch.Tensor | None = None, eps: float = 1e-6, comm="weft", decode_attention: str = "auto",
                   device=None, dtype=None, group=None):
        """From the dense projections' weights in nn.Linear's (out, in) layout: q (h d, hidden), k and v
        (kv d, hidden), o (hidden, h d); q_norm, k_norm (d,) or None."""
        rank, world_size = shard_of(group, rank, world_size)
        _check_rank(rank, world_size)
        for name, n in (("heads", heads), ("kv_heads", kv_heads)):
            _split_size(n, world_size, name)
        if heads % kv_heads:
            raise ValueError(f"heads = {heads} is not a multiple of kv_heads = {kv_heads}")
        _check_dense("q_weight", q_weight, (None, None))
        if q_weight.shape[0] % heads:
            raise ValueError(f"q_weight has {q_weight.shape[0]} rows, not a multiple of heads = {heads}")
        head_dim, hidden = q_weight.shape[0] // heads, q_weight.shape[1]
        _check_dense("k_weight", k_weight, (kv_heads * head_dim, hidden))
        _check_dense("v_weight", v_weight, (kv_heads * head_dim, hidden))
        _check_dense("o_weight", o_weight, (hidden, heads * head_dim))
        hl, kl = heads // world_size * head_dim, kv_heads // world_size * head_dim
        qkv = torch.cat([q_weight[rank * hl:(rank + 1) * hl], k_weight[rank * kl:(rank + 1) * kl],
                         v_weight[rank * kl:(rank + 1) * kl]]).t()
        norms = []
        for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
            if t is not None:
                _check_dense(name, t, (head_dim,))
            norms.append(None if t is None else RMSNorm(_local(t, device, dtype), eps))
        return cls(_local(qkv, device, dtype), _local(o_weight[:, rank * hl:(rank + 1) * hl].t(), device, dtype),
                   heads, kv_heads, head_dim, rank, world_size, *norms, comm=comm, decode_attention=decode_attention,
                   group=group)

    def _qk(self, qkv: torch.Tensor, pos: Positions, k_dst: torch.Tensor, v_dst: torch.Tensor) -> torch.Tensor:
        """q (tokens, heads, d) of the projections' first tokens rows, normed (Qwen3) and rotated; k and v into
        k_dst / v_dst at (pos.rows, pos.positions)."""
        norm = self.q_norm is not None
        return ops.qk_norm_rope(qkv, pos.rows.shape[0], self.heads, self.kv_heads, pos.inv_freq, pos.rows,
                                pos.positions, k_dst, v_dst, self.q_norm.weight if norm else None,
                                self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0)

    def forward(self, x: torch.Tensor, pos: Positions, kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Prefill of pos.batch sequences of pos.seq tokens, sequence-parallel: x (rows, hidden) this rank's rows
        of the batch's tokens (flattened sequence after sequence, padded to W * rows). With kv (a cache of at
        least pos.batch rows and pos.seq positions), the keys and values go into it, else into scratch.
        Returns this rank's rows of the attention output (rows, hidden)."""
        batch, seq, d = pos.batch, pos.seq, self.head_dim
        qkv = self.comm.ag_gemm(x, self.qkv_weight)
        if kv is None:
            kv = tuple(qkv.new_empty((batch, seq, self.kv_heads, d)) for _ in range(2))
        q = self._qk(qkv, pos, *kv)
        k, v = (t[:batch, :seq].transpose(1, 2) for t in kv)
        attn = F.scaled_dot_product_attention(q.view(batch, seq, self.heads, d).transpose(1, 2), k, v,
                                              is_causal=True, enable_gqa=self.kv_heads != self.heads)
        attn = attn.transpose(1, 2).reshape(batch * seq, self.heads * d)
        attn = F.pad(attn, (0, 0, 0, qkv.shape[0] - batch * seq))  # the padding rows, back for the reduce-scatter
        return self.comm.gemm_rs(attn, self.o_weight)

    def decode(self, x: torch.Tensor, pos: Positions, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One token per sequence, plain TP: x (batch, hidden) on every rank, `kv` this layer's cache of `batch`
        sequences (any strides but the last dimension's). Returns (batch, hidden), the same on every rank."""
        k_cache, v_cache = kv
        q = self._qk(x @ self.qkv_weight, pos, k_cache, v_cache)
        return self.comm.gemm_ar(self._attend(q, pos, kv), self.o_weight)

    def _attend(self, q: torch.Tensor, pos: Positions, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Decode attention of q (batch, heads, d) over the cache (the step's k and v already in it): (batch,
        heads d)."""
        k_cache, v_cache = kv
        if self.decode_attention == "flash_decode":
            attn = ops.flash_decode(q, k_cache, v_cache, pos.lengths)
        else:
            live = torch.arange(k_cache.shape[1], device=q.device) < pos.lengths.unsqueeze(-1)
            attn = F.scaled_dot_product_attention(q.unsqueeze(2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                                  attn_mask=live[:, None, None, :],
                                                  enable_gqa=self.kv_heads != self.heads).squeeze(2)
        return attn.reshape(q.shape[0], self.heads * self.head_dim)

    def decode_fused(self, h: torch.Tensor, norm: RMSNorm, pos: Positions,
                     kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The fused decode form of h + decode(norm(h)) (weft/kernels/decode.py): h (batch, hidden) the residual
        stream on every rank, returns the stream after attention. norm, the QKV projection, q/k norm, rotary and
        the KV-cache write in one kernel (ops.norm_qkv_rope, which takes one eps: the q/k norms' must be norm's),
        attention, then the O projection with the residual add (ops.linear_residual; at W > 1
        comm.gemm_ar_residual: ops.linear_residual_ar on weft's ops)."""
        qk = self.q_norm is not None
        q = ops.norm_qkv_rope(h, norm.weight, self.qkv_weight, self.heads, self.kv_heads, pos.inv_freq, pos.rows,
                              pos.positions, *kv, self.q_norm.weight if qk else None,
                              self.k_norm.weight if qk else None, norm.eps)
        return _project_residual(self.comm, self._attend(q, pos, kv), self.o_weight, h, self.world_size)


class TensorParallelMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with the intermediate features split over ranks: one fused column-parallel
    gate/up projection (hidden, 2 I / W), columns [gate | up] of this rank's features, and the matching
    rows of the row-parallel down projection (I / W, hidden).

    forward(x, sequence_parallel=True): x this rank's rows, by comm.ag_gemm and comm.gemm_rs; with
    sequence_parallel=False (decode) x is every token on every rank, a local GEMM and comm.gemm_ar."""

    def __init__(self, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, rank: int | None = None,
                 world_size: int | None = None, comm="weft", group=None):
        super().__init__()
        rank, world_size = shard_of(group, rank, world_size)
        self.gate_up_weight, self.down_weight = _weight(gate_up_weight), _weight(down_weight)
        self.rank, self.world_size = rank, world_size
        self.comm = make_comm(comm, group)

    @classmethod
    def from_dense(cls, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor,
                   rank: int | None = None, world_size: int | None = None, comm="weft", device=None, dtype=None,
                   group=None):
        """From nn.Linear-layout weights: gate and up (I, hidden), down (hidden, I)."""
        rank, world_size = shard_of(group, rank, world_size)
        _check_rank(rank, world_size)
        _check_dense("gate_weight", gate_weight, (None, None))
        inter, hidden = gate_weight.shape
        _check_dense("up_weight", up_weight, (inter, hidden))
        _check_dense("down_weight", down_weight, (hidden, inter))
        n = _split_size(inter, world_size, "intermediate_size")
        cols = slice(rank * n, (rank + 1) * n)
        gate_up = torch.cat([gate_weight[cols], up_weight[cols]]).t()
        return cls(_local(gate_up, device, dtype), _local(down_weight[:, cols].t(), device, dtype), rank,
                   world_size, comm, group)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = True) -> torch.Tensor:
        h = self.comm.ag_gemm(x, self.gate_up_weight) if sequence_parallel else x @ self.gate_up_weight
        h = ops.silu_mul(h)
        return self.comm.gemm_rs(h, self.down_weight) if sequence_parallel else self.comm.gemm_ar(h, self.down_weight)

    def decode_fused(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The fused decode form of h + forward(norm(h), sequence_parallel=False): norm, the gate/up projection and
        SiLU(gate) * up in one kernel (ops.norm_gate_up_silu), then the down projection with the residual add."""
        g = ops.norm_gate_up_silu(h, norm.weight, self.gate_up_weight, norm.eps)
        return _project_residual(self.comm, g, self.down_weight, h, self.world_size)


def _project_residual(comm, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, world_size: int):
    """residual + x @ weight summed over the group: one kernel on one rank (ops.linear_residual), else the row
    projection with its all-reduce and the add (comm.gemm_ar_residual: one kernel on weft's ops)."""
    if world_size == 1:
        return ops.linear_residual(x, weight, residual)
    return comm.gemm_ar_residual(x, weight, residual)
