"""Where a decode step's time goes, kernel by kernel: weft's decode session (weft.models) replayed from its CUDA
graph under torch.profiler, on one GPU or tensor-parallel over several (`-n 2`: every rank replays and profiles,
rank 0 reports its own kernels, bytes and floor).

    python3 -m weft run -n 1 scripts/profile_decode.py --out $OUT/profile_decode.json      # Qwen3-8B, b1 ctx512
    python3 -m weft run -n 1 scripts/profile_decode.py --batch 8 --context 4096 --out ...
    python3 -m weft run -n 1 scripts/profile_decode.py --path layers --out ...             # the layers path
    python3 -m weft run -n 1 scripts/profile_decode.py --path persistent --prefetch-rows 0 --wait-backoff-ns 0 --out ...
                                    # the persistent step (decode_step.py), no L2 prefetch, no sleep between polls
    python3 -m weft run -n 1 scripts/profile_decode.py --model tiny --layers 1 --batch 2 --context 4 --steps 2 \
        --out /tmp/profile_decode.json                                                      # cpu smoke run

Prints and writes (JSON, --out) per kernel name: GPU µs per step, launches per step, share of the kernels'
time, and where it can be computed the bytes the kernel must read per step and the fraction of the copy
bandwidth (a large device-to-device copy in the same run, read + write) that makes: projections (the
torch.matmul / cuBLAS GEMMs, their weights' bytes by the shapes an eager step's profile records),
flash_decode (the KV cache read), gemm_ar_kernel (the O and down projections' weights), the fused decode
path's kernels (norm_qkv_rope, linear_residual, norm_gate_up_silu: their projections' weights), the persistent
step's decode_step_kernel (every block's weights and the KV cache: it is the whole step but the embedding, the
final norm and the LM head). Also the step's
replayed time against its HBM floor (weights + KV bytes over the copy bandwidth) and the kernels' sum (the
rest is gaps between kernels). On the cpu backend the same report of CPU ops' self time (a check of the
script, not a profile).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft import tuning  # noqa: E402
from weft.bench.e2e import MODELS, copy_bandwidth  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402
from weft.models import DecodeSession, from_hf  # noqa: E402
from weft.models.decoder import DECODE_PATHS  # noqa: E402

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")  # the ops whose second operand is a projection's weight


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-8B", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (default: all)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512, help="tokens already cached")
    p.add_argument("--comm", default="weft", choices=("weft", "nccl"))
    p.add_argument("--path", default=None, choices=DECODE_PATHS,
                   help="the decode path (default: the model's for this batch: WEFT_DECODE, else the tuning data)")
    p.add_argument("--prefetch-rows", type=int, default=None,
                   help="the persistent path's L2 prefetch rows (default: weft.tuning's decode.persistent; 0: none)")
    p.add_argument("--programs-per-sm", type=int, default=None,
                   help="the persistent path's programs per SM at most (default: weft.tuning's decode.persistent)")
    p.add_argument("--wait-backoff-ns", type=int, default=None,
                   help="the persistent path's sleep between a wait's polls (default: weft.tuning's decode.persistent; "
                        "0: none)")
    p.add_argument("--steps", type=int, default=20, help="steps profiled (and timed samples x 2)")
    p.add_argument("--out", required=True, help="the JSON report's path")
    return p.parse_args(argv)


def _profile(fn, steps: int, record_shapes: bool = False):
    cuda = weft.device().type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    if record_shapes and cuda:  # the CPU ops, whose shapes name the kernels they launch
        activities.append(torch.profiler.ProfilerActivity.CPU)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    with torch.profiler.profile(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(steps):
            fn()
        sync()
    return prof


def kernel_times(fn, steps: int) -> dict:
    """{kernel name: (µs per step, launches per step)}, largest first; cpu: CPU ops' self time."""
    cuda = weft.device().type == "cuda"
    prof = _profile(fn, steps)
    times = {}
    for ev in prof.key_averages():
        us = ev.device_time_total if cuda else ev.self_cpu_time_total
        if us > 0:
            times[ev.key] = (us / steps, ev.count / steps)
    return dict(sorted(times.items(), key=lambda kv: -kv[1][0]))


def gemm_weight_bytes(fn, itemsize: int, steps: int = 1) -> dict:
    """{kernel name: weight bytes read per step} of the GEMMs an eager step runs, from the shapes recorded:
    the second operand of each aten::mm / addmm (the weight: decode's activations are a few rows)."""
    cuda = weft.device().type == "cuda"
    found = defaultdict(int)
    for ev in _profile(fn, steps, record_shapes=True).events():
        if ev.name not in GEMMS or not ev.input_shapes:
            continue
        weight = ev.input_shapes[-1] if ev.name == "aten::mm" else ev.input_shapes[2]  # addmm(bias, a, b)
        nbytes = itemsize * torch.Size(weight).numel()
        # The GEMM is the op's first kernel; a split-K GEMM's second (cublasLt's splitKreduce) reads partial sums,
        # not the weight.
        for name in ([k.name for k in getattr(ev, "kernels", [])][:1] if cuda else [ev.name]):
            found[name] += nbytes // steps
    return dict(found)


def main(argv=None) -> int:
    args = parse(argv)
    weft.init()
    w = weft.world()
    config = dict(MODELS[args.model])
    if args.layers:
        config["num_hidden_layers"] = min(args.layers, config["num_hidden_layers"])
    model = from_hf(config, comm=args.comm)
    runs = contextlib.ExitStack()
    persistent = {}
    given = {field: getattr(args, field) for field in ("prefetch_rows", "programs_per_sm", "wait_backoff_ns")
             if getattr(args, field) is not None}
    if given:
        from weft.kernels.decode_step import settings as persistent_settings
        persistent = {**persistent_settings(w.device), **given}
        # For the whole run (the session's plans are made at its capture and kept): left at exit.
        runs.enter_context(tuning.overrides({"decode.persistent": persistent}))
    cache = model.new_cache(args.batch, args.context + 1)
    session = DecodeSession(model, cache, path=args.path)
    session.tokens.copy_(torch.randint(0, model.config.vocab_size, (args.batch,)))
    session.positions.fill_(args.context)
    graph = session.graph is not None
    step = session.graph.replay if graph else session.run

    bandwidth = copy_bandwidth(w.device)
    need = model.decode_bytes(args.batch, args.context)
    floor_us = (need["weights"] + need["kv"]) / bandwidth * 1e6
    step_us = time_calls({"step": step}, calls=1, samples=2 * args.steps)["step"] * 1e3
    times = kernel_times(step, args.steps)
    profiled = "graph replay" if graph else "eager"
    if graph and not times:  # a profiler that sees no kernels in graph replays: the same step's kernels, eagerly
        times, profiled = kernel_times(session.run, args.steps), "eager (the graph replay recorded no kernels)"

    bytes_of = gemm_weight_bytes(session.run, model.dtype.itemsize)
    gemm_ar = sum(b.attn.o_weight.nbytes + b.mlp.down_weight.nbytes for b in model.blocks)
    # The fused decode kernels (weft/kernels/decode.py), each named for the weights it reads.
    fused = {"norm_qkv_rope_kernel": sum(b.attn.qkv_weight.nbytes for b in model.blocks),
             "linear_residual_kernel": gemm_ar, "linear_residual_ar_kernel": gemm_ar,
             "norm_gate_up_silu_kernel": sum(b.mlp.gate_up_weight.nbytes for b in model.blocks)}
    for name in times:
        if "decode_step_kernel" in name:
            bytes_of[name] = sum(p.nbytes for p in model.blocks.parameters()) + need["kv"]
        elif "flash_decode_split" in name:
            bytes_of[name] = need["kv"]
        elif "gemm_ar_kernel" in name:
            bytes_of[name] = gemm_ar
        for kernel, nbytes in fused.items():
            if kernel in name:
                bytes_of[name] = nbytes
    total_us = sum(us for us, _ in times.values())
    kernels = []
    for name, (us, launches) in times.items():
        nbytes = bytes_of.get(name)
        fraction = None if nbytes is None else round(nbytes / (us * 1e-6) / bandwidth, 3)
        kernels.append(dict(name=name, us_per_step=round(us, 2), launches_per_step=round(launches, 2),
                            share=round(us / total_us, 4), bytes_per_step=nbytes, copy_bandwidth_fraction=fraction))
    device = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu (interpreter)"
    report = dict(meta=dict(device=device, ranks=w.world_size, torch=torch.__version__, model=args.model,
                            layers=model.config.num_layers,
                            batch=args.batch, context=args.context, comm=args.comm, path=session.path,
                            steps=args.steps, persistent_settings=persistent or None,
                            profiled=profiled, commit=os.environ.get("WEFT_COMMIT")),
                  copy_bandwidth_gbps=round(bandwidth / 1e9, 1), decode_bytes=need, step_us=round(step_us, 1),
                  floor_us=round(floor_us, 1), kernels_us=round(total_us, 1), kernels=kernels)
    if w.rank != 0:  # every rank replays and profiles its step; rank 0 reports its own
        runs.close()
        weft.finalize()
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    print(f"{args.model} ({model.config.num_layers} layers) decode b{args.batch} ctx{args.context}, comm={args.comm}, "
          f"{session.path} path, {device} x {w.world_size} (rank 0's kernels and bytes), {profiled}")
    print(f"step {step_us:.0f} µs, HBM floor {floor_us:.0f} µs ({floor_us / step_us:.0%}; weights "
          f"{need['weights'] / 2**30:.2f} GiB + KV {need['kv'] / 2**30:.3f} GiB at {bandwidth / 1e9:,.0f} GB/s copy); "
          f"kernels {total_us:.0f} µs, gaps {step_us - total_us:.0f} µs")
    print(f"{'µs/step':>9} {'launches':>8} {'share':>6} {'MiB/step':>9} {'of copy bw':>10}  kernel")
    for k in kernels:
        mib = "" if k["bytes_per_step"] is None else f"{k['bytes_per_step'] / 2**20:.1f}"
        frac = "" if k["copy_bandwidth_fraction"] is None else f"{k['copy_bandwidth_fraction']:.0%}"
        print(f"{k['us_per_step']:9.1f} {k['launches_per_step']:8.0f} {k['share']:6.1%} {mib:>9} {frac:>10}  "
              f"{k['name'][:100]}")
    print(f"written to {args.out}")
    runs.close()
    weft.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
