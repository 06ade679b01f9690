"""Per-rank entry of `weft bench`: `python -m weft.bench SUITE [options]` under `weft run`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

SUITES = {"allgather": "weft.bench.allgather", "matmul": "weft.bench.matmul", "gemm": "weft.bench.gemm",
          "allreduce": "weft.bench.allreduce", "reducescatter": "weft.bench.reducescatter", "attention": "weft.bench.attention"}
# The symmetric heap per rank on GPUs unless WEFT_HEAP_SIZE is set: op workspaces are cached per size and
# never freed, so a sweep to 512 MiB needs ~1 GiB of them per op (weft's default heap is 2 GiB).
BENCH_HEAP_SIZE = "24GiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="weft bench", epilog=f"On GPUs the weft heap is {BENCH_HEAP_SIZE} per rank "
                                "unless WEFT_HEAP_SIZE is set.")
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--out", default=os.environ.get("WEFT_BENCH_OUT", "bench_results"), help="output folder")
    known, rest = p.parse_known_args(argv)
    suite = importlib.import_module(SUITES[known.suite])
    sp = argparse.ArgumentParser(prog=f"weft bench {known.suite}")
    suite.add_arguments(sp)
    args = sp.parse_args(rest)

    import torch

    import weft
    from weft.bench.report import ALGBW, write

    if weft.BACKEND == "cuda":
        os.environ.setdefault("WEFT_HEAP_SIZE", BENCH_HEAP_SIZE)
    weft.init()
    w = weft.world()
    rows = suite.run(args)
    if w.rank == 0:
        dev = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu (interpreter)"
        title = f"{known.suite}: {w.world_size} × {dev}"
        baseline = getattr(suite, "BASELINE", None) or torch.distributed.get_backend(w.group)
        table = write(rows, known.out, f"{known.suite}_{w.world_size}", title, baseline,
                      rival=getattr(suite, "RIVAL", None), bandwidth=getattr(suite, "BANDWIDTH", ALGBW))
        print(f"\n## {title}\n\n{table}\n\nwritten to {known.out}/", flush=True)
    weft.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
