"""all_gather: NCCL all_gather_into_tensor, weft push / pull / auto into a plain output, weft push into a
symmetric output (weft.empty: gathered in place, no copy out).

Size = the gathered total (bytes per rank of the output). Checked bit-exact against NCCL. Two views
(--view): CUDA-graph replay of all of them, eager back-to-back calls of those with plain outputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft.testing.reference import all_gather_ref

from . import sweep
from .report import Row, human_bytes

SUITE = "allgather"
FOCUS = sweep.FOCUS


def add_arguments(p) -> None:
    sweep.add_arguments(p, "total (gathered) size")


def run(args) -> list[Row]:
    w = weft.world()
    dtype = sweep.DTYPES[args.dtype]
    baseline = dist.get_backend(w.group)  # "nccl" on GPUs, "gloo" on the cpu backend
    rows = []
    for total in sweep.sizes(args):
        shard = total // w.world_size // dtype.itemsize  # elements per rank
        if shard == 0:
            continue
        xs = sweep.inputs(shard, dtype)
        out_sym = weft.empty((shard * w.world_size,), dtype)
        out = torch.empty(shard * w.world_size, dtype=dtype, device=w.device)
        ref = torch.empty_like(out)
        all_gather_ref(ref, xs[0], w.group)
        impls = {baseline: lambda i: all_gather_ref(out, xs[i], w.group)}
        for method in ("push", "pull", "auto"):
            impls[f"weft {method}"] = lambda i, method=method: weft.ops.all_gather(xs[i], out=out, method=method)
        plain = set(impls)
        impls["weft push (symmetric out)"] = lambda i: weft.ops.all_gather(xs[i], out=out_sym, method="push")
        # Same inputs, checked bit-exact before timing (this also creates weft's workspaces).
        for name, f in impls.items():
            if name != baseline:
                out.fill_(float("nan"))
                out_sym.fill_(float("nan"))
                f(0)
                if not torch.equal(out_sym if "symmetric" in name else out, ref):
                    raise RuntimeError(f"{name}: all_gather mismatch against {baseline} at {human_bytes(total)}")
        nbytes = shard * w.world_size * dtype.itemsize
        rows += sweep.time_impls(SUITE, impls, plain, total, nbytes, 1.0, args)
    return rows
