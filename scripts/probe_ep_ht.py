"""Where the high-throughput EP time goes, and a sweep of its push programs, receiving programs and copy block
(the tuning data's moe.ht_programs, moe.ht_copy_programs, moe.ht_block; weft/kernels/moe/ep_ht.py).

    python3 -m weft run -n 2 scripts/probe_ep_ht.py     # GPUs; JSON to $OUT/probe_ep_ht.json
    python3 -m weft run -n 2 scripts/probe_ep_ht.py --hidden 256 --tokens 16 --experts 8 --samples 2   # cpu smoke

DeepSeek-V3 prefill sizes by default (4096 tokens per rank, hidden 7168, top-8 of 256 experts). For each
(block words, warps): ep_dispatch + ep_combine (max_recv_tokens), the dispatch alone, the combine alone (one
dispatch's handle, combined again and again), and the routing alone (the count, route and position kernels),
CUDA-graph replay, slowest rank's median µs. Every setting's combine is checked bit-exact against the first
setting's (the same sums in the same order).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft import tuning  # noqa: E402
from weft.bench.report import ProbeLog  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--settings", default="1024:8,2048:8,4096:8,4096:16,2048:4",
                    help="block words:warps[:push programs[:receiving programs]] (GPUs)")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    weft.init(heap_size=(8 << 30) if gpu else None, workspace_bytes=(1 << 30) if gpu else None)
    w = weft.world()
    dev = w.device
    settings = [tuple(int(v) for v in s.split(":")) for s in args.settings.split(",")] if gpu else [(256, 4)]
    defaults = ((tuning.value("moe.ht_programs", dev, w.world_size), tuning.value("moe.ht_copy_programs", dev,
                                                                                     w.world_size))
                if gpu else (0, 0))
    settings = [s + defaults[len(s) - 2:] for s in settings]
    log = ProbeLog("probe_ep_ht", w.rank)
    g = torch.Generator(device=dev).manual_seed(99 + w.rank)
    x = torch.randn(args.tokens, args.hidden, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(args.tokens, args.experts, device=dev, generator=g).topk(args.topk, dim=-1).indices
    wts = torch.rand(args.tokens, args.topk, device=dev, generator=g)
    cap = w.world_size * args.tokens
    first = None
    setting = contextlib.ExitStack()  # the tuning overrides of the setting being timed
    for block, warps, programs, copy_programs in settings:
        setting.close()
        if gpu:
            setting.enter_context(tuning.overrides({"moe.ht_block": {"words": block, "warps": warps},
                                                    "moe.ht_programs": programs,
                                                    "moe.ht_copy_programs": copy_programs}))
        w.plans.clear()
        rx, _, _, _, handle = weft.ops.ep_dispatch(x, idx, wts, args.experts, max_recv_tokens=cap)
        y = weft.ops.ep_combine(rx, handle)
        first = y if first is None else first
        ok = bool(torch.equal(y, first))
        ht = handle.plan
        rank_pos = torch.empty((args.tokens, w.world_size), dtype=torch.int32, device=dev)
        table = torch.empty((w.world_size, w.world_size), dtype=torch.int32, device=dev)
        counts = torch.empty(ht.local, dtype=torch.int32, device=dev)
        info = torch.empty(3, dtype=torch.int32, device=dev)
        block_counts = torch.empty((ht.blocks, w.world_size + 1), dtype=torch.int32, device=dev)
        block_start = torch.empty((ht.blocks, w.world_size), dtype=torch.int32, device=dev)
        a = ht.address

        def route():
            ht.count(a(idx), a(block_counts), ht.error_at, ht.tokens)
            ht.route(a(block_counts), a(block_start), a(table), a(counts), a(info), *ht.route_fixed, ht.blocks)
            ht.position(a(idx), a(block_start), a(rank_pos), ht.tokens)

        def both():
            r, _, _, _, h = weft.ops.ep_dispatch(x, idx, wts, args.experts, max_recv_tokens=cap)
            return weft.ops.ep_combine(r, h)

        fns = {"dispatch+combine": both,
               "dispatch": lambda: weft.ops.ep_dispatch(x, idx, wts, args.experts, max_recv_tokens=cap),
               "combine": lambda: weft.ops.ep_combine(rx, handle),
               "route (count, route, position)": route}
        ms = time_calls(fns, calls=2, samples=args.samples, graph=gpu)
        log.add(dict(block_words=block, warps=warps, programs=programs, copy_programs=copy_programs, ok=ok,
                     **{k: round(v * 1e3, 1) for k, v in ms.items()}))
    log.save()
    weft.finalize()


if __name__ == "__main__":
    main()
