"""CUDA-graph capture as weft's tests and benchmarks do it."""
from __future__ import annotations

import torch


def capture(fn, warm: bool = False) -> torch.cuda.CUDAGraph:
    """`fn()` captured in a CUDA graph. Capture runs on a side stream (torch.cuda.graph needs one that is
    not the default), ordered after the current stream's work and joined back into it. `warm`: run
    `fn()` once on the side stream first (libraries such as cuBLAS set up per-stream state on first use).
    weft's ops create their workspaces on first use, outside capture: call `fn()` once before this."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if warm:
            fn()
            torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=side):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    return g
