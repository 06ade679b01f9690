"""Timing that holds up across ranks.

GPU: CUDA events around a sample; a sample is `calls` back-to-back calls,
replayed from a CUDA graph when `graph=True` so launch gaps don't dominate
small ops. The implementations compared in one table are sampled
round-robin. Each rank takes the median of its samples; the figure reported
is the slowest rank's. cpu: the same protocol with a host clock (for checking
the harness, not for speed). `issue_times` measures the other side of a call:
the host's time to issue it.
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


def _every_rank(values: list[float]) -> list[list[float]]:
    """values[i] of every rank: [[rank 0's, rank 1's, ...] for each i]."""
    w = weft.world()
    t = torch.tensor(values, dtype=torch.float64, device=w.device)
    parts = [torch.empty_like(t) for _ in range(w.world_size)]
    dist.all_gather(parts, t, group=w.group)
    return torch.stack(parts, dim=1).tolist()


def _device_line_up(w):
    """A call that holds every rank's stream until all ranks' streams reach it: weft's device barrier, or, on a
    world that spans nodes (whose kernels reach this node's ranks only), NCCL's all_reduce of one word."""
    if not w.topology.spans_nodes:
        return weft.ops.device_barrier
    word = torch.zeros(1, dtype=torch.int32, device=w.device)
    return lambda: dist.all_reduce(word, group=w.group)


# Calls of a fn on the capture's side stream before it is captured: torch's recipe for capturing a backward.
GRAPH_WARMUPS = 3


def time_calls(fns: dict, *, calls: int = 10, samples: int = 50, warmup: int = 5, graph: bool = False,
               per_rank: bool = False) -> dict:
    """Median milliseconds per call of each `fns[name]()` on the slowest rank, as {name: ms}; with
    `per_rank`, every rank's median instead, as {name: [rank 0's ms, rank 1's, ...]}.

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
        medians = [statistics.median(t) for t in times.values()]
        return dict(zip(times, _every_rank(medians) if per_rank else _slowest(medians)))

    steps = {}
    for name, fn in fns.items():
        def batch(fn=fn):
            for _ in range(calls):
                fn()

        steps[name] = batch
        if graph:
            try:
                steps[name] = capture(batch, warmups=GRAPH_WARMUPS).replay
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
    line_up = _device_line_up(w)
    for i in range(samples):
        for name, step in steps.items():
            start, end = events[name][i]
            # Line the ranks up on the device, outside the timed span: the fn before may be local work that
            # leaves them apart, and a collective would otherwise count the wait for the last rank.
            line_up()
            start.record()
            step()
            end.record()
    torch.cuda.synchronize()
    medians = [statistics.median(s.elapsed_time(e) / calls for s, e in pairs) for pairs in events.values()]
    return dict(zip(steps, _every_rank(medians) if per_rank else _slowest(medians)))


def _sleep_cycles_per_ms() -> float:
    """What torch.cuda._sleep(cycles) spins per millisecond on this GPU (its clock, measured once)."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1 << 20)  # first use loads the kernel
        start.record()
        torch.cuda._sleep(1 << 24)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = (1 << 24) / start.elapsed_time(end)
    return _CYCLES_PER_MS


_CYCLES_PER_MS = None
SLEEP_TRIES = 4  # tries of a sample at most: one whose sleep ran out is taken again with a longer one


def _issue_ms(fn, calls: int, sleep_ms: float) -> tuple[float, float, bool]:
    """(host ms per call over `calls` calls, loop ms, whether every rank's device slept through its loop)."""
    w = weft.world()
    gpu = w.device.type == "cuda"
    weft.barrier()
    if gpu:
        torch.cuda._sleep(int(sleep_ms * _sleep_cycles_per_ms()))
        slept = torch.cuda.Event()
        slept.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    loop = (time.perf_counter() - t0) * 1e3
    if not gpu:
        return loop / calls, loop, True
    # Still asleep: nothing the loop queued has run, so no launch waited for the device (a full launch
    # queue, a synchronising call): the loop's time is the host's alone. Agreed by all ranks, which must
    # retry together (the calls are collectives); the all_reduce waits for the queue to drain, untimed.
    asleep = torch.tensor([0 if slept.query() else 1], device=w.device)
    dist.all_reduce(asleep, op=dist.ReduceOp.MIN, group=w.group)
    return loop / calls, loop, bool(asleep.item())


def issue_times(fns: dict, *, calls: int = 300, samples: int = 50, warmup: int = 5) -> dict:
    """Median milliseconds of host time to issue one call of each `fns[name]()`, on the slowest rank, as
    {name: ms}: time.perf_counter around `calls` back-to-back calls, divided by `calls`.

    On GPUs each sample's calls queue behind a torch.cuda._sleep kernel that outlasts the loop (1 ms at
    first; a sample during which it ran out on any rank is taken again with twice the sleep, or twice the
    loop), so neither a device slower than the host nor a full launch queue can hold the loop up: the
    figure is what issuing costs the CPU. Where the sleep still runs out (a call that waits for the
    device), the figure includes device time and a note says so. Samples round-robin, as in time_calls.
    """
    w = weft.world()
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    sleep_ms = dict.fromkeys(fns, 1.0)
    bound = set()  # the same on every rank: _issue_ms's verdict is agreed
    for _ in range(samples):
        for name, fn in fns.items():
            # Once bound, one try a sample at an unchanged sleep: the loop of a device-bound call lasts as
            # long as any sleep, so doubling it would only make every sample longer.
            for _ in range(1 if name in bound else SLEEP_TRIES):
                per_call, loop, asleep = _issue_ms(fn, calls, sleep_ms[name])
                if asleep or name in bound:
                    break
                sleep_ms[name] = 2 * max(sleep_ms[name], loop)
            else:
                bound.add(name)
            times[name].append(per_call)
    weft.barrier()
    if bound and w.rank == 0:
        print(f"note: host times of {', '.join(sorted(bound))} include device time (the call waits for the "
              "device, or queues more launches than the stream holds: try fewer calls)", flush=True)
    return dict(zip(times, _slowest([statistics.median(t) for t in times.values()])))


def cycling(f, sets: int):
    """A no-argument call of `f(i)` whose input set i cycles through 0 .. sets - 1, call after call (so
    repeated calls don't all hit the same data in L2)."""
    state = {"i": 0}

    def call():
        f(state["i"] % sets)
        state["i"] += 1

    return call
