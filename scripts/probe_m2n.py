"""Sweep of the M2N kernels' launch settings (the tuning data's m2n.launch: programs, chunk, warps;
weft/kernels/m2n.py), against the NVLink bound.

    python3 -m weft run -n 2 scripts/probe_m2n.py     # GPUs; JSON to $OUT/probe_m2n.json
    python3 -m weft run -n 2 scripts/probe_m2n.py --hidden 64 --tokens 8 --topk 2   # cpu smoke run

The first half of the ranks send, the others receive. Each sender's rows (tokens x hidden bf16, 128 x 7168 by
default) name `topk` receivers each (round-robin from the row's index, so every receiver gets tokens x topk / N
entries of each sender). For each setting: m2n_dispatch, and dispatch + combine, CUDA-graph replay, slowest rank's
median; `bound_us`: every entry's row, once per op, at `--link-gbs` GB/s a direction, a sender's links to the
receivers in parallel (M2N itself moves a row once per receiver it names: k / N times fewer at top-k). Each
setting's first call is checked against torch (recv's rows; combine of y = recv with weights 1 gives each row its
number of live entries times itself).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft import tuning  # noqa: E402
from weft.kernels.m2n import M2N_CPU  # noqa: E402
from weft.bench.report import ProbeLog  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", default="1,8")
    ap.add_argument("--tokens", default="128")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--programs", default="66,132,264", help="programs values (GPUs)")
    ap.add_argument("--chunks", default="1024,2048", help="chunk values, elements (GPUs)")
    ap.add_argument("--warps", default="4,8", help="warps values (GPUs)")
    ap.add_argument("--link-gbs", type=float, default=450.0, help="NVLink GB/s a direction per GPU (H100/H200: 450)")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    weft.init(workspace_bytes=(1 << 30) if gpu else None, heap_size=(8 << 30) if gpu else None)
    w = weft.world()
    m = w.world_size // 2
    n = w.world_size - m
    senders, receivers = list(range(m)), list(range(m, w.world_size))
    sender = w.rank < m
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    settings = (list(itertools.product(ints(args.programs), ints(args.chunks), ints(args.warps))) if gpu
                else [M2N_CPU])
    log = ProbeLog("probe_m2n", w.rank)
    for tokens, k in itertools.product(ints(args.tokens), ints(args.topk)):
        g = torch.Generator(device=w.device).manual_seed(1234 + w.rank)
        x = torch.randn(tokens if sender else 0, args.hidden, device=w.device, generator=g).to(torch.bfloat16)
        rows = torch.arange(x.shape[0], device=w.device)[:, None]
        dest = (rows + torch.arange(k, device=w.device)[None, :]) % n
        ones = torch.ones(dest.shape, dtype=torch.float32, device=w.device)
        entries = tokens * k  # a sender's, over its links to the N receivers
        bound_us = entries * args.hidden * 2 / n / (args.link_gbs * 1e3)
        setting = contextlib.ExitStack()
        for programs, chunk, warps in settings:
            setting.close()
            if gpu:
                setting.enter_context(tuning.overrides({"m2n.launch": dict(programs=programs, chunk=chunk,
                                                                           warps=warps)}))
            w.plans.clear()

            def dispatch():
                return weft.ops.m2n_dispatch(x, dest, senders, receivers, tokens)

            def both():
                recv, counts, handle = dispatch()
                return weft.ops.m2n_combine(None if sender else recv, ones if sender else None, handle)

            recv, counts, handle = dispatch()
            out = weft.ops.m2n_combine(None if sender else recv, ones if sender else None, handle)
            if sender:
                ok = bool(torch.equal(out, x * k))  # every entry live: k times the row, exact in bf16 for k = 2^i
            else:
                want = (entries // n) * torch.ones(m, dtype=torch.int32, device=w.device)
                ok = bool(torch.equal(counts, want))
            ok = weft.ops.all_gather(torch.tensor([int(ok)], device=w.device)).min().item() == 1
            ms = time_calls({"dispatch": dispatch, "dispatch+combine": both}, calls=10, samples=args.samples,
                            graph=gpu)
            us = {key: round(v * 1e3, 1) for key, v in ms.items()}
            log.add(dict(senders=m, receivers=n, tokens=tokens, k=k, hidden=args.hidden, programs=programs,
                         chunk=chunk, warps=warps, ok=ok, **us, bound_us=round(bound_us, 1),
                         dispatch_x_bound=round(us["dispatch"] / bound_us, 2),
                         both_x_bound=round(us["dispatch+combine"] / (2 * bound_us), 2)))
    log.save()
    weft.finalize()


if __name__ == "__main__":
    main()
