"""Sweep of all_gather's launch rule (weft/kernels/all_gather.py: PUSH_PROGRAM_BYTES, PUSH_MAX_PROGRAMS,
PULL_PROGRAM_BYTES) against NCCL, into a plain output.

    python3 -m weft run -n 2 scripts/probe_all_gather.py      # GPUs; JSON to $OUT/probe_all_gather.json
    python3 -m weft run -n 2 scripts/probe_all_gather.py --max-kib 64 --samples 2   # cpu smoke run

For shards of 64 KiB to 8 MiB (bf16): push and pull with each setting, and NCCL, CUDA-graph replay, slowest
rank's median (weft.bench.timing); every setting's first call is checked bit-exact against NCCL's result.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
import weft.kernels.all_gather as ag  # noqa: E402
from weft.bench.report import ProbeLog  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402

PUSH = [(256 << 10, 16), (64 << 10, 32), (16 << 10, 64)]
PULL = [64 << 10, 16 << 10, 8 << 10]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-kib", type=int, default=8 << 10)
    ap.add_argument("--samples", type=int, default=15)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    weft.init(heap_size=(4 << 30) if gpu else None)
    w = weft.world()
    log = ProbeLog("probe_all_gather", w.rank)
    kib = 64 if gpu else 4
    while kib <= args.max_kib:
        n = (kib << 10) // 2
        x = torch.randn(n, device=w.device).to(torch.bfloat16)
        out = torch.empty(w.world_size * n, dtype=x.dtype, device=w.device)
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, x, group=w.group)
        fns = {"nccl": lambda: dist.all_gather_into_tensor(ref, x, group=w.group)}
        ok = True
        for (push_bytes, push_max), pull_bytes in zip(PUSH, PULL):
            ag.PUSH_PROGRAM_BYTES, ag.PUSH_MAX_PROGRAMS, ag.PULL_PROGRAM_BYTES = push_bytes, push_max, pull_bytes
            w.plans.clear()
            for method, label in (("push", f"push {push_bytes >> 10}K/{push_max}"), ("pull", f"pull {pull_bytes >> 10}K")):
                out.fill_(float("nan"))
                weft.ops.all_gather(x, out=out, method=method)
                ok &= torch.equal(out, ref)
                # The plan that call made (the newest) holds this setting's launch: time it directly.
                fns[label] = lambda found=list(w.plans.values())[-1]: found(x, out)
        ms = time_calls(fns, calls=10, samples=args.samples, graph=gpu)
        row = dict(shard_kib=kib, ok=bool(ok), **{k: round(v * 1e3, 1) for k, v in ms.items()})
        log.add(row)
        kib *= 2
    log.save()
    weft.finalize()


if __name__ == "__main__":
    main()
