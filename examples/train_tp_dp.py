"""Train a sequence-parallel MLP block, tensor-parallel inside groups and data-parallel across them, and check its
loss curve against one process.

    weft run -n 4 examples/train_tp_dp.py                  # TP=2 x DP=2; cpu backend: small sizes, ~a minute
    weft run -n 8 examples/train_tp_dp.py --tp 4 --dim 1024 --hidden 4096 --tokens 4096 --steps 200   # GPUs

The world's ranks form a grid: tensor-parallel groups of --tp consecutive ranks (weft.new_subgroups), one per
data-parallel replica, and data-parallel groups of the ranks with the same place in their replica
(weft.new_group over every --tp-th rank). On 4 ranks with --tp 2:

    TP groups (one replica each): [0, 1] [2, 3]        DP groups (one TP shard each): [0, 2] [1, 3]

Each replica trains the block of examples/train_tp_mlp.py on its own batch: ColumnParallelLinear (ag_gemm) and
RowParallelLinear (gemm_rs) over its TP group, each TP rank holding a block of the replica's tokens. After the
backward, each rank sums its shard's gradients over its DP group with weft.ops.all_reduce(group=dp): the replicas
step as one model trained on every replica's batch. Each rank's loss is the sum of its squared errors over the
global batch's size, so all ranks' losses add up to the single-process model's mean squared error on the global
batch, which every rank also trains and compares: the script fails if the curves differ by more than --rtol.
"""
import argparse
import time

import torch
from torch import nn

import weft
from weft.layers import ColumnParallelLinear, RowParallelLinear


def grid(tp: int):
    """This rank's tensor-parallel group (consecutive ranks) and data-parallel group (every tp-th rank)."""
    world = weft.world_size()
    tp_group = weft.new_subgroups(tp)
    dp_group = None
    for first in range(tp):  # every rank takes part in making every group, as torch.distributed.new_group wants
        made = weft.new_group(range(first, world, tp))
        dp_group = dp_group or made
    return tp_group, dp_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group (the rest is data-parallel)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="tokens per step of each data-parallel replica")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=None,
                   help="largest relative difference of the loss curves (default 1e-4; 5e-3 on GPUs, where weft's "
                        "fp32 GEMMs multiply in tf32)")
    args = p.parse_args()

    weft.init()
    world, me, dev = weft.world_size(), weft.rank(), weft.device()
    rtol = args.rtol if args.rtol is not None else (5e-3 if dev.type == "cuda" else 1e-4)
    if world % args.tp or args.tokens % args.tp or args.hidden % args.tp:
        raise SystemExit(f"--tp ({args.tp}) must divide the world ({world}), --tokens and --hidden")
    tp_group, dp_group = grid(args.tp)
    replicas = world // args.tp
    replica = me // args.tp  # = this rank's rank in its DP group
    assert dp_group.rank == replica and tp_group.rank == me % args.tp

    torch.manual_seed(args.seed)
    reference = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.SiLU(), nn.Linear(args.hidden, args.dim)).to(dev)
    parallel = nn.Sequential(ColumnParallelLinear.from_linear(reference[0], group=tp_group), nn.SiLU(),
                             RowParallelLinear.from_linear(reference[2], group=tp_group))
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9) for m in (reference, parallel)]
    total = replicas * args.tokens
    shard = args.tokens // args.tp
    first = replica * args.tokens + tp_group.rank * shard
    mine = slice(first, first + shard)  # this rank's tokens of the global batch
    scale = 1.0 / (total * args.dim)  # the mean over the global batch
    curves = ([], [])
    start = time.perf_counter()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 100003 + step)
        x = torch.randn(total, args.dim, generator=g).to(dev)
        target = torch.randn(total, args.dim, generator=g).to(dev)
        for model, opt, xs, ts, curve in ((reference, opts[0], x, target, curves[0]),
                                          (parallel, opts[1], x[mine], target[mine], curves[1])):
            opt.zero_grad(set_to_none=True)
            loss = (model(xs) - ts).square().sum() * scale
            loss.backward()
            if model is parallel:  # data parallelism: every replica's gradient, summed over the DP group
                for param in model.parameters():
                    weft.ops.all_reduce(param.grad, out=param.grad, group=dp_group)
            opt.step()
            curve.append(loss.detach())
    # The parallel loss of a step is the sum of every rank's (over the world: both axes).
    got = weft.ops.all_reduce(torch.stack(curves[1]))
    want = torch.stack(curves[0])
    seconds = time.perf_counter() - start
    worst = ((got - want).abs() / want.abs()).max().item()
    if me == 0:
        for step in sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1}):
            print(f"step {step:4d}  loss {got[step].item():.6f}  single-process {want[step].item():.6f}")
        print(f"TP={args.tp} x DP={replicas} on {world} ranks, {args.steps} steps in {seconds:.1f} s; largest relative "
              f"difference of the loss curves {worst:.2e} (limit {rtol:g})")
    weft.finalize()
    if worst > rtol:
        raise SystemExit(f"rank {me}: the loss curves differ by {worst:.2e} > {rtol:g}")


if __name__ == "__main__":
    main()
