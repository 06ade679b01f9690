"""Timing that holds up across ranks.

GPU: CUDA events around a sample; a sample is `calls` back-to-back calls,
replayed from a CUDA graph when `graph=True` so launch gaps don't dominate
small ops. The implementations compared in one table are sampled
round-robin. Each rank takes the median of its samples; the figure reported
is the slowest rank's. cpu: the same protocol with a host clock (for checking
the harness, not for speed).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import weft
from weft.testing.graphs import capture


def _slowest(values: list[float]) -> list[float]:
    w = weft.world()
    t = torch.tensor(values, dtype=torch.float64, device=w.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=w.group)
    return t.tolist()


def time_calls(fns: dict, *, calls: int = 10, samples: int = 50, warmup: int = 5, graph: bool = False) -> dict:
    """Median milliseconds per call of each `fns[name]()` on the slowest rank, as {name: ms}.

    Samples are taken round-robin (sample i of every fn, then sample i + 1, ...), so that drift in clocks
    or temperature during a run hits every fn alike, and no fn is favoured by running first or last; a
    device-side barrier before each sample starts every rank's sample together.
    With `graph`, a fn whose calls cannot be captured in a CUDA graph is timed eagerly, and its name in
    the result gets " (eager)".
    """
    w = weft.world()
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if w.device.type != "cuda":
        times = {name: [] for name in fns}
        for _ in range(samples):
            for name, fn in fns.items():
                weft.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3 / calls)
        return dict(zip(times, _slowest([statistics.median(t) for t in times.values()])))

    steps = {}
    for name, fn in fns.items():
        def batch(fn=fn):
            for _ in range(calls):
                fn()

        steps[name] = batch
        if graph:
            try:
                steps[name] = capture(batch, warm=True).replay
            except Exception as e:  # noqa: BLE001 - e.g. an op that cannot be captured: time it eagerly
                torch.cuda.synchronize()
                if w.rank == 0:
                    print(f"  {name}: CUDA-graph capture failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100]}); timed eagerly", flush=True)
                steps[f"{name} (eager)"] = steps.pop(name)
    for step in steps.values():
        step()
    weft.barrier()
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(samples)] for name in steps}
    for i in range(samples):
        for name, step in steps.items():
            start, end = events[name][i]
            # Line the ranks up on the device, outside the timed span: the fn before may be local work that
            # leaves them apart, and a collective would otherwise count the wait for the last rank.
            weft.ops.device_barrier()
            start.record()
            step()
            end.record()
    torch.cuda.synchronize()
    medians = [statistics.median(s.elapsed_time(e) / calls for s, e in pairs) for pairs in events.values()]
    return dict(zip(steps, _slowest(medians)))


def cycling(f, sets: int):
    """A no-argument call of `f(i)` whose input set i cycles through 0 .. sets - 1, call after call (so
    repeated calls don't all hit the same data in L2)."""
    state = {"i": 0}

    def call():
        f(state["i"] % sets)
        state["i"] += 1

    return call
