"""Where an eager op call's host time goes: the pieces of weft's call path (plan key, lookup, output
allocation, stream query, the compiled kernel's launch, driver copies and stream edges) timed one by one,
next to the whole calls and NCCL's.

    python3 -m weft run -n 2 scripts/probe_host.py        # GPUs; JSON to $OUT/probe_host.json
    python3 -m weft run -n 2 scripts/probe_host.py --samples 2 --calls 5   # cpu smoke run

Host µs per call (weft.bench.timing.issue_times: calls queued behind a sleeping kernel, slowest rank's
median). The whole-op rows are what `weft bench overhead` reports; the pieces tell which of them to cut.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft.bench.overhead import ten_args_kernel  # noqa: E402
from weft.bench.report import ProbeLog  # noqa: E402
from weft.bench.timing import issue_times  # noqa: E402
from weft.kernels.common import Launch, out_kind, signature  # noqa: E402
from weft.runtime import streams  # noqa: E402


def _cells(fn) -> dict:
    """A closure's free variables by name (a plan's `run` holds its launches there)."""
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    weft.init()
    w = weft.world()
    log = ProbeLog("probe_host", w.rank)
    dev = w.device
    x = torch.randn(4096, device=dev).to(torch.bfloat16)  # 8 KiB
    o = torch.empty_like(x)
    xs = torch.randn(4096 * w.world_size, device=dev).to(torch.bfloat16)
    weft.ops.all_reduce(x), weft.ops.all_reduce(x, out=o), weft.ops.all_gather(x), weft.ops.reduce_scatter(xs)
    key = ("all_reduce", signature(x), "sum", "auto", out_kind(w, None, x), None)
    found = w.plans[key]
    fns = {
        "all_reduce(x)": lambda: weft.ops.all_reduce(x),
        "all_reduce(x, out=o)": lambda: weft.ops.all_reduce(x, out=o),
        "all_gather(x)": lambda: weft.ops.all_gather(x),
        "reduce_scatter(x)": lambda: weft.ops.reduce_scatter(xs),
        "broadcast(x)": lambda: weft.ops.broadcast(o),
        "nccl all_reduce": lambda: dist.all_reduce(o, group=w.group),
        "plan run(x, o)": lambda: found(x, o),
        "key": lambda: ("all_reduce", signature(x), "sum", "auto", out_kind(w, None, x), None),
        "signature(x)": lambda: signature(x),
        "world.plans.get": lambda: w.plans.get(key),
        "weft.world()": weft.world,
        "x.device": lambda: x.device,
        "x.shape": lambda: x.shape,
        "x.data_ptr()": x.data_ptr,
        "x.is_contiguous()": x.is_contiguous,
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "torch.empty(n)": lambda: torch.empty(4096, dtype=torch.bfloat16, device=dev),
    }
    if gpu:
        idx = dev.index
        direct = _cells(found).get("direct")
        if direct is not None:
            fns["direct(x, o) (launch)"] = lambda: direct(x, o)
        bare = Launch(ten_args_kernel, (1,), (o, o, o, o, o, 1, 2, 3, 4, 5), {}, num_warps=1)
        p = o.data_ptr()
        fns["Launch (10 args, compiled)"] = lambda: bare(p, p, p, p, p, 1, 2, 3, 4, 5)
        fns["raw stream"] = lambda: torch._C._cuda_getCurrentRawStream(idx)
        fns["torch.cuda.current_stream()"] = torch.cuda.current_stream
        drv = streams._driver
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        one = torch.ones(1, dtype=torch.int32, device=dev)
        fp, op = flag.data_ptr(), one.data_ptr()
        s = torch.cuda.current_stream().cuda_stream
        fns["cuMemcpyDtoDAsync 4 B"] = lambda: drv.cuMemcpyDtoDAsync(fp, op, 4, s)
        fns["device_copy 4 B"] = lambda: streams.device_copy(flag, one)
        fns["cuStreamWriteValue32"] = lambda: drv.cuStreamWriteValue32(s, fp, 1, 0)
        fns["flag.copy_(one)"] = lambda: flag.copy_(one)
        side = streams.StreamSet(dev, 1)
        main = side.current()
        fns["StreamSet.wait (record + wait)"] = lambda: side.wait(side.sides[0], main)
        fns["StreamSet.run_on (set stream x2)"] = lambda: side.run_on(side.sides[0], main, int)
    ms = issue_times(fns, calls=args.calls, samples=args.samples)
    for name, v in ms.items():
        log.add(dict(piece=name, host_us=round(v * 1e3, 2)))
    log.save()
    weft.finalize()


if __name__ == "__main__":
    main()
