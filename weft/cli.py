"""The `weft` command: run, info, demo, bench."""
from __future__ import annotations

import argparse
import sys


def _default_ranks() -> int:
    from .runtime.backend import BACKEND

    if BACKEND == "cuda":
        import torch

        return torch.cuda.device_count()
    return 4


def cmd_run(args) -> int:
    from .runtime.launcher import run

    target = ["-m", args.module, *args.args] if args.module else args.args
    return run(args.n, target)


def cmd_info(args) -> int:
    import torch
    import triton

    import weft

    weft.init()
    w = weft.world()
    if w.device.type == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        names = ["cpu (Triton interpreter)"]
    if w.rank == 0:
        print(f"weft {weft.__version__}")
        print(f"backend     {w.backend}")
        print(f"world size  {w.world_size}")
        print(f"devices     {', '.join(names)}")
        print(f"torch       {torch.__version__}")
        print(f"triton      {triton.__version__}")
        print(f"heap        {w.heap.size / (1 << 20):.0f} MiB per rank ({w.heap.used} bytes used)")
    weft.finalize()
    return 0


def cmd_demo(args) -> int:
    from .runtime.launcher import run

    return run(args.n or _default_ranks(), ["-m", "weft.demo"])


def cmd_bench(args) -> int:
    from .runtime.launcher import run

    return run(args.n or _default_ranks(), ["-m", "weft.bench", *args.args])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="weft", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="start N ranks running a script (torchrun on GPUs, processes on cpu)")
    r.add_argument("-n", type=int, required=True, help="number of ranks")
    r.add_argument("-m", dest="module", help="run a module instead of a script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    i = sub.add_parser("info", help="backend, world size, devices, versions, heap size")
    i.set_defaults(fn=cmd_info)
    d = sub.add_parser("demo", help="the main demo: on all GPUs if present, else on 4 cpu ranks")
    d.add_argument("-n", type=int, default=None)
    d.set_defaults(fn=cmd_demo)
    b = sub.add_parser("bench", help="benchmark suites against NCCL/torch baselines (see `weft bench allgather -h`)")
    b.add_argument("-n", type=int, default=None, help="ranks (default: all GPUs, or 4 cpu ranks)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="SUITE and its options")
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
