"""The process group's own collectives into a given output (NCCL on GPUs, gloo on the cpu backend): what weft's ops
fall back to (`method="nccl"`, `auto` where NCCL is measured faster) and what the NCCL baseline layers call."""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renames all_gather_into_tensor and reduce_scatter_tensor; the GPU machines run 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group=None):
    """out = concat over ranks of x (dim 0); both contiguous."""
    return _all_gather_single(out, x, group=group)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group=None, op=dist.ReduceOp.SUM):
    """out on rank r = rows [r * m, (r + 1) * m) of the reduction (`op`, default the sum) over ranks of x; both
    contiguous."""
    return _reduce_scatter_single(out, x, op=op, group=group)
