"""Does a decode GEMV stream its weight faster when the weight is stored K-contiguous? One GPU, bf16, M = 1.

    python3 -m weft run -n 1 scripts/probe_gemv_layout.py --out $OUT/probe_gemv_layout.json
    python3 -m weft run -n 1 scripts/probe_gemv_layout.py --shapes 64x96 --samples 2 --out /tmp/p.json   # cpu smoke

weft's decode GEMVs (weft/kernels/decode.py) read W as (K, N), N contiguous (x @ W): a program owns a few column
runs and walks its K range row by row, so each weight row gives it one or two short runs (a head's 2 x 64 columns
in the QKV projection: 128-byte pieces 12 KiB apart), and K is split across programs (a split-K tail) to fill the
GPU. Stored (N, K) instead (nn.Linear's own layout), a program owns a few output columns and reads each one's K
values as one contiguous run; N / block_n programs fill the GPU without splitting K for every shape of a decode
step. This probe times both forms as plain Triton GEMVs (no norm, no epilogue, fp32 out, a split-K summed by
atomic adds), each swept over a small grid, and torch.matmul on each layout (cuBLAS: x @ W and x @ W_t.T), at
Qwen3-8B's one-GPU projection shapes, as a fraction of the copy bandwidth. Calls replay from a CUDA graph and go
round weight copies larger than L2, so the weights come from HBM. A probe of a layout, not a kernel of weft's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft.bench.e2e import copy_bandwidth  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402

# Qwen3-8B's projections at one GPU (K x N): QKV, O, gate/up, down.
SHAPES = "4096x6144,4096x4096,4096x24576,12288x4096"
COPIES_BYTES = {"cuda": 256 << 20, "cpu": 0}  # weight bytes a call goes round: well past an H100/H200's L2
# (block_n, block_k, num_stages, num_warps) grids; the split is the one that makes about one wave of programs.
GRID_KN = list(itertools.product((64, 128, 256), (16, 32, 64), (3, 4), (4,)))
GRID_NK = (list(itertools.product((8, 16, 32), (256, 512), (2, 3, 4), (4, 8)))
           + list(itertools.product((64, 128), (64, 128), (3, 4), (4, 8))))  # 128: a whole head a program
CPU_GRID = [(16, 32, 1, 4)]


@triton.jit
def gemv_kernel(x, w, out, K, N, K_SPLIT, W_NK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr):
    """out[n] += sum over this program's K range of x[k] W[k, n], program (n tile, split) walking K_SPLIT rows of
    K. W_NK: W stored (N, K), K contiguous: the tile's BLOCK_N columns are BLOCK_N contiguous runs along K. Else W
    is (K, N), N contiguous (weft's decode layout): each row of K gives one BLOCK_N run."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * K_SPLIT
    kk = tl.arange(0, BLOCK_K)
    # The accumulator keeps the weight tile's shape; one reduction over K after the loop.
    acc = tl.zeros([BLOCK_N, BLOCK_K] if W_NK else [BLOCK_K, BLOCK_N], tl.float32)
    for k in tl.range(k0, tl.minimum(k0 + K_SPLIT, K), BLOCK_K, num_stages=STAGES):
        xv = tl.load(x + k + kk, mask=k + kk < K, other=0.0).to(tl.float32)
        if W_NK:
            offs = cols[:, None].to(tl.int64) * K + (k + kk)[None, :]
            mask = (cols < N)[:, None] & (k + kk < K)[None, :]
            acc += tl.load(w + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32) * xv[None, :]
        else:
            offs = (k + kk)[:, None].to(tl.int64) * N + cols[None, :]
            mask = (k + kk < K)[:, None] & (cols < N)[None, :]
            acc += tl.load(w + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32) * xv[:, None]
    tl.atomic_add(out + cols, tl.sum(acc, axis=1 if W_NK else 0), mask=cols < N, sem="relaxed")


def one_wave_split(tiles: int, k: int, block_k: int, slots: int) -> int:
    """K rows a program walks: the fewest splits (whole blocks each) that give the tiles at least one wave of
    `slots` programs, at most one block a split."""
    blocks = triton.cdiv(k, block_k)
    split = min(blocks, max(1, slots // max(tiles, 1)))
    return triton.cdiv(blocks, split) * block_k


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="K x N weight shapes, comma-separated")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--out", required=True, help="the JSON report's path")
    return p.parse_args(argv)


def main(args) -> None:
    weft.init()
    device = weft.device()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    bandwidth = copy_bandwidth(device) if cuda else 0.0
    slots = 2 * torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    rows, every = [], {}
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        g = torch.Generator(device).manual_seed(0)
        copies = max(1, -(-COPIES_BYTES[device.type] // (k * n * dtype.itemsize)))
        w_kn = [(torch.randn(k, n, generator=g, device=device) * k ** -0.5).to(dtype) for _ in range(copies)]
        w_nk = [w.t().contiguous() for w in w_kn]
        x = torch.randn(1, k, generator=g, device=device).to(dtype)
        out = torch.empty(n, dtype=torch.float32, device=device)
        want = (x.float() @ w_kn[-1].float()).reshape(-1)  # a call ends on the last copy

        def triton_call(w_nk, weights, block_n, block_k, stages, warps):
            k_split = one_wave_split(triton.cdiv(n, block_n), k, block_k, slots)
            grid = (triton.cdiv(n, block_n), triton.cdiv(k, k_split))

            def call():
                for w in weights:
                    out.zero_()
                    gemv_kernel[grid](x, w, out, k, n, k_split, W_NK=w_nk, BLOCK_N=block_n, BLOCK_K=block_k,
                                      STAGES=stages, num_warps=warps)
            return call

        fns = {"torch.matmul (K, N)": lambda: [torch.matmul(x, w) for w in w_kn],
               "torch.matmul (N, K)": lambda: [torch.matmul(x, w.t()) for w in w_nk]}
        for layout, nk, weights, grid in (("(K, N)", False, w_kn, GRID_KN), ("(N, K)", True, w_nk, GRID_NK)):
            for setting in (grid if cuda else CPU_GRID):
                call = triton_call(nk, weights, *setting)
                call()
                err = ((out - want).abs().max() / want.abs().max()).item()
                if err > 1e-2:
                    raise AssertionError(f"{layout} {setting}: relative error {err:.1e}")
                fns[f"triton {layout} {setting}"] = call
        ms = time_calls(fns, calls=1, samples=args.samples, warmup=2, graph=cuda)
        per_call = {name: t * 1e3 / copies for name, t in ms.items()}  # µs a GEMV
        every[shape] = {name: round(us, 2) for name, us in per_call.items()}
        best = {}
        for name, us in per_call.items():
            form = name.split(" (")[0] + " (" + name.split(" (")[1].split(")")[0] + ")"
            if form not in best or us < best[form][1]:
                best[form] = (name, us)
        for form, (name, us) in sorted(best.items()):
            frac = k * n * dtype.itemsize / (us * 1e-6) / bandwidth if cuda else 0.0
            rows.append(dict(shape=shape, form=form, best=name, us=round(us, 2), bandwidth_fraction=round(frac, 3)))
            print(f"{shape:>12} {form:<22} {us:8.2f} µs {frac:6.1%}  {name}", flush=True)
    if weft.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(device) if cuda else "cpu",
                           copy_bandwidth_gbps=round(bandwidth / 1e9, 1), rows=rows,
                           us_every_setting=every), f, indent=1)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main(parse())
