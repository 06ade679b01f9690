"""Train a sequence-parallel MLP block on N ranks and check its loss curve against one process.

    weft run -n 2 examples/train_tp_mlp.py                 # cpu backend: small sizes, well under a minute
    weft run -n 8 examples/train_tp_mlp.py --dim 1024 --hidden 4096 --tokens 4096 --steps 500   # GPUs

The block is Linear(dim, hidden) -> SiLU -> Linear(hidden, dim), as ColumnParallelLinear (ag_gemm: the
ranks' tokens gathered under the GEMM) and RowParallelLinear (gemm_rs: partial sums reduce-scattered back to
token shards), made from the same nn.Linear pair as the reference. Every step draws a fresh random batch
(the same on every rank, from the step's seed); rank r trains on its block of the tokens, with its loss the
sum of its squared errors over the whole batch's size, so that the ranks' losses add up to the reference's
mean squared error. SGD with momentum updates each rank's shards. Every rank also trains the single-process
model on the whole batch and compares: the script fails if the curves differ by more than --rtol.
"""
import argparse
import time

import torch
from torch import nn

import weft
from weft.layers import ColumnParallelLinear, RowParallelLinear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="tokens per step, over all ranks")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=None,
                   help="largest relative difference of the loss curves (default 1e-4; 5e-3 on GPUs, where weft's "
                        "fp32 GEMMs multiply in tf32)")
    args = p.parse_args()

    weft.init()
    w, me, dev = weft.world_size(), weft.rank(), weft.device()
    rtol = args.rtol if args.rtol is not None else (5e-3 if dev.type == "cuda" else 1e-4)
    if args.tokens % w or args.hidden % w:
        raise SystemExit(f"--tokens ({args.tokens}) and --hidden ({args.hidden}) must divide by {w} ranks")
    torch.manual_seed(args.seed)
    reference = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.SiLU(), nn.Linear(args.hidden, args.dim)).to(dev)
    parallel = nn.Sequential(ColumnParallelLinear.from_linear(reference[0], me, w), nn.SiLU(),
                             RowParallelLinear.from_linear(reference[2], me, w))
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9) for m in (reference, parallel)]
    mine = slice(me * args.tokens // w, (me + 1) * args.tokens // w)
    scale = 1.0 / (args.tokens * args.dim)  # the mean over the whole batch
    curves = ([], [])
    start = time.perf_counter()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 100003 + step)
        x = torch.randn(args.tokens, args.dim, generator=g).to(dev)
        target = torch.randn(args.tokens, args.dim, generator=g).to(dev)
        for model, opt, xs, ts, curve in ((reference, opts[0], x, target, curves[0]),
                                          (parallel, opts[1], x[mine], target[mine], curves[1])):
            opt.zero_grad(set_to_none=True)
            loss = (model(xs) - ts).square().sum() * scale
            loss.backward()
            opt.step()
            curve.append(loss.detach())
    # The parallel loss of a step is the sum of the ranks' losses.
    got = weft.ops.all_reduce(torch.stack(curves[1]))
    want = torch.stack(curves[0])
    seconds = time.perf_counter() - start
    worst = ((got - want).abs() / want.abs()).max().item()
    if me == 0:
        for step in sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1}):
            print(f"step {step:4d}  loss {got[step].item():.6f}  single-process {want[step].item():.6f}")
        print(f"{w} ranks, {args.steps} steps in {seconds:.1f} s; largest relative difference of the loss curves "
              f"{worst:.2e} (limit {rtol:g})")
    weft.finalize()
    if worst > rtol:
        raise SystemExit(f"rank {me}: the loss curves differ by {worst:.2e} > {rtol:g}")


if __name__ == "__main__":
    main()
