"""Column- and row-parallel linear layers on weft's overlapped GEMMs.

A tensor-parallel MLP is ColumnParallelLinear -> activation -> RowParallelLinear: the column layer holds the
rank's slice of the output features, the row layer the matching slice of its input features, and the pair
communicates once each way.

- sequence_parallel=True (training, prefill): activations between blocks are split by token over the ranks
  (rank r holds rows [r * T / W, (r + 1) * T / W) of the flattened tokens). Column: ag_gemm (all-gather of
  the tokens under the GEMM); row: gemm_rs (the GEMM's partial sums reduce-scattered back to token shards).
  The backward is the ops' own (declared with them: weft/kernels/ag_gemm.py, gemm_rs.py): gemm_rs and ag_gemm
  swap roles. With each rank's loss taken on its own tokens, the gradients are those of the single-process model.
- sequence_parallel=False (plain tensor parallelism, decode): activations are replicated. Column: a local
  GEMM; row: gemm_ar (all-reduce fused with the GEMM for small token counts). Gradients follow Megatron's
  convention: every rank computes the same loss once, the all-reduce's backward passes the (replicated)
  gradient through, and the column layer all-reduces the gradient of its replicated input.

Weights are stored transposed against nn.Linear, as (in_features, out_features) slices made contiguous,
because weft's overlapped GEMMs take B as a contiguous (K, N) matrix. A bias that every rank holds whole
(the row layer's) gets its gradient summed over the ranks where each rank saw only its own tokens.
"""
from __future__ import annotations

import math

import torch
from torch import nn

import weft
from weft import ops


class _CopyToParallel(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward: a tensor that every rank holds whole and that each
    rank uses on its own part of the work (Megatron's "copy to tensor-parallel region")."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ops.all_reduce(grad, group=ctx.group), None


class _GemmArReplicated(torch.autograd.Function):
    """gemm_ar whose output is used identically on every rank (one loss): the gradient of the output is the same
    everywhere, so the backward is local (Megatron's "reduce from tensor-parallel region")."""

    @staticmethod
    def forward(ctx, a, b_shard, group):
        ctx.save_for_backward(a, b_shard)
        return ops.gemm_ar(a, b_shard, group=group)

    @staticmethod
    def backward(ctx, grad):
        a, b_shard = ctx.saved_tensors
        grad_a = grad @ b_shard.t() if ctx.needs_input_grad[0] else None
        grad_b = a.t() @ grad if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None


def shard_of(group, rank, world_size) -> tuple[int, int]:
    """(rank, world_size) of a layer's shard: those given, else this rank's in `group` (default: the world)."""
    if rank is not None and world_size is not None:
        return rank, world_size  # (the shapes' checks need no world)
    g = weft.get_group(group)
    return (g.rank if rank is None else rank), (g.size if world_size is None else world_size)


def _split(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise ValueError(f"{what} = {total} is not divisible by the world size {world_size}")
    return total // world_size


def _uninitialised(cls, linear: nn.Linear, rank, world_size, sequence_parallel, group):
    """A layer of `cls` shaped for `linear`'s shard, its parameters left uninitialised (from_linear copies
    them in): made on the meta device, then given memory. A random initialisation would draw from the
    device's generator for nothing."""
    out_features, in_features = linear.weight.shape
    return nn.utils.skip_init(cls, in_features, out_features, linear.bias is not None, rank=rank,
                              world_size=world_size, sequence_parallel=sequence_parallel, group=group,
                              device=linear.weight.device, dtype=linear.weight.dtype)


class _ParallelLinear(nn.Module):
    def __init__(self, in_local, out_local, bias_features, fan_in, bias, rank, world_size, sequence_parallel,
                 group, device, dtype):
        super().__init__()
        self.rank, self.world_size, self.sequence_parallel = rank, world_size, sequence_parallel
        self.group = weft.get_group(group)
        self.weight = nn.Parameter(torch.empty(in_local, out_local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(bias_features, device=device, dtype=dtype)) if bias else None
        # nn.Linear's initialisation (uniform in +-1/sqrt(fan_in) of the whole layer), per shard.
        bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        return (f"weight={tuple(self.weight.shape)}, bias={self.bias is not None}, rank={self.rank}, "
                f"world_size={self.world_size}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x @ Wᵀ + b for this rank's slice of the output features (out_features / W of them).

    sequence_parallel: x is this rank's tokens (..., in_features) and y covers every rank's tokens
    (W * tokens, out_features / W), flattened to 2-D. Otherwise x holds every token on every rank and
    y is (..., out_features / W). `weight`: (in_features, out_features / W), Wᵀ's column slice.
    W is the size of `group` (default: the world), over which the layer communicates; rank and world_size
    default to this rank's in it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int | None = None,
                 world_size: int | None = None, sequence_parallel: bool = True, group=None, device=None,
                 dtype=None):
        rank, world_size = shard_of(group, rank, world_size)
        self.in_features, self.out_features = in_features, out_features
        super().__init__(in_features, _split(out_features, world_size, "out_features"),
                         _split(out_features, world_size, "out_features"), in_features, bias, rank, world_size,
                         sequence_parallel, group, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int | None = None, world_size: int | None = None,
                    sequence_parallel: bool = True, group=None):
        """This rank's shard of `linear` (its weight's rows [rank * out / W, (rank + 1) * out / W))."""
        rank, world_size = shard_of(group, rank, world_size)
        out_features, in_features = linear.weight.shape
        layer = _uninitialised(cls, linear, rank, world_size, sequence_parallel, group)
        n = out_features // world_size
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rank * n:(rank + 1) * n].t())
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[rank * n:(rank + 1) * n])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = ops.ag_gemm(x.reshape(-1, self.in_features), self.weight, group=self.group)
        else:
            y = _CopyToParallel.apply(x, self.group) @ self.weight
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_ParallelLinear):
    """y = x @ Wᵀ + b from this rank's slice of the input features (in_features / W of them).

    sequence_parallel: x (tokens, in_features / W) covers every rank's tokens and y is this rank's share of
    them (tokens / W, out_features), by gemm_rs. Otherwise x is (..., in_features / W) and y (..., out_features)
    the same on every rank, by gemm_ar. `weight`: (in_features / W, out_features), Wᵀ's row slice; `bias`
    the whole (out_features,), on every rank. W, rank, world_size: as ColumnParallelLinear's (`group`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int | None = None,
                 world_size: int | None = None, sequence_parallel: bool = True, group=None, device=None,
                 dtype=None):
        rank, world_size = shard_of(group, rank, world_size)
        self.in_features, self.out_features = in_features, out_features
        super().__init__(_split(in_features, world_size, "in_features"), out_features, out_features, in_features,
                         bias, rank, world_size, sequence_parallel, group, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int | None = None, world_size: int | None = None,
                    sequence_parallel: bool = True, group=None):
        """This rank's shard of `linear` (its weight's columns [rank * in / W, (rank + 1) * in / W)), bias whole."""
        rank, world_size = shard_of(group, rank, world_size)
        out_features, in_features = linear.weight.shape
        layer = _uninitialised(cls, linear, rank, world_size, sequence_parallel, group)
        k = in_features // world_size
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, rank * k:(rank + 1) * k].t())
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.weight.shape[0]
        if self.sequence_parallel:
            y = ops.gemm_rs(x.reshape(-1, k), self.weight, group=self.group)
            # Each rank adds the bias to its own tokens only: its gradient is summed over the ranks.
            return y if self.bias is None else y + _CopyToParallel.apply(self.bias, self.group)
        y = _GemmArReplicated.apply(x.reshape(-1, k), self.weight, self.group).reshape(*x.shape[:-1],
                                                                                     self.out_features)
        return y if self.bias is None else y + self.bias
