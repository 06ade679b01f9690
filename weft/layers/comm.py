"""How the tensor-parallel layers of a decoder communicate: on weft's ops, or on the NCCL + cuBLAS baseline.

A layer asks its `comm` for seven things; the two implementations compute the same values:

    call                  what it is                                  "weft"              "nccl"
    ag_gemm(x_shard, w)   all_gather(x_shard, dim 0) @ w (column, SP)  ops.ag_gemm         all_gather, matmul
    gemm_rs(x, w)         reduce_scatter(x @ w, dim 0) (row, SP)      ops.gemm_rs         matmul, reduce_scatter
    gemm_ar(x, w)         all_reduce(x @ w) (row, plain TP)           ops.gemm_ar         matmul, all_reduce
    gemm_ar_residual(x, w, r)  r + all_reduce(x @ w) (decode's row    ops.linear_residual_ar  matmul, all_reduce,
                          projections: O, down)                                           add
    all_reduce(x)         the sum over ranks                          ops.all_reduce      all_reduce
    reduce_scatter(x)     rows [r m, (r + 1) m) of the sum            ops.reduce_scatter  reduce_scatter
    all_gather(x)         the concatenation over ranks (dim 0)        ops.all_gather      all_gather

"nccl" is the tensor parallelism of Megatron-LM (sequence-parallel prefill: all-gather before the column
GEMM, reduce-scatter after the row GEMM) and of vLLM (decode: all-reduce after the row GEMM), each
collective the process group's own (NCCL on GPUs, gloo on the cpu backend) and not overlapped with the
GEMM: the baseline that `weft bench e2e` and `weft demo` compare weft against. Both are stateless and
graph-capturable (weft's ops once their workspaces exist; NCCL by torch.distributed's capture support).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft import ops
from weft.runtime.process_group import all_gather_into, reduce_scatter_into


class Comm:
    """The communication of the tensor-parallel layers (see the module doc) over `group` (default: the world);
    `name` is what from_hf takes."""
    name = ""

    def __init__(self, group=None):
        self.group = weft.get_group(group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group!r})"


class WeftComm(Comm):
    """weft's ops, method "auto" (each picks its overlapped kernel or its own baseline by measured size)."""
    name = "weft"

    def ag_gemm(self, x_shard, w):
        return ops.ag_gemm(x_shard, w, group=self.group)

    def gemm_rs(self, x, w):
        return ops.gemm_rs(x, w, group=self.group)

    def gemm_ar(self, x, w):
        return ops.gemm_ar(x, w, group=self.group)

    def gemm_ar_residual(self, x, w, residual):
        return ops.linear_residual_ar(x, w, residual, group=self.group)

    def all_reduce(self, x):
        return ops.all_reduce(x, group=self.group)

    def reduce_scatter(self, x):
        return ops.reduce_scatter(x, group=self.group)

    def all_gather(self, x):
        return ops.all_gather(x, group=self.group)


class NcclComm(Comm):
    """The process group's collectives around torch.matmul, one after the other (no overlap)."""
    name = "nccl"

    def ag_gemm(self, x_shard, w):
        return self.all_gather(x_shard) @ w

    def gemm_rs(self, x, w):
        return self.reduce_scatter(x @ w)

    def gemm_ar(self, x, w):
        y = x @ w
        dist.all_reduce(y, group=self.group.process_group)
        return y

    def gemm_ar_residual(self, x, w, residual):
        return self.gemm_ar(x, w) + residual

    def all_reduce(self, x):
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, group=self.group.process_group)
        return y

    def reduce_scatter(self, x):
        out = x.new_empty((x.shape[0] // self.group.size, *x.shape[1:]))
        reduce_scatter_into(out, x.contiguous(), self.group.process_group)
        return out

    def all_gather(self, x):
        out = x.new_empty((self.group.size * x.shape[0], *x.shape[1:]))
        all_gather_into(out, x.contiguous(), self.group.process_group)
        return out


COMMS = {c.name: c for c in (WeftComm, NcclComm)}


def make_comm(comm, group=None) -> Comm:
    """A Comm from its name ("weft" or "nccl") over `group` (default: the world), or the Comm given (which must
    then be over `group`, where one is named)."""
    if isinstance(comm, Comm):
        if group is not None and weft.get_group(group) is not comm.group:
            raise ValueError(f"comm {comm!r} runs over another group than group={group!r}")
        return comm
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {', '.join(repr(c) for c in COMMS)}, got {comm!r}")
    return COMMS[comm](group)
