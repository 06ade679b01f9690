"""The `weft` command: run, info, tune, demo, bench."""
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
    from .runtime.launcher import DEFAULT_MASTER_PORT, Nodes, run

    target = ["-m", args.module, *args.args] if args.module else args.args
    nodes = None
    if args.nnodes is not None:
        port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
        nodes = Nodes(args.nnodes, args.node_rank, args.master_addr or "", port)
    elif args.node_rank or args.master_addr or args.master_port is not None:
        raise SystemExit("weft run: --node-rank, --master-addr and --master-port go with --nnodes")
    return run(args.n, target, local_world_size=args.local_world_size, nodes=nodes)


def cmd_info(args) -> int:
    import torch
    import triton

    import weft
    from weft import tuning

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
        print(f"tuning      {tuning.gpu_model(w.device)} at {w.world_size} ranks; local tables in {tuning.local_dir()}")
        for family, table in tuning.sources(w.device, w.world_size).items():
            print(f"  {family:<13} {table.describe()}")
    weft.finalize()
    return 0


def cmd_tune(args) -> int:
    from .runtime.launcher import run

    options = ["--ops", args.ops] if args.ops else []
    options += ["--quick"] if args.quick else []
    options += ["--samples", str(args.samples)] if args.samples else []
    return run(args.n or _default_ranks(), ["-m", "weft.tuning.suites", *options])


def cmd_demo(argv: list[str]) -> int:
    import importlib.util
    import os
    import tempfile

    from .demo import parse
    from .runtime.backend import BACKEND
    from .runtime.launcher import run

    options = parse(argv)  # -h, a bad option or one the backend cannot take exits here, once
    ranks = options.n or _default_ranks()
    target = ["-m", "weft.demo", *argv]
    if BACKEND == "cuda" or importlib.util.find_spec("transformers") is not None:
        return run(ranks, target)
    # No transformers to check the cpu ranks against: the same model on one rank is the reference.
    with tempfile.TemporaryDirectory() as tmp:
        reference = os.path.join(tmp, "reference.pt")
        return run(1, [*target, "--save", reference]) or run(ranks, [*target, "--reference", reference])


def cmd_bench(argv: list[str]) -> int:
    import importlib.util

    from .bench.__main__ import parse
    from .runtime.launcher import run

    _, options, _ = parse(argv)  # -h or a bad option exits here, once, before any rank starts
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("weft bench: its plots need matplotlib: pip install 'triton-weft[bench]'")
    return run(options.n or _default_ranks(), ["-m", "weft.bench", *argv])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weft", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="start N ranks running a script (torchrun on GPUs, processes on cpu)")
    r.add_argument("-n", type=int, required=True, help="number of ranks")
    r.add_argument("-m", dest="module", help="run a module instead of a script")
    r.add_argument("--local-world-size", type=int, default=None,
                   help="ranks per simulated node: the -n ranks split into nodes of this many (docs/nodes.md)")
    r.add_argument("--nnodes", type=int, default=None, help="GPUs: machines in the job (torchrun's), -n ranks each")
    r.add_argument("--node-rank", type=int, default=0, help="GPUs, with --nnodes: this machine's node rank")
    r.add_argument("--master-addr", default=None, help="GPUs, with --nnodes: node 0's address")
    r.add_argument("--master-port", type=int, default=None, help="GPUs, with --nnodes: node 0's port (29500)")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    i = sub.add_parser("info", help="backend, world size, devices, versions, heap size, the tuning table of each "
                       "op family")
    i.set_defaults(fn=cmd_info)
    t = sub.add_parser("tune", help="re-measure the tuning tables' values on this machine into a local table "
                       "(weft/tuning/suites.py), which weft then prefers")
    t.add_argument("-n", type=int, default=None, help="ranks (default: all GPUs, or 4 cpu ranks)")
    t.add_argument("--ops", default=None, help="suites, comma-separated (default: all): all_gather,all_reduce,gemm")
    t.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    t.add_argument("--samples", type=int, default=None, help="samples per timing")
    t.set_defaults(fn=cmd_tune)
    # demo and bench parse their own options (`weft demo -h`, `weft bench SUITE -h` list them all), below: once
    # here, before the ranks start, and again on each rank. Their entries here are for `weft -h`.
    sub.add_parser("demo", help="the main demo: a Qwen3 decoder on all GPUs (weft against NCCL), else on 4 cpu "
                   "ranks checked against transformers (`weft demo -h`: its options)")
    sub.add_parser("bench", help="benchmark suites against NCCL/torch baselines (`weft bench -h`: the suites; "
                   "`weft bench SUITE -h`: a suite's options)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OWN_PARSERS:
        return OWN_PARSERS[argv[0]](argv[1:])
    args = p.parse_args(argv)
    return args.fn(args)


OWN_PARSERS = {"demo": cmd_demo, "bench": cmd_bench}


if __name__ == "__main__":
    sys.exit(main())
