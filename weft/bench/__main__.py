"""Per-rank entry of `weft bench`: `python -m weft.bench SUITE [options]` under `weft run`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

SUITES = {"allgather": "weft.bench.allgather", "matmul": "weft.bench.matmul", "gemm": "weft.bench.gemm",
          "allreduce": "weft.bench.allreduce", "reducescatter": "weft.bench.reducescatter",
          "overhead": "weft.bench.overhead", "attention": "weft.bench.attention",
          "ulysses": "weft.bench.ulysses", "tpmlp": "weft.bench.tpmlp", "moe": "weft.bench.moe",
          "e2e": "weft.bench.e2e", "disagg": "weft.bench.disagg"}
# The symmetric heap per rank on GPUs unless WEFT_HEAP_SIZE is set: op workspaces are cached per size and
# never freed, so a sweep to 512 MiB needs ~1 GiB of them per op (weft's default heap is 2 GiB).
BENCH_HEAP_SIZE = "24GiB"


def main(argv=None) -> int:
    from weft.runtime import settings

    p = argparse.ArgumentParser(prog="weft bench", epilog=f"On GPUs the weft heap is {BENCH_HEAP_SIZE} per rank "
                                "unless WEFT_HEAP_SIZE is set.")
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--out", default=settings.get("WEFT_BENCH_OUT", "bench_results"), help="output folder")
    known, rest = p.parse_known_args(argv)
    suite = importlib.import_module(SUITES[known.suite])
    sp = argparse.ArgumentParser(prog=f"weft bench {known.suite}")
    suite.add_arguments(sp)
    args = sp.parse_args(rest)
    args.out_dir = known.out  # where a suite writes files of its own (disagg's timelines)

    import torch

    import weft
    from weft.bench.report import ALGBW, write

    if weft.BACKEND == "cuda":  # a suite that needs the memory for itself (model weights) asks for less heap
        os.environ.setdefault("WEFT_HEAP_SIZE", getattr(suite, "HEAP_SIZE", BENCH_HEAP_SIZE))
        if hasattr(suite, "WORKSPACE_BYTES"):  # a suite whose messages need larger op workspaces
            os.environ.setdefault("WEFT_WORKSPACE_BYTES", suite.WORKSPACE_BYTES)
    weft.init()
    w = weft.world()
    rows = suite.run(args)
    # What the whole run needed of the symmetric heap (op workspaces and the suite's weft.empty tensors).
    heap_used = [None] * w.world_size
    torch.distributed.all_gather_object(heap_used, w.heap.used, group=w.group)
    if w.rank == 0:
        dev = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu (interpreter)"
        title = f"{known.suite}: {w.world_size} × {dev}"
        baseline = getattr(suite, "BASELINE", None) or torch.distributed.get_backend(w.group)
        meta = {"command": " ".join(["weft bench -n", str(w.world_size), known.suite, *rest]),
                "torch": torch.__version__,
                "heap_used_bytes": heap_used, "heap_bytes": w.heap.size}  # per rank
        table = write(rows, known.out, f"{known.suite}_{w.world_size}", title, baseline,
                      rival=getattr(suite, "RIVAL", None), bandwidth=getattr(suite, "BANDWIDTH", ALGBW),
                      focus=getattr(suite, "FOCUS", None), meta=meta)
        print(f"\n## {title}\n\n{table}\n\nweft heap used per rank: "
              f"{', '.join(f'{b / (1 << 20):.2f} MiB' for b in heap_used)} (of {w.heap.size / (1 << 20):.0f} MiB)"
              f"\nwritten to {known.out}/", flush=True)
    weft.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
