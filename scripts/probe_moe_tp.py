"""Tile sweep of the tensor-parallel MoE ops' grouped GEMM (weft/kernels/moe/tp.py: _gemm_config).

    python3 -m weft run -n 2 scripts/probe_moe_tp.py            # GPUs; JSON to $OUT/probe_moe_tp.json
    python3 -m weft run -n 2 scripts/probe_moe_tp.py --scale 64 # cpu smoke run (interpreter): shapes cut 64-fold

Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, moe inter 768) and Mixtral-8x7B (4096, 8, top-2, 14336), 8192
tokens in all: ag_group_gemm (overlap) and group_gemm_rs (overlap) with every tiling, operands by TMA and by
pointers (the tuning data's moe_tp.tma_operands; the tiles are moe_tp.tiles), CUDA-graph replay, slowest rank's median (weft.bench.timing). Each setting's first
call is checked against the default's output.
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
from weft.bench.moe import MODELS  # noqa: E402
from weft.bench.report import ProbeLog  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, flatten); the cpu backend's tiles are fixed (tp.CPU_TILES): one run
GPU_TILES = [(128, 128, 64, 4, 8, True), (128, 256, 64, 3, 8, True), (128, 256, 64, 3, 8, False),
             (128, 256, 64, 4, 8, True), (64, 256, 64, 3, 8, True), (64, 128, 64, 4, 4, True)]
CPU_TILES = [(16, 32, 32, 1, 4, False)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3,mixtral")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--scale", type=int, default=1, help="divide hidden, inter and tokens by this (smoke runs)")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--tiles", default="", help="BMxBNxBKxSTAGESxWARPSxFLATTEN,... (default: the list above)")
    ap.add_argument("--tma", default="1,0", help="operands by TMA (1) and by pointers (0)")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    weft.init(heap_size=(8 << 30) if gpu else None, workspace_bytes=(1 << 30) if gpu else None)
    w = weft.world()
    dev, ws = w.device, w.world_size
    kind = "large"  # the tiles these shapes take on GPUs (their experts' segments fill 128 rows)
    log = ProbeLog("probe_moe_tp", w.rank)
    for name in args.models.split(","):
        model = MODELS[name]
        m = args.tokens // ws // args.scale
        hidden, experts, k, n = model["hidden"] // args.scale, model["experts"], model["k"], model["inter"] // ws // args.scale
        g = torch.Generator(device=dev).manual_seed(7 + w.rank)
        x = torch.randn(m, hidden, device=dev, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(experts, device=dev, generator=g)[:k] for _ in range(m)])
        wts = torch.rand(m, k, device=dev, generator=g)
        w_gu = (torch.randn(experts, hidden, 2 * n, device=dev, generator=g) / hidden ** 0.5).to(torch.bfloat16)
        w_dn = (torch.randn(experts, n, hidden, device=dev, generator=g) / n ** 0.5).to(torch.bfloat16)
        inter_ref, layout = weft.ops.ag_group_gemm(x, w_gu, idx, method="overlap")
        h = inter_ref[:, :n].contiguous()
        out_ref = weft.ops.group_gemm_rs(h, w_dn, idx, wts, layout, method="overlap")
        tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")] if args.tiles else \
            GPU_TILES if gpu else CPU_TILES
        setting = contextlib.ExitStack()  # the tuning overrides of the setting being timed
        for tile, tma in ((t, bool(int(a))) for t in tiles for a in args.tma.split(",")):
            setting.close()
            if gpu:
                bm, bn, bk, stages, warps, flatten = tile
                tiles_now = dict(tuning.value("moe_tp.tiles", dev, ws))
                tiles_now[kind] = dict(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps,
                                       flatten=flatten)
                setting.enter_context(tuning.overrides({"moe_tp.tiles": tiles_now, "moe_tp.tma_operands": tma}))
            w.plans.clear()
            try:
                inter, lay = weft.ops.ag_group_gemm(x, w_gu, idx, method="overlap")
                out = weft.ops.group_gemm_rs(h, w_dn, idx, wts, lay, method="overlap")
                ok = bool(torch.allclose(inter.float(), inter_ref.float(), rtol=2e-2, atol=2e-2)) and \
                    bool(torch.allclose(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2))
                ms = time_calls({"ag_group_gemm": lambda: weft.ops.ag_group_gemm(x, w_gu, idx, method="overlap"),
                                 "group_gemm_rs": lambda: weft.ops.group_gemm_rs(h, w_dn, idx, wts, lay,
                                                                                 method="overlap")},
                                calls=3, samples=args.samples, graph=gpu)
                row = dict(model=name, tile=list(tile), tma=tma, ok=ok,
                           **{op: round(v * 1e3, 1) for op, v in ms.items()})
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit is reported
                row = dict(model=name, tile=list(tile), tma=tma, error=f"{type(e).__name__}: {e}"[:200])
            log.add(row)
        setting.close()
    log.save()
    weft.finalize()


if __name__ == "__main__":
    main()
