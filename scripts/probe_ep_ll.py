"""Sweep of the low-latency EP kernels' launch settings (the tuning data's moe.ll_launch: programs, chunk_words,
warps; weft/kernels/moe/ep_ll.py).

    python3 -m weft run -n 2 scripts/probe_ep_ll.py     # GPUs; JSON to $OUT/probe_ep_ll.json
    python3 -m weft run -n 2 scripts/probe_ep_ll.py --hidden 256 --tokens 4 --experts 8   # cpu smoke run

DeepSeek-V3 decode sizes by default (hidden 7168, top-8 of 256 experts, 1 / 32 / 128 tokens per rank). The
kernels deal out (token, chunk of chunk_words words) units to at most `programs` programs (capped at the
SM count). For each setting: ep_dispatch_ll (bf16 and fp8), dispatch + combine (bf16 and fp8 dispatch), and
fp8 dispatch + combine with a GEMM after each op's send, the ops in one launch or split (return_recv_hook: the
GEMM between send and receive, so the transfer hides under it); CUDA-graph replay, slowest rank's median. Each
setting's first call is checked against the torch routing (combine of y = recv with weights 1 gives each token
k times itself).
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
from weft.kernels.moe.ep_ll import LL_CPU  # noqa: E402
from weft.bench.report import ProbeLog  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", default="1,32,128")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--programs", default="64,132", help="programs values (GPUs)")
    ap.add_argument("--chunks", default="256,512,1024", help="chunk_words values (GPUs)")
    ap.add_argument("--warps", default="4,8", help="warps values (GPUs)")
    ap.add_argument("--per-sm", type=int, default=4, help="per_sm while sweeping (programs resident per SM)")
    ap.add_argument("--gemm", type=int, default=2048, help="size of the square GEMM run between send and receive")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    # The LL buffers at 128 tokens of hidden 7168 need more than the default workspace.
    weft.init(heap_size=(8 << 30) if gpu else None, workspace_bytes=(1 << 30) if gpu else None)
    w = weft.world()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    programs = ints(args.programs) if gpu else [LL_CPU[0]]
    chunks = ints(args.chunks) if gpu else [LL_CPU[1]]
    warps_swept = ints(args.warps) if gpu else [LL_CPU[2]]
    log = ProbeLog("probe_ep_ll", w.rank)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device=w.device).manual_seed(1234 + w.rank)
        x = torch.randn(tokens, args.hidden, device=w.device, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(args.experts, device=w.device, generator=g)[:args.topk]
                           for _ in range(tokens)]).to(torch.int64)
        ones = torch.ones(idx.shape, dtype=torch.float32, device=w.device)
        want = x.float() * args.topk
        y = x.new_empty((args.experts // w.world_size, w.world_size * tokens, args.hidden)).normal_()
        n = args.gemm if gpu else 64  # a GEMM for the hooks to hide the transfers under
        a, c = (torch.randn(n, n, device=w.device).to(torch.bfloat16) for _ in range(2))
        setting = contextlib.ExitStack()  # the tuning overrides of the setting being timed
        for prog, chunk, warps in itertools.product(programs, chunks, warps_swept):
            setting.close()
            if gpu:
                setting.enter_context(tuning.overrides({"moe.ll_launch": dict(programs=prog, per_sm=args.per_sm,
                                                                              chunk_words=chunk, warps=warps)}))
            w.plans.clear()

            def both():
                recv, _, _, h = weft.ops.ep_dispatch_ll(x, idx, args.experts, tokens)
                return weft.ops.ep_combine_ll(recv, idx, ones, h)

            got = both()
            ok = torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
            def fp8_both():
                _, _, _, h = weft.ops.ep_dispatch_ll(x, idx, args.experts, tokens, fp8=True)
                return weft.ops.ep_combine_ll(y, idx, ones, h)

            def gemm_between(hook):  # a GEMM after each op's send: before its receive (hook) or after it
                if not hook:
                    _, _, _, h = weft.ops.ep_dispatch_ll(x, idx, args.experts, tokens, fp8=True)
                    torch.mm(a, a, out=c)
                    weft.ops.ep_combine_ll(y, idx, ones, h)
                    return torch.mm(a, a, out=c)
                _, _, _, h, receive = weft.ops.ep_dispatch_ll(x, idx, args.experts, tokens, fp8=True,
                                                               return_recv_hook=True)
                torch.mm(a, a, out=c)
                receive()
                _, receive = weft.ops.ep_combine_ll(y, idx, ones, h, return_recv_hook=True)
                torch.mm(a, a, out=c)
                receive()

            fns = {"dispatch": lambda: weft.ops.ep_dispatch_ll(x, idx, args.experts, tokens),
                   "dispatch fp8": lambda: weft.ops.ep_dispatch_ll(x, idx, args.experts, tokens, fp8=True),
                   "dispatch+combine": both, "dispatch fp8+combine": fp8_both,
                   "gemm": lambda: torch.mm(a, a, out=c),
                   "fp8 d+c with gemms": lambda: gemm_between(False),
                   "fp8 d+c with gemms (hooks)": lambda: gemm_between(True)}
            ms = time_calls(fns, calls=10, samples=args.samples, graph=gpu)
            row = dict(tokens=tokens, programs=prog, chunk_words=chunk, warps=warps, ok=ok,
                       **{k: round(v * 1e3, 1) for k, v in ms.items()})
            log.add(row)
    log.save()
    weft.finalize()


if __name__ == "__main__":
    main()
