"""Per-rank entry of `weft bench`: `python -m weft.bench [-n N] SUITE [options]` under `weft run` (the `weft bench`
command parses the same arguments first, in the launching process, so that help and errors print once)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

SUITES = {"allgather": "weft.bench.allgather", "matmul": "weft.bench.matmul", "gemm": "weft.bench.gemm",
          "allreduce": "weft.bench.allreduce", "reducescatter": "weft.bench.reducescatter",
          "overhead": "weft.bench.overhead", "attention": "weft.bench.attention",
          "ulysses": "weft.bench.ulysses", "tpmlp": "weft.bench.tpmlp", "moe": "weft.bench.moe",
          "e2e": "weft.bench.e2e", "disagg": "weft.bench.disagg", "p2p": "weft.bench.p2p",
          "nodes": "weft.bench.nodes", "groups": "weft.bench.groups"}
# The symmetric heap per rank on GPUs unless WEFT_HEAP_SIZE is set: op workspaces are cached per size and
# never freed, so a sweep to 512 MiB needs ~1 GiB of them per op (weft's default heap is 2 GiB).
BENCH_HEAP_SIZE = "24GiB"


RANKS_HELP = "ranks (default: every GPU, or 4 cpu ranks)"


def suite_parser(name: str) -> argparse.ArgumentParser:
    """Every option of `weft bench SUITE`: -n, --out and the suite's own (what `weft bench SUITE -h` prints)."""
    from weft.runtime import settings

    suite = importlib.import_module(SUITES[name])
    summary = " ".join((suite.__doc__ or "").strip().split("\n\n")[0].split())  # the docstring's first paragraph
    p = argparse.ArgumentParser(prog=f"weft bench {name}", description=summary,
                                epilog=f"On GPUs the weft heap is {getattr(suite, 'HEAP_SIZE', BENCH_HEAP_SIZE)} "
                                "per rank unless WEFT_HEAP_SIZE is set.")
    p.add_argument("-n", type=int, default=None, help=RANKS_HELP)
    p.add_argument("--out", default=settings.get("WEFT_BENCH_OUT", "bench_results"),
                   help="output folder (default: $WEFT_BENCH_OUT or bench_results)")
    suite.add_arguments(p)
    return p


def parse(argv: list[str] | None = None) -> tuple[str, argparse.Namespace, list[str]]:
    """`[-n N] SUITE [options]` -> (suite, its options parsed, the options as given but -n). `-h` and a bad option
    exit here with the suite's usage: `weft bench` parses in the launching process first, so that it prints once."""
    top = argparse.ArgumentParser(prog="weft bench", usage="weft bench [-n N] SUITE [options]",
                                  description="Time weft's ops against their baselines (NCCL, cuBLAS, torch's "
                                  "symmetric-memory ops) on every rank; rank 0 writes JSON, a markdown table and "
                                  "a PNG plot.", epilog="`weft bench SUITE -h` lists the suite's options.")
    top.add_argument("-n", type=int, default=None, help=RANKS_HELP)
    top.add_argument("suite", metavar="SUITE", choices=sorted(SUITES), help=", ".join(sorted(SUITES)))
    top.add_argument("options", nargs=argparse.REMAINDER, help="the suite's options")
    first = top.parse_args(argv)
    args = suite_parser(first.suite).parse_args(first.options)
    if args.n is None:  # -n before the suite or after it
        args.n = first.n
    return first.suite, args, _without_ranks(first.options)


def _without_ranks(options: list[str]) -> list[str]:
    """The options less -n N (-nN), which the launcher consumed."""
    kept, skip = [], False
    for option in options:
        if skip:
            skip = False
        elif option == "-n":
            skip = True
        elif not (option.startswith("-n") and not option.startswith("--")):
            kept.append(option)
    return kept


def main(argv: list[str] | None = None) -> int:
    name, args, rest = parse(argv)
    suite = importlib.import_module(SUITES[name])

    import torch

    import weft
    from weft.bench.report import ALGBW, write

    if weft.BACKEND == "cuda":  # a suite that needs the memory for itself (model weights) asks for less heap
        os.environ.setdefault("WEFT_HEAP_SIZE", getattr(suite, "HEAP_SIZE", BENCH_HEAP_SIZE))
        if hasattr(suite, "WORKSPACE_BYTES"):  # a suite whose messages need larger op workspaces
            os.environ.setdefault("WEFT_WORKSPACE_BYTES", suite.WORKSPACE_BYTES)
    weft.init()
    rows = suite.run(args)
    w = weft.world()  # the suite's last world: `weft bench nodes` starts one per simulated-node layout
    # What the whole run needed of the symmetric heap (op workspaces and the suite's weft.empty tensors).
    heap_used = [None] * w.world_size
    torch.distributed.all_gather_object(heap_used, w.heap.used, group=w.group)
    if w.rank == 0:
        dev = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu (interpreter)"
        title = f"{name}: {w.world_size} × {dev}"
        # The row every weft row is compared with: a suite whose baseline's name depends on the run says it itself.
        baseline = (suite.baseline_impl(args) if hasattr(suite, "baseline_impl") else None) or \
            getattr(suite, "BASELINE", None) or torch.distributed.get_backend(w.group)
        meta = {"command": " ".join(["weft bench -n", str(w.world_size), name, *rest]),
                "torch": torch.__version__,
                "heap_used_bytes": heap_used, "heap_bytes": w.heap.size}  # per rank
        meta.update(suite.meta(args) if hasattr(suite, "meta") else {})  # what the suite's report says of itself
        table = write(rows, args.out, f"{name}_{w.world_size}", title, baseline,
                      rival=getattr(suite, "RIVAL", None), bandwidth=getattr(suite, "BANDWIDTH", ALGBW),
                      focus=getattr(suite, "FOCUS", None), meta=meta)
        print(f"\n## {title}\n\n{table}\n\nweft heap used per rank: "
              f"{', '.join(f'{b / (1 << 20):.2f} MiB' for b in heap_used)} (of {w.heap.size / (1 << 20):.0f} MiB)"
              f"\nwritten to {args.out}/", flush=True)
    weft.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
