"""all_gather: weft push (symmetric output), weft pull (any output), NCCL all_gather_into_tensor."""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft.testing.reference import all_gather_ref

from .report import Row, human_bytes
from .timing import cycling, time_calls

SUITE = "allgather"
GRAPH_BELOW = 1 << 30  # total bytes: CUDA-graph timing under this (every op here runs well under 1 ms)


def add_arguments(p) -> None:
    p.add_argument("--min-bytes", type=int, default=4 << 10, help="smallest total (gathered) size")
    p.add_argument("--max-bytes", type=int, default=256 << 20, help="largest total size")
    p.add_argument("--samples", type=int, default=50)


def run(args) -> list[Row]:
    w = weft.world()
    rows = []
    total = args.min_bytes
    sizes = []
    while total <= args.max_bytes:
        sizes.append(total)
        total *= 2
    baseline = dist.get_backend(w.group)  # "nccl" on GPUs, "gloo" on the cpu backend
    rotate = 4  # input sets, so repeated calls don't all hit in L2
    for total in sizes:
        shard = total // w.world_size // 4  # float32 elements per rank
        if shard == 0:
            continue
        xs = [torch.randn(shard, device=w.device) for _ in range(rotate)]
        out_sym = weft.empty((shard * w.world_size,), torch.float32)
        out = torch.empty(shard * w.world_size, device=w.device)
        ref = torch.empty_like(out)
        all_gather_ref(ref, xs[0], w.group)
        impls = {
            baseline: lambda i: all_gather_ref(out, xs[i], w.group),
            "weft push, symmetric out": lambda i: weft.ops.all_gather(xs[i], out=out_sym, method="push"),
            "weft push, plain out": lambda i: weft.ops.all_gather(xs[i], out=out, method="push"),
            "weft pull, plain out": lambda i: weft.ops.all_gather(xs[i], out=out, method="pull"),
        }
        # Same inputs, checked bit-exact before timing.
        for name, f in impls.items():
            if name.startswith("weft"):
                out.fill_(float("nan"))
                out_sym.fill_(float("nan"))
                f(0)
                if not torch.equal(out_sym if "symmetric" in name else out, ref):
                    raise RuntimeError(f"{name}: all_gather mismatch against {baseline} at {human_bytes(total)}")
        graph = w.device.type == "cuda" and total < GRAPH_BELOW
        calls = 20 if total < (1 << 20) else 5
        steps = {name: cycling(f, rotate) for name, f in impls.items()}
        for name, ms in time_calls(steps, calls=calls, samples=args.samples, graph=graph).items():
            rows.append(Row(SUITE, human_bytes(total), name, ms, total / ms / 1e6, total, w.world_size))
        weft.barrier()
    return rows
