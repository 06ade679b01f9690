"""gemm: the overlapped GEMMs against NCCL + cuBLAS, each part alone, and torch's fused ops, in one run.

For every shape of weft/bench/shapes.py (bf16, cut for the run's world size):
- ag: weft ag_gemm | NCCL all_gather + cuBLAS | cuBLAS alone | NCCL all_gather alone | torch
  fused_all_gather_matmul | GEMM alone (weft kernel) (the persistent kernel on the gathered A)
- rs: weft gemm_rs | cuBLAS + NCCL reduce_scatter | cuBLAS alone | NCCL reduce_scatter alone | torch
  fused_matmul_reduce_scatter
- ar: weft gemm_ar | cuBLAS + NCCL all_reduce | cuBLAS alone | NCCL all_reduce alone | torch
  one_shot_all_reduce + cuBLAS
Every result is checked against NCCL + cuBLAS before timing. Timed in CUDA graphs (an impl that cannot be
captured is timed eagerly and marked so). The bandwidth column holds TFLOP/s of the GEMM.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft.kernels import gemm
from weft.testing.reference import all_gather_ref, reduce_scatter_ref

from . import shapes, sweep
from .report import Row
from .timing import time_calls

SUITE = "gemm"
BASELINE = "NCCL+cuBLAS"
RIVAL = "torch"
BANDWIDTH = "TFLOP/s of the GEMM"


def add_arguments(p) -> None:
    p.add_argument("--ops", default="ag,rs,ar", help="comma-separated subset of ag, rs, ar")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--scale", type=int, default=1, help="divide M, N, K by this (cpu smoke runs)")
    p.add_argument("--only", default="", help="run only shapes whose label contains this")


def _ag_impls(w, m, n, k, dev):
    a = torch.randn(m, k, device=dev).to(torch.bfloat16)
    b = (torch.randn(k, n, device=dev) / k ** 0.5).to(torch.bfloat16)
    g = torch.empty(w.world_size * m, k, dtype=a.dtype, device=dev)
    c = torch.empty(w.world_size * m, n, dtype=a.dtype, device=dev)
    c2 = torch.empty_like(c)

    def nccl_cublas():
        all_gather_ref(g, a, w.group)
        return torch.matmul(g, b, out=c2)

    impls = {
        "weft ag_gemm": lambda: weft.ops.ag_gemm(a, b, out=c),
        BASELINE: nccl_cublas,
        "cuBLAS alone": lambda: torch.matmul(g, b, out=c2),
        "NCCL all_gather alone": lambda: all_gather_ref(g, a, w.group),
        "GEMM alone (weft kernel)": lambda: gemm.matmul(g, b, out=c2),
    }
    fused = sweep.torch_symm_op("fused_all_gather_matmul", a.dtype)
    if fused is not None:
        impls["torch fused"] = lambda: fused(a, [b], 0, w.group.group_name, return_A=False)[1][0]
    return impls, {"weft ag_gemm", BASELINE, "torch fused"}, 2 * w.world_size * m * n * k


def _rs_impls(w, m, n, k, dev):
    a = torch.randn(m, k, device=dev).to(torch.bfloat16)
    b = (torch.randn(k, n, device=dev) / (k * w.world_size) ** 0.5).to(torch.bfloat16)
    p = torch.empty(m, n, dtype=a.dtype, device=dev)
    out = torch.empty(m // w.world_size, n, dtype=a.dtype, device=dev)

    def cublas_nccl():
        torch.matmul(a, b, out=p)
        reduce_scatter_ref(out, p, w.group)
        return out

    impls = {
        "weft gemm_rs": lambda: weft.ops.gemm_rs(a, b),
        BASELINE: cublas_nccl,
        "cuBLAS alone": lambda: torch.matmul(a, b, out=p),
        "NCCL reduce_scatter alone": lambda: reduce_scatter_ref(out, p, w.group),
    }
    fused = sweep.torch_symm_op("fused_matmul_reduce_scatter", a.dtype)
    if fused is not None:
        impls["torch fused"] = lambda: fused(a, b, "sum", 0, w.group.group_name)
    return impls, {"weft gemm_rs", BASELINE, "torch fused"}, 2 * m * n * k


def _ar_impls(w, m, n, k, dev):
    a = torch.randn(m, k, device=dev).to(torch.bfloat16)
    b = (torch.randn(k, n, device=dev) / (k * w.world_size) ** 0.5).to(torch.bfloat16)
    p = torch.empty(m, n, dtype=a.dtype, device=dev)

    def cublas_nccl():
        torch.matmul(a, b, out=p)
        dist.all_reduce(p, group=w.group)
        return p

    impls = {
        "weft gemm_ar": lambda: weft.ops.gemm_ar(a, b),
        BASELINE: cublas_nccl,
        "cuBLAS alone": lambda: torch.matmul(a, b, out=p),
        "NCCL all_reduce alone": lambda: dist.all_reduce(p, group=w.group),
    }
    one_shot = sweep.torch_symm_op("one_shot_all_reduce", a.dtype)
    if one_shot is not None:
        from torch.distributed import _symmetric_memory as symm_mem

        ps = symm_mem.empty((m, n), dtype=a.dtype, device=dev)
        symm_mem.rendezvous(ps, w.group.group_name)

        def cublas_one_shot():
            torch.matmul(a, b, out=ps)
            return one_shot(ps, "sum", w.group.group_name)

        impls["torch one_shot + cuBLAS"] = cublas_one_shot
    return impls, {"weft gemm_ar", BASELINE, "torch one_shot + cuBLAS"}, 2 * m * n * k


def local_shape(op: str, M: int, N: int, K: int, w: int, scale: int = 1) -> tuple[int, int, int]:
    """The per-rank (m, n, k) of op ("ag", "rs", "ar") on the TP shape (M, N, K) at w ranks, cut `scale`-fold:
    ag: a_shard (m, k) @ b (k, n); rs, ar: a (m, k) @ b_shard (k, n)."""
    if op == "ag":
        m, n, k = shapes.ag_local(M, N, K, w)
        return shapes.scaled(m, scale, w) // w, shapes.scaled(n, scale, 1), shapes.scaled(k, scale, 1)
    m, n, k = shapes.rs_local(M, N, K, w)
    m = m if op == "ar" else shapes.scaled(m, scale, w)
    return m, shapes.scaled(n, scale, 1), shapes.scaled(k, scale, 1)


def cases(ops: list[str], world_size: int, scale: int):
    for op in ops:
        for M, N, K in {"ag": shapes.AG_GEMM, "rs": shapes.GEMM_RS, "ar": shapes.GEMM_AR}[op]:
            yield op, f"{op.upper()} {M}x{N}x{K}", local_shape(op, M, N, K, world_size, scale)


def run(args) -> list[Row]:
    w = weft.world()
    dev = w.device
    rows = []
    make = {"ag": _ag_impls, "rs": _rs_impls, "ar": _ar_impls}
    for op, label, (m, n, k) in cases(args.ops.split(","), w.world_size, args.scale):
        if args.only and args.only not in label:
            continue
        impls, checked, flops = make[op](w, m, n, k, dev)
        ref = impls[BASELINE]().clone()
        for name in [i for i in impls if i in checked]:  # impls' order: the same on every rank (a set's is not)
            if name == BASELINE:
                continue
            if w.rank == 0:
                print(f"{label}: checking {name}", flush=True)
            got = impls[name]()
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                raise RuntimeError(f"{label} {name}: relative error {err:.2e} against {BASELINE}")
        weft.barrier()
        case = f"{label} (per rank {m}x{n}x{k})"
        for name, ms in time_calls(impls, calls=3, samples=args.samples, graph=dev.type == "cuda").items():
            rows.append(Row(SUITE, case, name, ms, flops / ms / 1e9, flops, w.world_size))
            if w.rank == 0:
                print(f"{case} {name}: {ms * 1e3:.1f} us", flush=True)
        weft.barrier()
    return rows
