"""reduce_scatter (sum): NCCL reduce_scatter_tensor, weft reduce_scatter, torch's symm_mem reduce_scatter_out.

Size = the input (bytes per rank: W shards; rank r gets the sum of shard r). torch's op reads its
input straight from torch symmetric memory, where weft copies x into its staging buffer first.
Two views (--view): CUDA-graph replay of all of them, eager back-to-back calls of NCCL and weft (plain
tensors).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft.testing.reference import reduce_scatter_ref

from . import sweep

SUITE = "reducescatter"
BANDWIDTH = "bus bandwidth (GB/s)"  # (W - 1) / W * input bytes / time, as nccl-tests
RIVAL = "torch"  # the markdown also compares the best weft row with the best of these
TORCH_WORLD_SIZES = (2, 4, 8)  # torch's reduce_scatter_out has kernels for these only


def add_arguments(p) -> None:
    sweep.add_arguments(p, "input (bytes per rank)")


def run(args) -> list:
    w = weft.world()
    dtype = sweep.DTYPES[args.dtype]
    baseline = dist.get_backend(w.group)  # "nccl" on GPUs, "gloo" on the cpu backend
    group_name = w.group.group_name
    torch_rs = sweep.torch_symm_op("reduce_scatter_out", dtype)
    if torch_rs is not None and w.world_size not in TORCH_WORLD_SIZES:
        sweep.note(f"torch.ops.symm_mem.reduce_scatter_out has no kernel for {w.world_size} ranks: skipped")
        torch_rs = None
    torch_align = w.world_size * 16 // dtype.itemsize  # its element count must be a multiple of this
    bus_factor = (w.world_size - 1) / w.world_size
    rows = []
    for size in sweep.sizes(args):
        m = size // dtype.itemsize // w.world_size  # output elements per rank
        if m == 0:
            continue
        n = m * w.world_size
        xs = sweep.inputs(n, dtype)
        ref = torch.empty(m, dtype=dtype, device=w.device)
        reduce_scatter_ref(ref, xs[0], w.group)
        nccl_out, out, torch_out = (torch.empty_like(ref) for _ in range(3))
        impls = {baseline: lambda i: reduce_scatter_ref(nccl_out, xs[i], w.group),
                 "weft": lambda i: weft.ops.reduce_scatter(xs[i], out=out)}
        plain = set(impls)
        if torch_rs is not None and n % torch_align == 0:
            symm_in = sweep.symm_copies(xs)
            impls["torch reduce_scatter_out"] = lambda i: torch_rs(symm_in[i], group_name, False, torch_out)
        # Same inputs, checked against the baseline before timing (this also creates weft's workspace).
        for name, f in impls.items():
            if name != baseline:
                out.fill_(float("nan"))
                torch_out.fill_(float("nan"))
                sweep.check(name, f(0), ref, baseline, size)
        rows += sweep.time_impls(SUITE, impls, plain, size, n * dtype.itemsize, bus_factor, args)
    return rows
