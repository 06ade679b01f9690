"""Where the MoE layers' time goes, kernel by kernel: EPMoE in decode (LL, bf16 and fp8 experts) and TPMoE, on
Qwen3-30B-A3B's block (hidden 2048, 128 experts, top-8, moe inter 768; random weights); EPMoE in prefill (HT)
with --layers ep-ht,ep-ht-fp8.

    python3 -m weft run -n 1 scripts/probe_moe_layers.py     # GPUs; JSON to $OUT/probe_moe_layers.json
    python3 -m weft run -n 2 scripts/probe_moe_layers.py --ep-tokens 4 --tp-tokens 16 --experts 8 --hidden 256 \
        --inter 128 --samples 2 --ht-tokens 8                 # cpu smoke run

For each layer: eager and CUDA-graph-replayed µs per call and the host µs to issue one call (slowest rank's
medians); on GPUs each kernel's GPU µs per call (torch.profiler over eager calls, rank 0), largest first: what
the layer spends outside its communication (the grouped GEMMs, the SiLU, the fp8 quantization, the router)
shows at any world size; whether a call synchronises with the device (torch.cuda.set_sync_debug_mode, the
first such call site), and the Python functions an eager call spends its host time in (cProfile, rank 0).
TPMoE also with each method of its ops (tp-overlap, tp-baseline).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft.bench.moe import MODELS, random_moe_weights  # noqa: E402
from weft.bench.report import ProbeLog  # noqa: E402
from weft.bench.timing import issue_times, time_calls  # noqa: E402
from weft.layers import EPMoE, TPMoE  # noqa: E402


def kernel_times(fn, calls: int = 10) -> dict:
    """{kernel name: GPU µs per call} of fn's launches, largest first (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {ev.key[:90]: round(ev.device_time_total / calls, 1) for ev in prof.key_averages()
             if ev.device_time_total > 0}
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def host_sync(fn) -> str | None:
    """Where fn's call first waits for the device (torch's sync debug mode as an error), or None."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as e:  # the innermost frame of weft's own code: the call that synchronised
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}weft{os.sep}" in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
        return f"{where}: {str(e).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def host_functions(fn, calls: int = 50, top: int = 12) -> dict:
    """{function: host µs per call spent in it, not in what it calls} of fn's eager calls, largest first."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive, tottime, cumtime, callers)}
    rows = sorted(((tt, f"{os.path.basename(f)}:{line} {name}") for (f, line, name), (_, _, tt, _, _)
                   in stats.items()), reverse=True)[:top]
    return {name: round(tt / calls * 1e6, 1) for tt, name in rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep-tokens", type=int, default=128, help="tokens per rank of the EPMoE decode cases")
    ap.add_argument("--ht-tokens", type=int, default=4096, help="tokens per rank of the EPMoE prefill cases")
    ap.add_argument("--tp-tokens", type=int, default=8192, help="tokens in all of the TPMoE case")
    ap.add_argument("--hidden", type=int, default=MODELS["qwen3"]["hidden"])
    ap.add_argument("--experts", type=int, default=MODELS["qwen3"]["experts"])
    ap.add_argument("--inter", type=int, default=MODELS["qwen3"]["inter"])
    ap.add_argument("--topk", type=int, default=MODELS["qwen3"]["k"])
    ap.add_argument("--layers", default="ep,ep-fp8,tp", help="ep, ep-fp8 (EPMoE decode), ep-ht, "
                    "ep-ht-fp8 (EPMoE prefill), tp (TPMoE, method auto), tp-overlap, tp-baseline")
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    weft.init(heap_size=(8 << 30) if gpu else None, workspace_bytes=(1 << 30) if gpu else None)
    w = weft.world()
    model = dict(hidden=args.hidden, experts=args.experts, inter=args.inter, k=args.topk)
    torch.manual_seed(0)
    dense = random_moe_weights(model, w.device)
    log = ProbeLog("probe_moe_layers", w.rank)
    for name in args.layers.split(","):
        if name.startswith("ep"):
            ht = name.startswith("ep-ht")
            # prefill: rows received bounded by every rank's tokens (no host sync, so captured; fp8 makes one)
            moe = EPMoE(*dense, args.topk, True, decode_tokens=args.ep_tokens, fp8=name.endswith("fp8"),
                        max_recv_tokens=args.ht_tokens * w.world_size if ht else None)
            layer = (lambda t, moe=moe, mode="ht" if ht else "ll": moe(t, mode))  # noqa: E731
            tokens = args.ht_tokens if ht else args.ep_tokens
        else:
            layer = TPMoE(*dense, args.topk, True, method=name[3:] or "auto")
            tokens = args.tp_tokens // w.world_size
        x = torch.randn(tokens, args.hidden, device=w.device).to(torch.bfloat16)
        row = dict(layer=name, world=w.world_size, tokens=tokens, **model)
        for view, graph in (("eager", False), ("graph", True)):
            ms = time_calls({name: lambda: layer(x)}, calls=2, samples=args.samples, graph=graph)
            row[f"{view}_us"] = round(next(iter(ms.values())) * 1000, 1)
        host = issue_times({name: lambda: layer(x)}, calls=20, samples=max(args.samples // 4, 1))
        row["host_us"] = round(next(iter(host.values())) * 1000, 1)
        if gpu:
            row["kernels_us"] = kernel_times(lambda: layer(x))
            row["syncs_at"] = host_sync(lambda: layer(x))
            row["host_top_us"] = host_functions(lambda: layer(x))
        log.add(row)
    log.save()


if __name__ == "__main__":
    main()
