"""Where an eager call of the hierarchical ops (weft/kernels/hierarchical.py) spends its host time: thread CPU
time per call, split into the kernels' runs (on cpu: Triton's interpreter running the node's kernels and the
rail's network kernel, waits on the peers included; on GPUs: their launches), the process group's calls
(torch.distributed: NCCL's host time on GPUs) and the rest: weft's own Python and the torch ops it issues (plan
lookups, subgroup resolution, allocations, views and copies, checks), the part weft can cut.

    python3 -m weft run -n 4 --local-world-size 2 scripts/probe_nodes_host.py   # cpu: 2 nodes of 2
    python3 -m weft run -n 4 --local-world-size 1 scripts/probe_nodes_host.py   # cpu: 4 nodes of 1

The split times the outermost kernel run (InterpretedFunction.run, or a GPU Launch) and process-group call
with time.thread_time around each; the slowest rank's median over samples is printed by rank 0. On the cpu
backend the interpreter's kernels cost milliseconds: only the third column says anything about GPUs.
`weft bench -n 4 nodes --view eager` times the GPU calls themselves.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft.kernels import common  # noqa: E402

SPENT = {"kernels": 0.0, "group": 0.0}
_DEPTH = [0]
GROUP_CALLS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "all_gather", "broadcast")


def _timed(fn, bucket):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _DEPTH[0]:  # inside a timed call already: counted there
            return fn(*args, **kwargs)
        _DEPTH[0] += 1
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[bucket] += time.thread_time() - t0
            _DEPTH[0] -= 1
    return wrapper


def _instrument():
    """Time every kernel run and process-group call (probe only: the same functions, wrapped)."""
    if weft.world().device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.run = _timed(InterpretedFunction.run, "kernels")
    else:
        common.Launch.__call__ = _timed(common.Launch.__call__, "kernels")
        common.Launch.on = _timed(common.Launch.on, "kernels")
    for name in GROUP_CALLS:
        setattr(dist, name, _timed(getattr(dist, name), "group"))


def _sample(fn, calls: int) -> tuple[float, float, float]:
    """(total, kernels, process group) thread-CPU µs per call over `calls` calls."""
    SPENT.update(kernels=0.0, group=0.0)
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    total = time.thread_time() - t0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tuple(v * 1e6 / calls for v in (total, SPENT["kernels"], SPENT["group"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--elements", type=int, default=2048, help="bf16 elements per rank")
    ap.add_argument("--ops", default="all_reduce,all_reduce_inplace,all_gather,reduce_scatter,ag_gemm,gemm_rs")
    args = ap.parse_args()
    weft.init()
    w = weft.world()
    _instrument()
    dev, n = w.device, args.elements
    torch.manual_seed(w.rank)
    x = torch.randn(n, device=dev).to(torch.bfloat16)
    xi = x.clone()  # reduced in place, call after call
    xs = torch.randn(n * w.world_size, device=dev).to(torch.bfloat16)
    a = torch.randn(32, 64, device=dev).to(torch.bfloat16)  # ag_gemm: 32 rows per rank, k 64, n 64
    b = torch.randn(64, 64, device=dev).to(torch.bfloat16)
    ra = torch.randn(32 * w.world_size, 64, device=dev).to(torch.bfloat16)  # gemm_rs: 32 rows out per rank
    fns = {
        "all_reduce": lambda: weft.ops.all_reduce(x),
        "all_reduce_inplace": lambda: weft.ops.all_reduce(xi, op="max", out=xi),  # max: xi stays finite
        "all_gather": lambda: weft.ops.all_gather(x),
        "reduce_scatter": lambda: weft.ops.reduce_scatter(xs),
        "ag_gemm": lambda: weft.ops.ag_gemm(a, b, method="overlap"),
        "gemm_rs": lambda: weft.ops.gemm_rs(ra, b, method="overlap"),
    }
    rows = []
    for name in args.ops.split(","):
        fn = fns[name]
        for _ in range(2):
            fn()
        samples = []
        for _ in range(args.samples):
            weft.barrier()
            samples.append(_sample(fn, args.calls))
        mine = [statistics.median(s[i] for s in samples) for i in range(3)]
        mine.append(mine[0] - mine[1] - mine[2])
        every = [None] * w.world_size
        dist.all_gather_object(every, mine)
        rows.append((name, max(every, key=lambda r: r[3])))  # the rank with the most of weft's own host time
    if w.rank == 0:
        print(f"world {w.world_size}, nodes {w.nodes}, {w.device.type}, {args.elements} bf16 elements; thread-CPU "
              f"µs per call, the rank with the most weft host time (median of {args.samples} x {args.calls} calls)")
        print(f"{'op':20s} {'total':>10s} {'kernels':>10s} {'group':>8s} {'weft+torch':>11s}")
        for name, (total, kernels, group, rest) in rows:
            print(f"{name:20s} {total:10.0f} {kernels:10.0f} {group:8.0f} {rest:11.0f}")
    weft.finalize()


if __name__ == "__main__":
    main()
