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
from weft.bench.gemm import local_shape  # noqa: E402
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
        "plan run(x, o)": lambda: found.run(x, o),
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
        from cuda.bindings import driver as drv
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
    if gpu:
        ms.update(_gemm_pieces(w, args))
        ms.update(_capture_write_value(w))
    for name, v in ms.items():
        log.add(dict(piece=name, host_us=round(v * 1e3, 2)))
    log.save()
    weft.finalize()


def _gemm_pieces(w, args) -> dict:
    """ag_gemm 4096x14336x4096 and gemm_rs 4096x4096x14336 (overlap) whole, then their plans' pieces.

    The GEMM launch is timed alone after whole calls, when every flag is already up (it does not wait); the
    start kernels last, since they lower the flags."""
    from cuda.bindings import driver

    dev = w.device
    m, n, k = local_shape("ag", 4096, 14336, 4096, w.world_size)
    a = torch.randn(m, k, device=dev).to(torch.bfloat16)
    b = torch.randn(k, n, device=dev).to(torch.bfloat16)
    rm, rn, rk = local_shape("rs", 4096, 4096, 14336, w.world_size)
    ra = torch.randn(rm, rk, device=dev).to(torch.bfloat16)
    rb = torch.randn(rk, rn, device=dev).to(torch.bfloat16)
    whole = {"ag_gemm whole": lambda: weft.ops.ag_gemm(a, b, method="overlap"),
             "gemm_rs whole": lambda: weft.ops.gemm_rs(ra, rb, method="overlap")}
    for f in whole.values():
        f()
    ag = _cells(list(p for key, p in w.plans.items() if key[0] == "ag_gemm")[-1])
    rs = _cells(list(p for key, p in w.plans.items() if key[0] == "gemm_rs")[-1])
    res = ag["result"](None)
    out = rs["result"](None)
    peer = (w.rank + 1) % w.world_size
    scratch = weft.zeros((64,), torch.int32)
    peer_word = w.heap.peer(scratch, peer)[0:1].data_ptr()
    one = torch.ones(1, dtype=torch.int32, device=dev)
    s = torch.cuda.current_stream().cuda_stream
    rows = w.heap.peer(ag["gathered"], peer)[w.rank * m:(w.rank + 1) * m]  # a peer's chunk of G
    wm, wn, wk = ag["m"], ag["n"], ag["k"]

    def ag_launch():
        ag["launch"](ag["a_desc"], ag["b_desc"].on(b), ag["c_desc"].on(res), ag["ws"].ready, ag["heap"], wm, wn, wk)

    def ag_pushes():
        for push in ag["pushes"]:
            push(a)

    pieces = {
        "ag_gemm GEMM launch (3 descriptors)": ag_launch,
        "ag_gemm pushes (CopyEnginePush: data, flag)": ag_pushes,
        "device_copy (a_shard to a peer)": lambda: streams.device_copy(rows, a),
        "cuMemcpyDtoDAsync 4 B to a peer": lambda: driver.cuMemcpyDtoDAsync(peer_word, one.data_ptr(), 4, s),
        "cuStreamWriteValue32 to a peer": lambda: driver.cuStreamWriteValue32(s, peer_word, 1, 0),
        "torch.empty (ag_gemm's out)": lambda: ag["result"](None),
        "gemm_rs result alloc": lambda: rs["result"](None),
    }
    times = issue_times(whole, calls=max(1, args.calls // 10), samples=args.samples)
    times.update(issue_times(pieces, calls=max(1, args.calls // 10), samples=args.samples))
    a_at = ag["start"].address(a)
    times.update(issue_times({"ag_gemm start (copy, barrier)": lambda: ag["start"](a_at, *ag["start_fixed"],
                                                                                   ag["elements"], ag["chunk"]),
                              "gemm_rs start barrier": lambda: rs["start"](rs["ws"].bar, rs["ws"].ready, rs["heap"])},
                             calls=max(1, args.calls // 10), samples=args.samples))
    torch.cuda.synchronize()
    return times


def _capture_write_value(w) -> dict:
    """Whether cuStreamWriteValue32 can be captured in a CUDA graph (1.0) or not (0.0), and its replay works."""
    from cuda.bindings import driver

    word = torch.zeros(1, dtype=torch.int32, device=w.device)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            s = torch.cuda.current_stream().cuda_stream
            err = driver.cuStreamWriteValue32(s, word.data_ptr(), 7, 0)[0]
        g.replay()
        torch.cuda.synchronize()
        ok = err == driver.CUresult.CUDA_SUCCESS and int(word.item()) == 7
    except Exception as e:  # noqa: BLE001 - the probe reports it
        print(f"capture of cuStreamWriteValue32 failed: {e}", flush=True)
        ok = False
    return {"cuStreamWriteValue32 captured and replayed (1 = yes)": 1e-3 * ok}


if __name__ == "__main__":
    main()
