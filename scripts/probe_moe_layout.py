"""TP-MoE's grouped layout on one GPU: weft's LayoutLaunches (a counting sort in three launches and the row_of_pair
inversion) against the same layout made by torch ops (stable sort, searchsorted, scatter), eager and graph-replayed.

    python3 scripts/probe_moe_layout.py [--blocks 256,512]      # on a GPU machine; JSON to $OUT
    python3 scripts/probe_moe_layout.py --profile               # also each kernel's GPU µs (torch.profiler)
"""
import argparse
import json
import os

import torch

import weft  # noqa: F401  (the backend)
from weft.kernels.moe.group_layout import LayoutLaunches

SHAPES = [(4096, 8, 128), (1024, 8, 128), (64, 8, 128), (8192, 2, 8), (16384, 8, 256)]  # (tokens, k, experts)


def torch_layout(idx, experts, world):
    """(meta (W, E + 2 + m k), row_of_pair) of `world` copies of this rank's chunk, by torch ops."""
    m, k = idx.shape
    dev, pairs = idx.device, m * k
    flat = idx.reshape(-1).long()
    key = torch.where((flat < 0) | (flat >= experts), experts, flat)
    sorted_key, order = torch.sort(key, stable=True)
    starts = torch.searchsorted(sorted_key, torch.arange(experts + 2, dtype=sorted_key.dtype, device=dev))
    meta = torch.cat([starts, order]).to(torch.int32).expand(world, -1).contiguous()
    local = torch.arange(pairs, dtype=torch.int32, device=dev)
    rows = torch.arange(world, dtype=torch.int32, device=dev)[:, None] * pairs + local
    dest = (rows - local + meta[:, experts + 2:]).long().reshape(-1)
    routed = local[None, :] < meta[:, experts:experts + 1]
    rop = torch.empty(world * pairs, dtype=torch.int32, device=dev).scatter_(
        0, dest, torch.where(routed, rows, -1).reshape(-1))
    return meta, rop.view(world * m, k)


def timed(fn, calls=200):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    eager = start.elapsed_time(end) * 1000 / calls
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return eager, start.elapsed_time(end) * 1000 / calls


def kernel_times(fn, calls=20) -> dict:
    """{kernel name: GPU µs per call} of fn's launches, from torch.profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {ev.key: round(ev.device_time_total / calls, 2) for ev in prof.key_averages() if ev.device_time_total > 0}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="256", help="pairs per program of the sort, comma-separated")
    p.add_argument("--world", type=int, default=2, help="ranks whose chunks the layout holds")
    p.add_argument("--profile", action="store_true", help="each kernel's GPU time per layout (first block size)")
    args = p.parse_args()
    rows = []
    for m, k, e in SHAPES:
        idx = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(m)])
        for i, block in enumerate(int(b) for b in args.blocks.split(",")):
            launches = LayoutLaunches(idx, e, args.world, copy=True, block=block)
            chunk = torch.empty(e + 2 + m * k, dtype=torch.int32, device="cuda")

            def weft_layout():
                c = launches.chunk(idx, chunk)
                return launches.gathered(c.expand(args.world, -1).contiguous())

            got, (meta, rop) = weft_layout(), torch_layout(idx, e, args.world)
            assert torch.equal(got.meta, meta) and torch.equal(got.row_of_pair, rop), (m, k, e, block)
            row = dict(tokens=m, k=k, experts=e, block=block)
            row["weft_eager_us"], row["weft_graph_us"] = timed(weft_layout)
            if i == 0:
                row["torch_eager_us"], row["torch_graph_us"] = timed(lambda: torch_layout(idx, e, args.world))
            if i == 0 and args.profile:
                row["kernels_us"] = kernel_times(weft_layout)
            print(row, flush=True)
            rows.append(row)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "probe_moe_layout.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
