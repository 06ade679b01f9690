"""all_reduce (sum): NCCL, weft one_shot / two_shot / auto, torch's symm_mem one_shot and two_shot.

Size = the message (bytes per rank, the same on every rank). weft reduces x (a plain tensor) into a
separate output, and, as torch's two_shot_all_reduce_ does, in place in symmetric memory (weft.empty:
the reduced slices are pushed straight into every rank's x), and auto in place on plain tensors. NCCL
reduces in place on its own copies of the inputs; torch's one_shot_all_reduce reads its input straight from torch symmetric memory.
Two views (--view): CUDA-graph replay of all of them, eager back-to-back calls of those on plain tensors
(NCCL and weft into a plain output).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft

from . import sweep

SUITE = "allreduce"
BANDWIDTH = "bus bandwidth (GB/s)"  # 2 (W - 1) / W * bytes / time, as nccl-tests
RIVAL = "torch"  # the markdown also compares the best weft row with the best of these
FOCUS = sweep.FOCUS


def add_arguments(p) -> None:
    sweep.add_arguments(p, "message (bytes per rank)")


def run(args) -> list:
    w = weft.world()
    dtype = sweep.DTYPES[args.dtype]
    baseline = dist.get_backend(w.group)  # "nccl" on GPUs, "gloo" on the cpu backend
    group_name = w.group.group_name
    torch_one_shot = sweep.torch_symm_op("one_shot_all_reduce", dtype)
    torch_two_shot = sweep.torch_symm_op("two_shot_all_reduce_", dtype)
    if args.max_bytes > sweep.ONE_SHOT_MAX_BYTES:
        sweep.note(f"one_shot (weft and torch) is timed up to {sweep.ONE_SHOT_MAX_BYTES >> 20} MiB only")
    bus_factor = 2 * (w.world_size - 1) / w.world_size
    rows = []
    for size in sweep.sizes(args):
        n = size // dtype.itemsize
        if n == 0:
            continue
        xs = sweep.inputs(n, dtype)
        ref = xs[0].clone()
        dist.all_reduce(ref, group=w.group)
        in_place = [x.clone() for x in xs]
        out = torch.empty_like(ref)
        impls = {baseline: lambda i: dist.all_reduce(in_place[i], group=w.group)}
        one_shot = size <= sweep.ONE_SHOT_MAX_BYTES
        for method in ("one_shot", "two_shot", "auto") if one_shot else ("two_shot", "auto"):
            impls[f"weft {method}"] = lambda i, method=method: weft.ops.all_reduce(xs[i], method=method, out=out)
        # In place on a plain tensor, as the NCCL row runs (auto may hand it to NCCL with no copy).
        weft_in_place = [x.clone() for x in xs]
        impls["weft auto (in place)"] = lambda i: weft.ops.all_reduce(weft_in_place[i], out=weft_in_place[i])
        plain = set(impls)
        weft_symm = [weft.empty((n,), dtype).copy_(x) for x in xs]
        impls["weft two_shot (symmetric, in place)"] = lambda i: weft.ops.all_reduce(
            weft_symm[i], method="two_shot", out=weft_symm[i])
        if torch_one_shot is not None and one_shot:
            symm_in = sweep.symm_copies(xs)
            impls["torch one_shot"] = lambda i: torch_one_shot(symm_in[i], "sum", group_name)
        if torch_two_shot is not None:
            symm_inout = sweep.symm_copies(xs)
            impls["torch two_shot (in place)"] = lambda i: torch_two_shot(symm_inout[i], "sum", group_name)
        # Same inputs, checked against the baseline before timing (this also creates weft's workspaces).
        for name, f in impls.items():
            if name != baseline:
                out.fill_(float("nan"))
                sweep.check(name, f(0), ref, baseline, size)
        rows += sweep.time_impls(SUITE, impls, plain, size, n * dtype.itemsize, bus_factor, args)
    return rows
