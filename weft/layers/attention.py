"""Attention layers with the sequence split over ranks.

UlyssesAttention (prefill / training-style forward over a long sequence): rank r holds tokens
[r S, (r + 1) S) of the sequence. QKV projection of the local tokens, all-to-all to head-sharded (every
token, heads / W of them), torch's scaled_dot_product_attention over the whole sequence (causal by
default, grouped-query allowed), all-to-all back to the local tokens and the O projection. With as many KV
heads as query heads and no QKV bias the projection and the first all-to-all are one fused op
(weft.ops.qkv_all_to_all); otherwise torch.matmul and one ulysses_all_to_all per q, k, v. The second
all-to-all is always fused with the O projection (weft.ops.all_to_all_o_proj). Heads and KV heads must be
multiples of the world size.

SPDecodeAttention (decode): the KV cache of every sequence is split by position over the ranks, rank r
holding a contiguous slice; the new token is the same on every rank. Its q attends to all slices through
weft.ops.sp_flash_decode (partials merged across ranks); its k and v are appended to the slice of
`append_rank` (the last rank by default, whose slice ends the sequence). Weights are replicated.

Forward only: the weft ops have no autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import weft.ops


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().clone(), requires_grad=False)


def _dense_weights(q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, o_proj: nn.Linear, heads: int):
    """(w_q, w_k, w_v, w_o) as (in, out) matrices, the biases (q, k, v, o) or None, and (kv_heads, head_dim)."""
    if q_proj.out_features % heads:
        raise ValueError(f"q_proj has {q_proj.out_features} outputs, not a multiple of heads = {heads}")
    head_dim = q_proj.out_features // heads
    if k_proj.out_features % head_dim or k_proj.out_features != v_proj.out_features:
        raise ValueError(f"k_proj and v_proj must both have kv_heads * head_dim ({head_dim}) outputs, got "
                         f"{k_proj.out_features} and {v_proj.out_features}")
    if o_proj.in_features != q_proj.out_features:
        raise ValueError(f"o_proj takes {o_proj.in_features} inputs, q_proj gives {q_proj.out_features}")
    weights = [m.weight.t() for m in (q_proj, k_proj, v_proj, o_proj)]
    biases = [m.bias for m in (q_proj, k_proj, v_proj, o_proj)]
    return weights, biases, k_proj.out_features // head_dim, head_dim


class UlyssesAttention(nn.Module):
    """Self-attention over a sequence sharded by tokens, by Ulysses all-to-alls (see the module doc).

    forward(x): x (S, hidden), this rank's S tokens (rank r holds the r-th contiguous slice); returns
    (S, hidden). Weights in the ops' (in, out) layout: qkv_weight (hidden, (heads + 2 kv_heads) head_dim),
    columns [q heads | k heads | v heads]; o_weight (heads head_dim, hidden).
    """

    def __init__(self, qkv_weight: torch.Tensor, o_weight: torch.Tensor, heads: int, kv_heads: int | None = None,
                 qkv_bias: torch.Tensor | None = None, o_bias: torch.Tensor | None = None, causal: bool = True,
                 group=None):
        super().__init__()
        self.group = weft.get_group(group)  # the ranks the sequence is split over (default: the world)
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = o_weight.shape[0] // heads
        if heads % self.kv_heads:
            raise ValueError(f"heads = {heads} is not a multiple of kv_heads = {self.kv_heads}")
        if qkv_weight.shape[1] != (heads + 2 * self.kv_heads) * self.head_dim:
            raise ValueError(f"qkv_weight has {qkv_weight.shape[1]} columns, expected (heads + 2 kv_heads) * "
                             f"head_dim = {(heads + 2 * self.kv_heads) * self.head_dim}")
        self.causal = causal
        self.qkv_weight, self.o_weight = _param(qkv_weight), _param(o_weight)
        self.qkv_bias, self.o_bias = _param(qkv_bias), _param(o_bias)

    @classmethod
    def from_dense(cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, o_proj: nn.Linear, heads: int,
                   causal: bool = True, group=None) -> "UlyssesAttention":
        """From the dense projections (nn.Linear, weights (out, in)); kv_heads from k_proj's size."""
        (wq, wk, wv, wo), biases, kv_heads, head_dim = _dense_weights(q_proj, k_proj, v_proj, o_proj, heads)
        qkv_bias = None
        if any(b is not None for b in biases[:3]):
            qkv_bias = torch.cat([b if b is not None else torch.zeros(p.out_features, dtype=p.weight.dtype,
                                                                       device=p.weight.device)
                                  for b, p in zip(biases[:3], (q_proj, k_proj, v_proj))])
        return cls(torch.cat([wq, wk, wv], dim=1), wo, heads, kv_heads, qkv_bias, biases[3], causal, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if kvh == h and self.qkv_bias is None:
            q, k, v = weft.ops.qkv_all_to_all(x, self.qkv_weight, h, group=self.group).unbind(1)
        else:
            y = torch.matmul(x, self.qkv_weight)
            if self.qkv_bias is not None:
                y = y + self.qkv_bias
            q, k, v = (weft.ops.ulysses_all_to_all(part.view(s, n, d), group=self.group)
                       for part, n in zip(y.split([h * d, kvh * d, kvh * d], dim=1), (h, kvh, kvh)))
        # (tokens, heads, d) -> (heads, tokens, d): SDPA attends over the second-to-last dimension.
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=self.causal, enable_gqa=kvh != h)
        out = weft.ops.all_to_all_o_proj(attn.transpose(0, 1), self.o_weight, group=self.group)
        return out if self.o_bias is None else out + self.o_bias


class SPDecodeAttention(nn.Module):
    """Decode attention over a KV cache sharded by position (see the module doc).

    forward(x, k_cache, v_cache, seqlens): x (batch, hidden), the new token of each sequence, the same on
    every rank; k_cache, v_cache (batch, max_len, kv_heads, head_dim) this rank's slice of the cache, in
    flash_decode's contiguous layout; seqlens (batch,) int32, this rank's slice lengths. On `append_rank`
    the token's k and v are written at position seqlens[b] and seqlens is incremented in place (the slice
    must have room: not checked, that would need a host sync). Returns (batch, hidden), the same on every
    rank. head_dim must be one flash_decode takes (64, 128, 256).
    """

    def __init__(self, q_weight: torch.Tensor, kv_weight: torch.Tensor, o_weight: torch.Tensor, heads: int,
                 kv_heads: int | None = None, q_bias: torch.Tensor | None = None,
                 kv_bias: torch.Tensor | None = None, o_bias: torch.Tensor | None = None, group=None):
        super().__init__()
        self.group = weft.get_group(group)  # the ranks the cache is split over (default: the world)
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = q_weight.shape[1] // heads
        if kv_weight.shape[1] != 2 * self.kv_heads * self.head_dim:
            raise ValueError(f"kv_weight has {kv_weight.shape[1]} columns, expected 2 * kv_heads * head_dim = "
                             f"{2 * self.kv_heads * self.head_dim}")
        self.q_weight, self.kv_weight, self.o_weight = _param(q_weight), _param(kv_weight), _param(o_weight)
        self.q_bias, self.kv_bias, self.o_bias = _param(q_bias), _param(kv_bias), _param(o_bias)

    @classmethod
    def from_dense(cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, o_proj: nn.Linear,
                   heads: int, group=None) -> "SPDecodeAttention":
        (wq, wk, wv, wo), (bq, bk, bv, bo), kv_heads, _ = _dense_weights(q_proj, k_proj, v_proj, o_proj, heads)
        kv_bias = None
        if bk is not None or bv is not None:
            kv_bias = torch.cat([b if b is not None else torch.zeros(p.out_features, dtype=p.weight.dtype,
                                                                      device=p.weight.device)
                                 for b, p in ((bk, k_proj), (bv, v_proj))])
        return cls(wq, torch.cat([wk, wv], dim=1), wo, heads, kv_heads, bq, kv_bias, bo, group)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                append_rank: int | None = None) -> torch.Tensor:
        batch, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        group = self.group
        append_rank = group.size - 1 if append_rank is None else append_rank
        if not 0 <= append_rank < group.size:
            raise ValueError(f"append_rank must be in [0, {group.size}), got {append_rank}")
        q = torch.matmul(x, self.q_weight)
        if self.q_bias is not None:
            q = q + self.q_bias
        if group.rank == append_rank:
            kv = torch.matmul(x, self.kv_weight)
            if self.kv_bias is not None:
                kv = kv + self.kv_bias
            kv = kv.view(batch, 2, kvh, d)
            rows, pos = torch.arange(batch, device=x.device), seqlens.long()
            k_cache[rows, pos] = kv[:, 0]
            v_cache[rows, pos] = kv[:, 1]
            seqlens += 1
        out = weft.ops.sp_flash_decode(q.view(batch, h, d), k_cache, v_cache, seqlens, group=group)
        out = torch.matmul(out.view(batch, h * d), self.o_weight)
        return out if self.o_bias is None else out + self.o_bias
