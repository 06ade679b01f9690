"""weft's ops as PyTorch operators (`torch.ops.weft.*`), for torch.compile, CUDA-graph trees and autograd.

Every op is a `torch.library` custom op whose implementation is the eager op itself and whose fake
implementation computes the output shapes from the arguments alone: the world size is an explicit int
argument (checked against the running world by the real implementation), so tracing needs no process group
and does no communication.

    torch.ops.weft.all_reduce(x, world_size, op, method)              -> (x's shape)
    torch.ops.weft.all_reduce_(x, world_size, op, method)             -> (), x summed in place
    torch.ops.weft.all_gather(x, world_size, method)                  -> (W * rows, ...)
    torch.ops.weft.reduce_scatter(x, world_size, op, method)          -> (rows / W, ...)
    torch.ops.weft.broadcast(x, world_size, root)                     -> the root's x
    torch.ops.weft.broadcast_(x, world_size, root)                    -> (), x overwritten in place
    torch.ops.weft.ag_gemm(a_shard, b, world_size, method, return_gathered)
                                                                      -> (c, gathered A, or an empty (0, K))
    torch.ops.weft.gemm_rs(a, b_shard, world_size, method)            -> (M / W, N)
    torch.ops.weft.gemm_ar(a, b_shard, world_size, method)            -> (M, N)
    torch.ops.weft.flash_decode(q, k_cache, v_cache, seqlens, block_table, scale) -> (out, lse)
    torch.ops.weft.sp_flash_decode(q, k_cache_shard, v_cache_shard, seqlens_shard, world_size, block_table,
                                   scale)                             -> out
    torch.ops.weft.ag_group_gemm(tokens_shard, w_experts_shard, topk_idx, world_size, method)
                                                                      -> (inter, the layout's meta, row_of_pair)
    torch.ops.weft.group_gemm_rs(h, w_down_shard, topk_idx, topk_weights, meta, row_of_pair, world_size, method)
                                                                      -> (m, hidden)  (meta, row_of_pair: the
                                                                         layout, or None both)

`weft.ops.*` call the implementations directly (a custom op's dispatch costs 7-21 us per call) and come
here only when the call is traced (torch.compile, export, make_fx, a fake-tensor mode) or has to record
autograd history: `traced(...)` is that test.

Autograd convention (that of torch.distributed.nn): an op is differentiated as a function from every rank's
inputs to every rank's outputs, of an objective that is the sum of the ranks' own losses. So
- all_gather and reduce_scatter are each other's backward;
- all_reduce's backward is the all_reduce of the gradient (and gemm_ar's: all_reduce(grad) @ b_shardᵀ);
- broadcast's: that all_reduce on the root, zero elsewhere;
- ag_gemm: grad_a_shard = gemm_rs(grad_c, bᵀ) (= reduce_scatter(grad_c @ bᵀ)), grad_b = gatheredᵀ @ grad_c
  with the gathered A that the forward returns;
- gemm_rs: grad_a = ag_gemm(grad_out, b_shardᵀ) (= all_gather(grad_out) @ b_shardᵀ), grad_b_shard =
  aᵀ @ all_gather(grad_out), the gathered gradient coming back from that same ag_gemm.
Sequence-parallel programs (activations split by token over the ranks, each rank's loss on its own tokens)
get exactly the single-process gradients this way. A program whose activations are *replicated* (plain
tensor parallelism: every rank computes the same loss on the same output) counts that loss W times under
this convention; weft.layers' plain-TP layers use Megatron's convention instead (see weft/layers/linear.py).
Every backward runs on weft's ops, never NCCL (except where the op's own `auto` picks it). The TP-MoE ops
(ag_group_gemm, group_gemm_rs) are inference only: no autograd.
"""
from __future__ import annotations

from typing import Optional

import torch

from .kernels import ag_gemm as _ag_gemm
from .kernels import all_gather as _all_gather
from .kernels import all_reduce as _all_reduce
from .kernels import flash_decode as _flash_decode
from .kernels import gemm_ar as _gemm_ar
from .kernels import gemm_rs as _gemm_rs
from .kernels.moe import tp as _moe_tp
from .kernels.common import world_or_raise

_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_grad_enabled = torch.is_grad_enabled


def traced(a, b=None, c=None) -> bool:
    """Whether a weft.ops call with tensor arguments a, b, c (None where absent) must go through torch.ops.weft:
    under torch.compile/export (dynamo: is_compiling() folds to True, the rest is never traced), under a
    dispatch mode (make_fx, AOT autograd tracing a backward, FakeTensorMode), or when autograd has to record
    the call (grad mode on and an input that requires grad). Well under a microsecond on the eager path."""
    if _is_compiling() or _dispatch_modes():
        return True
    try:
        return bool((a.requires_grad or (b is not None and b.requires_grad) or (c is not None and c.requires_grad))
                    and _grad_enabled())
    except AttributeError:  # not a tensor: the implementation's checks name the argument
        return False


def _check_world_size(world_size: int) -> None:
    w = world_or_raise().world_size
    if world_size != w:
        raise ValueError(f"world_size is {world_size}, but weft runs on {w} ranks")


def _fresh(t: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy where it shares memory with an input (a custom op's outputs may not alias its inputs;
    on one rank some ops hand their input back)."""
    return t.clone() if any(t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr() for i in inputs) else t


def _rows_divisible(x: torch.Tensor, world_size: int) -> None:
    if x.dim() == 0 or x.shape[0] % world_size:
        raise ValueError(f"x has shape {tuple(x.shape)}: its rows are not divisible by the world size {world_size}")


def _matmul_operands(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{a_name} {tuple(a.shape)} and {b_name} {tuple(b.shape)} are not 2-D operands of a matmul")


# -- collectives ---------------------------------------------------------------------

@torch.library.custom_op("weft::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, world_size: int, op: str = "sum", method: str = "auto") -> torch.Tensor:
    _check_world_size(world_size)
    return _fresh(_all_reduce.all_reduce(x, op=op, method=method), x)


@all_reduce.register_fake
def _(x, world_size, op="sum", method="auto"):
    return x.new_empty(x.shape)


@torch.library.custom_op("weft::all_reduce_", mutates_args=("x",))
def all_reduce_(x: torch.Tensor, world_size: int, op: str = "sum", method: str = "auto") -> None:
    _check_world_size(world_size)
    _all_reduce.all_reduce(x, op=op, method=method, out=x)


@all_reduce_.register_fake
def _(x, world_size, op="sum", method="auto"):
    return None


@torch.library.custom_op("weft::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, world_size: int, method: str = "auto") -> torch.Tensor:
    _check_world_size(world_size)
    return _fresh(_all_gather.all_gather(x, method=method), x)


@all_gather.register_fake
def _(x, world_size, method="auto"):
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    return x.new_empty((world_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("weft::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, world_size: int, op: str = "sum", method: str = "auto") -> torch.Tensor:
    _check_world_size(world_size)
    return _fresh(_all_reduce.reduce_scatter(x, op=op, method=method), x)


@reduce_scatter.register_fake
def _(x, world_size, op="sum", method="auto"):
    _rows_divisible(x, world_size)
    return x.new_empty((x.shape[0] // world_size, *x.shape[1:]))


@torch.library.custom_op("weft::broadcast", mutates_args=())
def broadcast(x: torch.Tensor, world_size: int, root: int = 0) -> torch.Tensor:
    _check_world_size(world_size)
    return _all_reduce.broadcast(x.clone(memory_format=torch.contiguous_format), root=root)


@broadcast.register_fake
def _(x, world_size, root=0):
    return x.new_empty(x.shape)


@torch.library.custom_op("weft::broadcast_", mutates_args=("x",))
def broadcast_(x: torch.Tensor, world_size: int, root: int = 0) -> None:
    _check_world_size(world_size)
    _all_reduce.broadcast(x, root=root)


@broadcast_.register_fake
def _(x, world_size, root=0):
    return None


# -- overlapped GEMMs ----------------------------------------------------------------

@torch.library.custom_op("weft::ag_gemm", mutates_args=())
def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, world_size: int, method: str = "auto",
            return_gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _check_world_size(world_size)
    if return_gathered:
        c, gathered = _ag_gemm.ag_gemm(a_shard, b, method=method, return_gathered=True)
        return c, _fresh(gathered, a_shard)
    return _ag_gemm.ag_gemm(a_shard, b, method=method), a_shard.new_empty((0, a_shard.shape[1]))


@ag_gemm.register_fake
def _(a_shard, b, world_size, method="auto", return_gathered=False):
    _matmul_operands("a_shard", a_shard, "b", b)
    rows = world_size * a_shard.shape[0]
    return (a_shard.new_empty((rows, b.shape[1])),
            a_shard.new_empty((rows if return_gathered else 0, a_shard.shape[1])))


@torch.library.custom_op("weft::gemm_rs", mutates_args=())
def gemm_rs(a: torch.Tensor, b_shard: torch.Tensor, world_size: int, method: str = "auto") -> torch.Tensor:
    _check_world_size(world_size)
    return _gemm_rs.gemm_rs(a, b_shard, method=method)


@gemm_rs.register_fake
def _(a, b_shard, world_size, method="auto"):
    _matmul_operands("a", a, "b_shard", b_shard)
    _rows_divisible(a, world_size)
    return a.new_empty((a.shape[0] // world_size, b_shard.shape[1]))


# -- tensor-parallel MoE (inference only) ----------------------------------------------

@torch.library.custom_op("weft::ag_group_gemm", mutates_args=())
def ag_group_gemm(tokens_shard: torch.Tensor, w_experts_shard: torch.Tensor, topk_idx: torch.Tensor, world_size: int,
                  method: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_world_size(world_size)
    inter, layout = _moe_tp.ag_group_gemm(tokens_shard, w_experts_shard, topk_idx, method=method)
    return inter, layout.meta, layout.row_of_pair


@ag_group_gemm.register_fake
def _(tokens_shard, w_experts_shard, topk_idx, world_size, method="auto"):
    m, k = topk_idx.shape
    experts, _, n = w_experts_shard.shape
    return (tokens_shard.new_empty((world_size * m * k, n)),
            topk_idx.new_empty((world_size, experts + 2 + m * k), dtype=torch.int32),
            topk_idx.new_empty((world_size * m, k), dtype=torch.int32))


@torch.library.custom_op("weft::group_gemm_rs", mutates_args=())
def group_gemm_rs(h: torch.Tensor, w_down_shard: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  meta: Optional[torch.Tensor], row_of_pair: Optional[torch.Tensor], world_size: int,
                  method: str = "auto") -> torch.Tensor:
    _check_world_size(world_size)
    layout = None if meta is None else _moe_tp.GroupLayout(meta, w_down_shard.shape[0], topk_idx.shape[1],
                                                           topk_idx.shape[0], row_of_pair)
    return _moe_tp.group_gemm_rs(h, w_down_shard, topk_idx, topk_weights, layout, method=method)


@group_gemm_rs.register_fake
def _(h, w_down_shard, topk_idx, topk_weights, meta, row_of_pair, world_size, method="auto"):
    return h.new_empty((topk_idx.shape[0], w_down_shard.shape[2]))


@torch.library.custom_op("weft::gemm_ar", mutates_args=())
def gemm_ar(a: torch.Tensor, b_shard: torch.Tensor, world_size: int, method: str = "auto") -> torch.Tensor:
    _check_world_size(world_size)
    return _gemm_ar.gemm_ar(a, b_shard, method=method)


@gemm_ar.register_fake
def _(a, b_shard, world_size, method="auto"):
    _matmul_operands("a", a, "b_shard", b_shard)
    return a.new_empty((a.shape[0], b_shard.shape[1]))


# -- attention (not differentiable) ---------------------------------------------------------

@torch.library.custom_op("weft::flash_decode", mutates_args=())
def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                 block_table: Optional[torch.Tensor] = None,
                 scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _flash_decode.flash_decode(q, k_cache, v_cache, seqlens, block_table, scale, return_lse=True)


@flash_decode.register_fake
def _(q, k_cache, v_cache, seqlens, block_table=None, scale=None):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("weft::sp_flash_decode", mutates_args=())
def sp_flash_decode(q: torch.Tensor, k_cache_shard: torch.Tensor, v_cache_shard: torch.Tensor,
                    seqlens_shard: torch.Tensor, world_size: int, block_table: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None) -> torch.Tensor:
    _check_world_size(world_size)
    return _flash_decode.sp_flash_decode(q, k_cache_shard, v_cache_shard, seqlens_shard, block_table, scale)


@sp_flash_decode.register_fake
def _(q, k_cache_shard, v_cache_shard, seqlens_shard, world_size, block_table=None, scale=None):
    return q.new_empty(q.shape)


# A collective must run on every rank or on none: a graph pass must not drop one whose result a rank does not
# use (broadcast's backward on a rank other than the root), or the others wait for that rank for ever. So the
# functional collectives count as having side effects: fx's dead-code elimination keeps them, and so does
# inductor's in torch 2.13 (torch._library.utils.is_impure). torch.library's effect tokens would do it too, at
# the price of a token threaded through every graph.
for _op in (all_reduce, all_gather, reduce_scatter, broadcast, ag_gemm, gemm_rs, gemm_ar, sp_flash_decode):
    torch.fx.node.has_side_effect(_op._opoverload)


# -- autograd -------------------------------------------------------------------------------
# The backwards call weft.ops, which run the implementations directly in eager backward and go through
# torch.ops.weft when AOT autograd traces the backward graph.

def _ops():
    from . import ops
    return ops


def _all_reduce_backward(ctx, grad):
    return _ops().all_reduce(grad), None, None, None


def _all_gather_backward(ctx, grad):
    return _ops().reduce_scatter(grad), None, None


def _reduce_scatter_backward(ctx, grad):
    return _ops().all_gather(grad), None, None, None


def _broadcast_setup(ctx, inputs, output):
    ctx.root = inputs[2] if len(inputs) > 2 else 0


def _broadcast_backward(ctx, grad):
    # Every rank's output is the root's x: the root's gradient is the sum of all of them, the others' zero.
    summed = _ops().all_reduce(grad)
    return (summed if world_or_raise().rank == ctx.root else torch.zeros_like(grad)), None, None


all_reduce.register_autograd(_all_reduce_backward)
broadcast.register_autograd(_broadcast_backward, setup_context=_broadcast_setup)
all_gather.register_autograd(_all_gather_backward)
reduce_scatter.register_autograd(_reduce_scatter_backward)


def _ag_gemm_setup(ctx, inputs, output):
    a_shard, b, _, _, return_gathered = inputs
    # b's gradient takes the gathered A from the output; without it (return_gathered=False) the backward
    # gathers a_shard again.
    ctx.save_for_backward(a_shard, b, output[1] if ctx.needs_input_grad[1] else None)
    ctx.return_gathered = return_gathered
    # An output nobody used gets None, not zeros: weft.ops.ag_gemm asks for the gathered A for the backward's
    # sake alone whenever b needs a gradient, and a reduce_scatter of zeros would be a wasted collective.
    ctx.set_materialize_grads(False)


def _ag_gemm_backward(ctx, grad_c, grad_gathered):
    a_shard, b, gathered = ctx.saved_tensors
    ops = _ops()
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        if grad_c is not None:
            # bᵀ made contiguous: weft's overlapped gemm_rs needs contiguous operands (a copy of the weight
            # shard costs far less than losing the overlap).
            grad_a = ops.gemm_rs(grad_c, b.t().contiguous())
        if ctx.return_gathered and grad_gathered is not None:  # else it is the empty placeholder's
            scattered = ops.reduce_scatter(grad_gathered)
            grad_a = scattered if grad_a is None else grad_a + scattered
    if ctx.needs_input_grad[1] and grad_c is not None:
        if not ctx.return_gathered:
            gathered = ops.all_gather(a_shard)
        grad_b = gathered.t() @ grad_c
    return grad_a, grad_b, None, None, None


ag_gemm.register_autograd(_ag_gemm_backward, setup_context=_ag_gemm_setup)


def _save_operands(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


def _gemm_rs_backward(ctx, grad):
    a, b_shard = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    ops = _ops()
    grad_a = grad_b = None
    if need_a and need_b:  # one gather of the gradient serves both
        grad_a, gathered = ops.ag_gemm(grad, b_shard.t().contiguous(), return_gathered=True)
    elif need_a:
        grad_a = ops.ag_gemm(grad, b_shard.t().contiguous())
    elif need_b:
        gathered = ops.all_gather(grad)
    if need_b:
        grad_b = a.t() @ gathered
    return grad_a, grad_b, None, None


gemm_rs.register_autograd(_gemm_rs_backward, setup_context=_save_operands)


def _gemm_ar_backward(ctx, grad):
    a, b_shard = ctx.saved_tensors
    grad = _ops().all_reduce(grad)
    grad_a = grad @ b_shard.t() if ctx.needs_input_grad[0] else None
    grad_b = a.t() @ grad if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


gemm_ar.register_autograd(_gemm_ar_backward, setup_context=_save_operands)
