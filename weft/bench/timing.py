"""Timing that holds up across ranks.

GPU: CUDA events around a sample; a sample is `calls` back-to-back calls,
replayed from a CUDA graph when `graph=True` so launch gaps don't dominate
small ops. Each rank takes the median of its samples; the figure reported is
the slowest rank's. cpu: the same protocol with a host clock (for checking
the harness, not for speed).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import weft
from weft.testing.graphs import capture


def _slowest(value: float) -> float:
    w = weft.world()
    t = torch.tensor([value], dtype=torch.float64, device=w.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=w.group)
    return float(t.item())


def time_call(fn, *, calls: int = 10, samples: int = 50, warmup: int = 5, graph: bool = False) -> float:
    """Median milliseconds per call of `fn()` on the slowest rank."""
    w = weft.world()
    for _ in range(warmup):
        fn()
    if w.device.type != "cuda":
        times = []
        for _ in range(samples):
            weft.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
        return _slowest(statistics.median(times))

    def batch():
        for _ in range(calls):
            fn()

    step = capture(batch, warm=True).replay if graph else batch
    step()
    weft.barrier()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for s, e in zip(starts, ends):
        s.record()
        step()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / calls for s, e in zip(starts, ends)]
    return _slowest(statistics.median(times))
