"""CUDA-graph capture: the model's decode steps, and the tests and benchmarks (through weft.testing.graphs)."""
from __future__ import annotations

import torch


def capture(fn, warmups: int = 0) -> torch.cuda.CUDAGraph:
    """`fn()` captured in a CUDA graph, by torch's recipe for whole networks, backward included.

    Capture runs on a side stream (torch.cuda.graph needs one that is not the default), ordered after the
    current stream's work and joined back into it. `warmups`: calls of `fn()` on that side stream first
    (cuBLAS, and autograd's backward, set up per-stream and per-thread state on first use, which capture
    cannot record; torch's recipe for a backward takes 3). weft's ops create their workspaces on first
    use, outside capture: call `fn()` once before this.

    The capture mode is "thread_local", as in torch's CUDA-graph trees: in the default "global" mode any
    thread's call that is unsafe during a capture invalidates it, and NCCL's watchdog thread queries the
    events of earlier collectives at any time. A capture that fails anyway raises; `fn()` must draw no
    random numbers (a failed capture leaves the CUDA generator in capture mode, so that the process's next
    random draw fails with "Offset increment outside graph capture").
    """
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    return g
