"""tpmlp: forward + backward of one sequence-parallel tensor-parallel MLP block, in one run.

Column (dim -> hidden / W) -> SiLU -> row (hidden / W -> dim) on `--tokens` tokens split over the ranks
(bf16), as training runs it: the input's and every weight's gradient (torch.autograd.grad, nothing
accumulated), by
- weft layers: ColumnParallelLinear / RowParallelLinear (ag_gemm and gemm_rs forward, gemm_rs and ag_gemm
  backward, declared with the ops in weft/kernels);
- NCCL+cuBLAS: the same block with NCCL's all_gather_into_tensor / reduce_scatter_tensor around
  torch.matmul, forward and backward, not overlapped;
- torch async-TP: the block on functional collectives, torch.compile'd with
  torch._inductor.config._micro_pipeline_tp (inductor's pass that turns all_gather + matmul and matmul +
  reduce_scatter into torch's symmetric-memory fused ops), where this torch has it.
Every result is checked against NCCL+cuBLAS before timing. Views: CUDA-graph replay (forward and backward
in one graph, captured by torch's recipe: weft.testing.graphs.capture) and eager calls.
The bandwidth column holds TFLOP/s per GPU (12 * tokens * dim * hidden / W per block, forward + backward).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import weft
from weft.kernels.common import nccl_all_gather, nccl_reduce_scatter
from weft.layers import ColumnParallelLinear, RowParallelLinear

from .report import Row
from .sweep import note
from .timing import time_calls

SUITE = "tpmlp"
BASELINE = "NCCL+cuBLAS"
RIVAL = "torch async-TP"
BANDWIDTH = "TFLOP/s per GPU"
# (label, dim, hidden): Llama-3-8B's and Qwen3-32B's MLPs.
SHAPES = [("Llama-3-8B", 4096, 14336), ("Qwen3-32B", 5120, 25600)]


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step, over all ranks")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--scale", type=int, default=1, help="divide dim, hidden and tokens by this (cpu smoke runs)")
    p.add_argument("--view", choices=["graph", "eager", "both"], default="both")
    p.add_argument("--only", default="", help="run only shapes whose label contains this")


class _AgMatmul(torch.autograd.Function):
    """NCCL all_gather of the token shards, then cuBLAS; backward: cuBLAS, then NCCL reduce_scatter."""

    @staticmethod
    def forward(ctx, x, b, group):
        w = dist.get_world_size(group)
        gathered = x.new_empty((w * x.shape[0], x.shape[1]))
        nccl_all_gather(gathered, x, group)
        ctx.save_for_backward(gathered, b)
        ctx.group = group
        return gathered @ b

    @staticmethod
    def backward(ctx, grad):
        gathered, b = ctx.saved_tensors
        w = dist.get_world_size(ctx.group)
        grad_x = grad.new_empty((grad.shape[0] // w, b.shape[0]))
        nccl_reduce_scatter(grad_x, grad @ b.t(), ctx.group)
        return grad_x, gathered.t() @ grad, None


class _MatmulRs(torch.autograd.Function):
    """cuBLAS, then NCCL reduce_scatter to token shards; backward: NCCL all_gather, then cuBLAS."""

    @staticmethod
    def forward(ctx, a, b, group):
        w = dist.get_world_size(group)
        out = a.new_empty((a.shape[0] // w, b.shape[1]))
        nccl_reduce_scatter(out, a @ b, group)
        ctx.save_for_backward(a, b)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        w = dist.get_world_size(ctx.group)
        gathered = grad.new_empty((w * grad.shape[0], grad.shape[1]))
        nccl_all_gather(gathered, grad, ctx.group)
        return gathered @ b.t(), a.t() @ gathered, None


def _async_tp_block(group):
    """The block on functional collectives for inductor's micro-pipeline TP pass, or None (with a note)."""
    try:
        import torch._inductor.config as inductor_config
        from torch.distributed import _functional_collectives as fc
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    except ImportError as e:
        note(f"torch async-TP unavailable ({e}): skipped")
        return None
    if not hasattr(inductor_config, "_micro_pipeline_tp") or not hasattr(fc, "all_gather_tensor_autograd"):
        note(f"torch {torch.__version__} has no _micro_pipeline_tp or autograd functional collectives: skipped")
        return None
    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group.group_name)

    def block(x, w1, b1, w2, b2):
        gathered = fc.all_gather_tensor_autograd(x, 0, group)
        h = nn.functional.silu(gathered @ w1 + b1)
        return fc.reduce_scatter_tensor_autograd(h @ w2, "sum", 0, group) + b2

    return torch.compile(block, fullgraph=True)


def _impls(w, dim, hidden, tokens, dev):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim)).to(dev, torch.bfloat16)
    col = ColumnParallelLinear.from_linear(ref[0], w.rank, w.world_size)
    row = RowParallelLinear.from_linear(ref[2], w.rank, w.world_size)
    # The same shards, as plain leaves, for the baselines (weights stored as weft's: (in, out) slices).
    w1, b1, w2, b2 = (p.detach().clone().requires_grad_() for p in (col.weight, col.bias, row.weight, row.bias))
    # Drawn on the host: nothing here uses the device's generator (see weft.testing.graphs.capture).
    g = torch.Generator().manual_seed(1 + w.rank)
    x = torch.randn(tokens // w.world_size, dim, generator=g).to(dev, torch.bfloat16).requires_grad_()
    grad = torch.randn(tokens // w.world_size, dim, generator=g).to(dev, torch.bfloat16)
    group = w.group

    def weft_layers():
        y = row(nn.functional.silu(col(x)))
        return torch.autograd.grad(y, (x, col.weight, col.bias, row.weight, row.bias), grad)

    def nccl_cublas():
        h = nn.functional.silu(_AgMatmul.apply(x, w1, group) + b1)
        y = _MatmulRs.apply(h, w2, group) + b2
        gx, gw1, gb1, gw2, gb2 = torch.autograd.grad(y, (x, w1, b1, w2, b2), grad)
        all_ranks_b2 = gb2.clone()  # the replicated bias: its gradient summed over the ranks, as weft's layer does
        dist.all_reduce(all_ranks_b2, group=group)
        return gx, gw1, gb1, gw2, all_ranks_b2

    impls = {"weft layers": weft_layers, BASELINE: nccl_cublas}
    block = _async_tp_block(group) if dev.type == "cuda" else None
    if block is not None:
        def async_tp():
            y = block(x, w1, b1, w2, b2)
            gx, gw1, gb1, gw2, gb2 = torch.autograd.grad(y, (x, w1, b1, w2, b2), grad)
            dist.all_reduce(gb2, group=group)
            return gx, gw1, gb1, gw2, gb2
        impls[RIVAL] = async_tp
    elif dev.type != "cuda":
        note("torch async-TP runs on cuda only: skipped")
    return impls


def run(args) -> list[Row]:
    w = weft.world()
    dev = w.device
    rows = []
    views = ["graph", "eager"] if args.view == "both" else [args.view]
    if dev.type != "cuda":
        views = ["eager"]
    for label, dim, hidden in SHAPES:
        if args.only and args.only not in label:
            continue
        dim, hidden, tokens = dim // args.scale, hidden // args.scale, args.tokens // args.scale
        impls = _impls(w, dim, hidden, tokens, dev)
        want = impls[BASELINE]()
        for name, fn in impls.items():
            if name == BASELINE:
                continue
            for what, got, ref in zip(("x", "w1", "b1", "w2", "b2"), fn(), want):
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 2e-2:
                    raise RuntimeError(f"{label} {name}: gradient of {what} off by {err:.2e} against {BASELINE}")
        weft.barrier()
        flops = 12 * tokens * dim * hidden // w.world_size
        case = f"{label} {tokens} tokens, {dim}->{hidden}->{dim}"
        for view in views:
            times = time_calls(impls, calls=1, samples=args.samples, graph=view == "graph")
            for name, ms in times.items():
                rows.append(Row(SUITE, case, name, ms, flops / ms / 1e9, flops, w.world_size,
                                view if len(views) > 1 else ""))
                if w.rank == 0:
                    print(f"{case} [{view}] {name}: {ms:.3f} ms", flush=True)
        weft.barrier()
    return rows
