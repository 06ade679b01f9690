"""Host ops: argument checks, cached workspaces, kernel launches.

Each op calls its implementation (weft/kernels) directly; only a call that is traced (torch.compile, export,
make_fx, a fake-tensor mode) or that autograd must record goes through the PyTorch operator
`torch.ops.weft.*` (weft/torch_ops.py), whose dispatch costs more than the op's own host time.
"""
from __future__ import annotations

import torch

from . import torch_ops as _t
from .kernels import ag_gemm as _ag_gemm
from .kernels import all_gather as _all_gather
from .kernels import all_reduce as _all_reduce
from .kernels import flash_decode as _flash_decode
from .kernels import gemm_ar as _gemm_ar
from .kernels import gemm_rs as _gemm_rs
from .kernels.barrier import device_barrier
from .kernels.common import world_or_raise
from .kernels import moe as _moe
from .kernels.moe import (GroupLayout, check_routing_values, ep_combine, ep_combine_ll, ep_dispatch, ep_dispatch_ll,
                          fp8_blocks, grouped_gemm, routed_gemm, routed_gemm_sum, routing_layout)
from .kernels.moe import tp as _moe_tp
from .kernels import pointwise as _pointwise
from .kernels.ulysses import all_to_all_o_proj, qkv_all_to_all, ulysses_all_to_all

__all__ = ["ag_gemm", "all_gather", "all_reduce", "reduce_scatter", "broadcast", "device_barrier", "gemm_rs", "gemm_ar",
           "flash_decode", "sp_flash_decode", "ulysses_all_to_all", "qkv_all_to_all", "all_to_all_o_proj",
           "router_topk", "routing_layout", "check_routing_values", "ep_dispatch", "ep_combine", "ep_dispatch_ll",
           "ep_combine_ll", "grouped_gemm", "fp8_rows", "fp8_blocks", "silu_mul", "ag_group_gemm", "group_gemm_rs",
           "routed_gemm", "routed_gemm_sum", "GroupLayout"]

_traced = _t.traced


def _doc(impl):
    """The implementation's documentation on the public function (same signature)."""
    def wrap(fn):
        fn.__doc__ = impl.__doc__
        return fn
    return wrap


def _into(out, result):
    """A traced call's `out`: the operator's result copied into it (what functionalization makes of it)."""
    if out is None:
        return result
    out.copy_(result)
    return out


def _no_config(config) -> None:
    if config is not None:
        raise TypeError("config cannot be given to a traced or differentiated call (torch.ops.weft takes none)")


@_doc(_all_reduce.all_reduce)
def all_reduce(x, op="sum", method="auto", out=None):
    if not _traced(x, out):
        return _all_reduce.all_reduce(x, op, method, out)
    w = world_or_raise().world_size
    if out is x and not (torch.is_grad_enabled() and x.requires_grad):
        torch.ops.weft.all_reduce_(x, w, op, method)
        return x
    return _into(out, torch.ops.weft.all_reduce(x, w, op, method))


@_doc(_all_gather.all_gather)
def all_gather(x, out=None, method="auto"):
    if not _traced(x, out):
        return _all_gather.all_gather(x, out, method)
    return _into(out, torch.ops.weft.all_gather(x, world_or_raise().world_size, method))


@_doc(_all_reduce.reduce_scatter)
def reduce_scatter(x, op="sum", out=None, method="auto"):
    if not _traced(x, out):
        return _all_reduce.reduce_scatter(x, op, out, method)
    return _into(out, torch.ops.weft.reduce_scatter(x, world_or_raise().world_size, op, method))


@_doc(_all_reduce.broadcast)
def broadcast(x, root=0):
    if not _traced(x):
        return _all_reduce.broadcast(x, root)
    w = world_or_raise().world_size
    if torch.is_grad_enabled() and x.requires_grad:  # in place for autograd: a copy of the functional result
        return x.copy_(torch.ops.weft.broadcast(x, w, root))
    torch.ops.weft.broadcast_(x, w, root)
    return x


@_doc(_ag_gemm.ag_gemm)
def ag_gemm(a_shard, b, method="auto", out=None, return_gathered=False, config=None):
    if not _traced(a_shard, b, out):
        return _ag_gemm.ag_gemm(a_shard, b, method, out, return_gathered, config)
    _no_config(config)
    c, gathered = torch.ops.weft.ag_gemm(a_shard, b, world_or_raise().world_size, method,
                                         return_gathered or (torch.is_grad_enabled() and b.requires_grad))
    c = _into(out, c)
    return (c, gathered) if return_gathered else c


@_doc(_gemm_rs.gemm_rs)
def gemm_rs(a, b_shard, method="auto", out=None, config=None):
    if not _traced(a, b_shard, out):
        return _gemm_rs.gemm_rs(a, b_shard, method, out, config)
    _no_config(config)
    return _into(out, torch.ops.weft.gemm_rs(a, b_shard, world_or_raise().world_size, method))


@_doc(_gemm_ar.gemm_ar)
def gemm_ar(a, b_shard, method="auto", out=None):
    if not _traced(a, b_shard, out):
        return _gemm_ar.gemm_ar(a, b_shard, method, out)
    return _into(out, torch.ops.weft.gemm_ar(a, b_shard, world_or_raise().world_size, method))


@_doc(_flash_decode.flash_decode)
def flash_decode(q, k_cache, v_cache, seqlens, block_table=None, scale=None, return_lse=False):
    if not _traced(q, k_cache, v_cache):
        return _flash_decode.flash_decode(q, k_cache, v_cache, seqlens, block_table, scale, return_lse)
    out, lse = torch.ops.weft.flash_decode(q, k_cache, v_cache, seqlens, block_table, scale)
    return (out, lse) if return_lse else out


@_doc(_flash_decode.sp_flash_decode)
def sp_flash_decode(q, k_cache_shard, v_cache_shard, seqlens_shard, block_table=None, scale=None):
    if not _traced(q, k_cache_shard, v_cache_shard):
        return _flash_decode.sp_flash_decode(q, k_cache_shard, v_cache_shard, seqlens_shard, block_table, scale)
    return torch.ops.weft.sp_flash_decode(q, k_cache_shard, v_cache_shard, seqlens_shard,
                                          world_or_raise().world_size, block_table, scale)


@_doc(_moe.router_topk)
def router_topk(logits, k, renormalize=True):
    if not _traced(logits):
        return _moe.router_topk(logits, k, renormalize)
    return _moe.router_topk_torch(logits, k, renormalize)


@_doc(_pointwise.silu_mul)
def silu_mul(h, counts=None, fp8=False):
    if not _traced(h):
        return _pointwise.silu_mul(h, counts, fp8)
    return _pointwise.silu_mul_torch(h, fp8)  # torch's own ops: traced and differentiated as they are


@_doc(_pointwise.fp8_rows)
def fp8_rows(x, counts=None):
    if not _traced(x):
        return _pointwise.fp8_rows(x, counts)
    return _pointwise.fp8_rows_torch(x)


@_doc(_moe_tp.ag_group_gemm)
def ag_group_gemm(tokens_shard, w_experts_shard, topk_idx, method="auto", out=None):
    if not _traced(tokens_shard, w_experts_shard, out):
        return _moe_tp.ag_group_gemm(tokens_shard, w_experts_shard, topk_idx, method, out)
    inter, meta, row_of_pair = torch.ops.weft.ag_group_gemm(tokens_shard, w_experts_shard, topk_idx,
                                                            world_or_raise().world_size, method)
    return _into(out, inter), GroupLayout(meta, w_experts_shard.shape[0], topk_idx.shape[1], topk_idx.shape[0],
                                          row_of_pair)


@_doc(_moe_tp.group_gemm_rs)
def group_gemm_rs(h, w_down_shard, topk_idx, topk_weights, layout=None, method="auto", out=None):
    if not _traced(h, w_down_shard, out):
        return _moe_tp.group_gemm_rs(h, w_down_shard, topk_idx, topk_weights, layout, method, out)
    meta, row_of_pair = (None, None) if layout is None else (layout.meta, layout.row_of_pair)
    return _into(out, torch.ops.weft.group_gemm_rs(h, w_down_shard, topk_idx, topk_weights, meta, row_of_pair,
                                                   world_or_raise().world_size, method))
