"""ulysses: Ulysses sequence parallelism (all ranks), against torch's all_to_all_single (+ matmul).

At --tokens global tokens (rank r holding the r-th slice), --heads x 128 head dims, bf16, hidden --hidden:
- all-to-all, both directions ("heads": (S, heads, 128) -> (W S, heads / W, 128); "seq" back): weft
  ulysses_all_to_all (push) against all_to_all_single with the permutes (its method="nccl"), checked
  bit-exact;
- QKV: weft qkv_all_to_all (fused: tiles pushed to their head owner as computed) against torch.matmul +
  all_to_all_single;
- O: weft all_to_all_o_proj (fused: arriving row blocks feed the GEMM) against all_to_all_single +
  torch.matmul.
Cells are the slowest rank's µs per call; bandwidth is bytes sent per rank per second (the projections:
their all-to-all's bytes). The fused ops go through the default workspace in passes of tokens; one that
refuses a size (a token's row beyond half the workspace) is reported and left out.
"""
from __future__ import annotations

import torch

import weft
from weft.kernels.ulysses import all_to_all_o_proj, qkv_all_to_all, ulysses_all_to_all

from .report import Row
from .timing import time_calls

SUITE = "ulysses"
BASELINE = "torch: all_to_all_single (+ matmul)"
BANDWIDTH = "all-to-all bytes per rank (GB/s)"
HEAD_DIM = 128
DTYPE = torch.bfloat16
TOLERANCE = 2e-2  # relative error (norm) of the fused ops against matmul + all_to_all_single, bf16


def add_arguments(p) -> None:
    p.add_argument("--tokens", default="4096,16384,65536", help="global sequence lengths")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--samples", type=int, default=20)


def _label(tokens: int) -> str:
    return f"{tokens >> 10}K" if tokens % 1024 == 0 else str(tokens)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _time(args, rows, case, impls, nbytes):
    w = weft.world()
    gpu = w.device.type == "cuda"
    weft.barrier()
    calls = (20 if nbytes < (64 << 20) else 3) if gpu else 1
    times = time_calls(impls, calls=calls, samples=args.samples, warmup=3 if gpu else 1, graph=gpu)
    for name, ms in times.items():
        rows.append(Row(SUITE, case, name, ms, nbytes / ms / 1e6, nbytes, w.world_size))
        if w.rank == 0:
            print(f"{case} {name}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.1f} GB/s", flush=True)
    weft.barrier()


def run(args) -> list[Row]:
    rows: list[Row] = []
    w = weft.world()
    dev = w.device
    heads, hidden = args.heads, args.hidden
    hd = heads * HEAD_DIM
    gen = torch.Generator(device=dev).manual_seed(3)  # the same weights everywhere
    w_qkv = (torch.randn(hidden, 3 * hd, device=dev, generator=gen) * hidden ** -0.5).to(DTYPE)
    w_o = (torch.randn(hd, hidden, device=dev, generator=gen) * hd ** -0.5).to(DTYPE)
    local = torch.Generator(device=dev).manual_seed(200 + w.rank)
    for tokens in [int(t) for t in args.tokens.split(",") if t]:
        s = tokens // w.world_size
        label = _label(tokens)
        x = torch.randn(s, heads, HEAD_DIM, device=dev, generator=local).to(DTYPE)
        head_sharded = ulysses_all_to_all(x, method="nccl")
        nbytes = x.numel() * x.element_size()
        for direction, inp in (("heads", x), ("seq", head_sharded)):
            impls = {"weft": lambda inp=inp, d=direction: ulysses_all_to_all(inp, d, method="push"),
                     BASELINE: lambda inp=inp, d=direction: ulysses_all_to_all(inp, d, method="nccl")}
            case = f"all-to-all {direction} {label} tokens"
            if not torch.equal(impls["weft"](), impls[BASELINE]()):
                raise RuntimeError(f"{case}: weft differs from all_to_all_single")
            _time(args, rows, case, impls, nbytes)
        h = torch.randn(s, hidden, device=dev, generator=local).to(DTYPE)
        fusions = {
            f"QKV {label} tokens": ({"weft": lambda: qkv_all_to_all(h, w_qkv, heads, method="fused"),
                                     BASELINE: lambda: ulysses_all_to_all(
                                         torch.matmul(h, w_qkv).view(s, 3, heads, HEAD_DIM), packed=True,
                                         method="nccl")}, 3 * nbytes),
            f"O {label} tokens": ({"weft": lambda: all_to_all_o_proj(head_sharded, w_o, method="fused"),
                                   BASELINE: lambda: torch.matmul(
                                       ulysses_all_to_all(head_sharded, "seq", method="nccl").view(s, hd), w_o)},
                                  nbytes),
        }
        for case, (impls, sent) in fusions.items():
            try:
                got = impls["weft"]()
            except ValueError as e:
                if w.rank == 0:
                    print(f"{case}: the fused op left out ({e})", flush=True)
                continue
            err = _rel_err(got, impls[BASELINE]())
            if not err < TOLERANCE:
                raise RuntimeError(f"{case}: relative error {err:.2e} against matmul + all_to_all_single")
            _time(args, rows, case, impls, sent)
        del x, head_sharded, h
    return rows
