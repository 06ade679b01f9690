"""matmul: weft's persistent TMA GEMM against cuBLAS (torch.matmul) on the per-rank GEMMs of the TP shapes.

One rank is enough (`weft bench -n 1 matmul`). `--sweep` times every candidate config as well, which is how
gemm.configs in weft/tuning/data/ was chosen. The bandwidth column holds TFLOP/s.
"""
from __future__ import annotations

import torch

import weft
from weft.kernels import gemm

from . import shapes
from .report import Row
from .timing import time_calls

SUITE = "matmul"

CANDIDATES = [  # block_m, block_n, block_k, group_m, num_stages, num_warps, flatten
    gemm.GemmConfig(128, 256, 64, 8, 3, 8, False),
    gemm.GemmConfig(128, 256, 64, 8, 3, 8, True),
    gemm.GemmConfig(256, 128, 64, 8, 3, 8, False),
    gemm.GemmConfig(256, 128, 64, 8, 3, 8, True),
    gemm.GemmConfig(128, 128, 64, 8, 4, 4, False),
    gemm.GemmConfig(128, 128, 64, 8, 4, 8, True),
    gemm.GemmConfig(128, 128, 64, 8, 5, 8, False),
    gemm.GemmConfig(128, 256, 64, 16, 3, 8, True),
    gemm.GemmConfig(64, 256, 64, 8, 4, 4, False),
]


def per_rank_shapes(w: int) -> list[tuple[str, tuple[int, int, int]]]:
    out = [(f"AG {m}x{n}x{k}", shapes.ag_local(m, n, k, w)) for m, n, k in shapes.AG_GEMM]
    out += [(f"RS {m}x{n}x{k}", shapes.rs_local(m, n, k, w)) for m, n, k in shapes.GEMM_RS]
    return out


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int, default=8, help="tensor-parallel degree the per-rank shapes are cut for")
    p.add_argument("--sweep", action="store_true", help="also time every candidate config")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--scale", type=int, default=1, help="divide M, N, K by this (cpu smoke runs)")


def _label(c: gemm.GemmConfig) -> str:
    return f"weft {c.label()}"


def run(args) -> list[Row]:
    w = weft.world()
    dev = w.device
    rows = []
    for case, (m, n, k) in per_rank_shapes(args.ranks):
        m, n, k = (max(16, x // args.scale // 16 * 16) for x in (m, n, k))
        a = torch.randn(m, k, device=dev).to(torch.bfloat16)
        b = torch.randn(k, n, device=dev).to(torch.bfloat16)
        ref = a @ b
        impls = {"cuBLAS": lambda: torch.matmul(a, b), "weft": lambda: gemm.matmul(a, b)}
        if args.sweep and dev.type == "cuda":
            impls.update({_label(c): (lambda c=c: gemm.matmul(a, b, config=c)) for c in CANDIDATES})
        flops = 2 * m * n * k
        for name, f in list(impls.items()):
            try:
                out = f()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 1e-2:
                    raise RuntimeError(f"relative error {err:.2e}")
            except Exception as e:  # a candidate that does not compile or fit is reported, not fatal
                if name in ("cuBLAS", "weft"):
                    raise
                print(f"{case} {name}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
                del impls[name]
        for name, ms in time_calls(impls, calls=5 if dev.type == "cuda" else 1, samples=args.samples).items():
            rows.append(Row(SUITE, f"{case} ({m}x{n}x{k})", name, ms, flops / ms / 1e9, flops, w.world_size))
            print(f"{case} {name}: {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    return rows
