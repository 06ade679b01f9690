"""The sweeps behind the tuning tables, run on this machine by `weft tune` (one process per rank):

    python3 -m weft tune -n 2                                   # every suite; writes the local table
    python3 -m weft tune -n 2 --ops all_gather --quick          # fewer sizes and samples

Each suite times weft's candidates against each other (and NCCL for the crossovers) with weft.bench.timing
(CUDA-graph replay on GPUs, round-robin samples, the slowest rank's median), checks every candidate's result
against NCCL's or torch's, and returns the values it measured. Rank 0 then writes them into the local table of
this GPU model and world size (weft.tuning.local_dir()), with the command, date and commit; a family's keys
that no suite measures are copied from the table the family read before, with their provenance. On the cpu
backend the sweeps are tiny and their timings meaningless: they exercise the mechanism.

Suites: all_gather (the launch rule: shard bytes and programs of push and pull; the NCCL crossover by output
kind), all_reduce (one-shot's limit; the NCCL crossovers of all_reduce by output kind and of reduce_scatter),
gemm (the config of each per-rank TP shape, against its shape class's).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.distributed as dist

import weft
from weft import tuning
from weft.bench.timing import time_calls
from weft.kernels.common import nccl_reduce_scatter

SUITES = ("all_gather", "all_reduce", "gemm")

# all_gather's candidate launch rules: (push bytes per program, most push programs), pull bytes per program.
PUSH_RULES = [(256 << 10, 16), (64 << 10, 32), (16 << 10, 64)]
PULL_RULES = [64 << 10, 16 << 10, 8 << 10]


class Sweep:
    """What a suite needs: the world, the sizes and timing effort of this run, and a log printed by rank 0."""

    def __init__(self, quick: bool, samples: int | None):
        self.world = weft.world()
        self.gpu = self.world.device.type == "cuda"
        self.quick = quick
        self.samples = samples or (1 if not self.gpu else 5 if quick else 15)
        self.rows = []

    def sizes(self, gpu_range: tuple[int, int], quick_top: int) -> list[int]:
        """Powers of two of bytes: gpu_range on GPUs (up to quick_top with --quick), 4 KiB on cpu."""
        lo, hi = gpu_range if self.gpu else (4 << 10, 4 << 10)
        if self.gpu and self.quick:
            hi = min(hi, quick_top)
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= 2
        return out

    def time(self, fns: dict) -> dict:
        """{name: median ms}: graph replay on GPUs; one call a sample and one warm-up call on cpu."""
        if self.gpu:
            return time_calls(fns, calls=10, samples=self.samples, graph=True)
        return time_calls(fns, calls=1, samples=self.samples, warmup=1)

    def symmetric(self, nbytes: int) -> torch.Tensor:
        """A bf16 buffer of `nbytes` in the symmetric heap, whose fronts serve every size of a sweep (the heap
        never frees: one buffer per sweep, not one per size)."""
        return weft.empty((nbytes // 2,), torch.bfloat16)

    def log(self, suite: str, **row):
        row = {"suite": suite, **row}
        self.rows.append(row)
        if self.world.rank == 0:
            print(json.dumps(row), flush=True)


def _check(ok: bool, what: str):
    if not ok:
        raise RuntimeError(f"weft tune: {what} gave a result different from the reference: nothing written")


def last_win(sizes: list[int], ours: list[float], theirs: list[float]) -> int:
    """The largest size up to which `ours` took at most `theirs` at every size measured (0: not even the first)."""
    best = 0
    for size, a, b in zip(sizes, ours, theirs):
        if a > b:
            break
        best = size
    return best


def crossover(sizes: list[int], weft_ms: list[float], nccl_ms: list[float]) -> int | None:
    """The smallest size from which NCCL was faster at every larger size measured, or None (never)."""
    found = None
    for size, ours, theirs in zip(reversed(sizes), reversed(weft_ms), reversed(nccl_ms)):
        if theirs >= ours:
            break
        found = size
    return found


def _geomean_ratio(times: dict[str, list[float]]) -> dict[str, float]:
    """Each candidate's geometric mean over sizes of its time over the best candidate's at that size."""
    best = [min(column) for column in zip(*times.values())]
    return {name: statistics.geometric_mean([t / b for t, b in zip(ts, best)]) for name, ts in times.items()}


def _fresh_plans(w):
    w.plans.clear()


def all_gather_suite(s: Sweep) -> dict:
    """The launch rule (PUSH_RULES, PULL_RULES over 64 KiB-8 MiB shards) and the NCCL crossover by output kind."""
    w = s.world
    group = w.group
    push_times = {rule: [] for rule in PUSH_RULES}
    pull_times = {rule: [] for rule in PULL_RULES}
    sizes = s.sizes((64 << 10, 8 << 20), 1 << 20)
    for size in sizes:
        x = torch.randn(size // 2, device=w.device).to(torch.bfloat16)
        out = torch.empty(w.world_size * x.numel(), dtype=x.dtype, device=w.device)
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, x, group=group)
        fns = {"nccl": lambda: dist.all_gather_into_tensor(ref, x, group=group)}
        for (push_bytes, push_max), pull_bytes in zip(PUSH_RULES, PULL_RULES):
            rule = {"all_gather.push_program_bytes": push_bytes, "all_gather.push_max_programs": push_max,
                    "all_gather.pull_program_bytes": pull_bytes}
            with tuning.overrides(rule):
                _fresh_plans(w)
                for method, key in (("push", (push_bytes, push_max)), ("pull", pull_bytes)):
                    out.fill_(float("nan"))
                    weft.ops.all_gather(x, out=out, method=method)
                    _check(torch.equal(out, ref), f"all_gather {method} {key}")
                    # The plan that call made (the newest) holds this rule's launch: time it directly.
                    fns[(method, key)] = lambda found=list(w.plans.values())[-1]: found.run(x, out)
        _fresh_plans(w)
        ms = s.time(fns)
        for rule in PUSH_RULES:
            push_times[rule].append(ms[("push", rule)])
        for rule in PULL_RULES:
            pull_times[rule].append(ms[("pull", rule)])
        s.log("all_gather", shard_bytes=size, **{str(k): round(v * 1e3, 1) for k, v in ms.items()})
    push = _geomean_ratio(push_times)
    pull = _geomean_ratio(pull_times)
    push_bytes, push_max = min(push, key=push.get)
    found = {"all_gather.push_program_bytes": push_bytes, "all_gather.push_max_programs": push_max,
             "all_gather.pull_program_bytes": min(pull, key=pull.get)}

    # The crossover: push with the rule just chosen against NCCL, per output kind.
    sizes = s.sizes((1 << 20, 128 << 20), 16 << 20)
    symmetric_out = s.symmetric(w.world_size * sizes[-1])
    with tuning.overrides(found):
        for kind in ("plain", "none", "symmetric"):
            weft_ms, nccl_ms = [], []
            for size in sizes:
                _fresh_plans(w)
                x = torch.randn(size // 2, device=w.device).to(torch.bfloat16)
                n = w.world_size * x.numel()
                out = None if kind == "none" else symmetric_out[:n] if kind == "symmetric" else \
                    torch.empty(n, dtype=x.dtype, device=w.device)
                ref = torch.empty(n, dtype=x.dtype, device=w.device)
                dist.all_gather_into_tensor(ref, x, group=group)
                _check(torch.equal(weft.ops.all_gather(x, out=out, method="push"), ref), f"all_gather into {kind}")

                def theirs(out=out):
                    dst = torch.empty_like(ref) if out is None else out
                    dist.all_gather_into_tensor(dst, x, group=group)
                ms = s.time({"weft": lambda out=out: weft.ops.all_gather(x, out=out, method="push"), "nccl": theirs})
                weft_ms.append(ms["weft"])
                nccl_ms.append(ms["nccl"])
                s.log("all_gather", output=kind, shard_bytes=size, weft_us=round(ms["weft"] * 1e3, 1),
                      nccl_us=round(ms["nccl"] * 1e3, 1))
            found[f"all_gather.nccl_above.{kind}"] = crossover(sizes, weft_ms, nccl_ms)
    _fresh_plans(w)
    return found


def all_reduce_suite(s: Sweep) -> dict:
    """One-shot's limit (one-shot against two-shot, 8 KiB-16 MiB) and the NCCL crossovers (1-256 MiB)."""
    w = s.world
    group = w.group
    sizes = s.sizes((8 << 10, 16 << 20), 1 << 20)
    one, two = [], []
    for size in sizes:
        _fresh_plans(w)
        x = torch.randn(size // 2, device=w.device).to(torch.bfloat16)
        ref = x.float().clone()
        dist.all_reduce(ref, group=group)
        out = torch.empty_like(x)
        for method in ("one_shot", "two_shot"):
            torch.testing.assert_close(weft.ops.all_reduce(x, out=out, method=method).float(), ref, rtol=2e-2,
                                       atol=2e-2 * w.world_size)
        ms = s.time({m: (lambda m=m: weft.ops.all_reduce(x, out=out, method=m)) for m in ("one_shot", "two_shot")})
        one.append(ms["one_shot"])
        two.append(ms["two_shot"])
        s.log("all_reduce", bytes=size, one_shot_us=round(ms["one_shot"] * 1e3, 1),
              two_shot_us=round(ms["two_shot"] * 1e3, 1))
    found = {"all_reduce.one_shot_max_bytes": last_win(sizes, one, two)}

    sizes = s.sizes((1 << 20, 256 << 20), 16 << 20)
    cases = [("all_reduce", "plain"), ("all_reduce", "in_place"), ("all_reduce", "symmetric"),
             ("reduce_scatter", "plain"), ("reduce_scatter", "symmetric")]
    symmetric_out = s.symmetric(sizes[-1])
    with tuning.overrides(found):
        for op, kind in cases:
            weft_ms, nccl_ms = [], []
            for size in sizes:
                _fresh_plans(w)
                ms = s.time(_collective_pair(w, op, kind, size, symmetric_out))
                weft_ms.append(ms["weft"])
                nccl_ms.append(ms["nccl"])
                s.log(op, output=kind, bytes=size, weft_us=round(ms["weft"] * 1e3, 1),
                      nccl_us=round(ms["nccl"] * 1e3, 1))
            key = f"all_reduce.nccl_above.{kind}" if op == "all_reduce" else \
                f"all_reduce.reduce_scatter_nccl_above.{kind}"
            found[key] = crossover(sizes, weft_ms, nccl_ms)
    _fresh_plans(w)
    return found


def _collective_pair(w, op: str, kind: str, size: int, symmetric_out: torch.Tensor) -> dict:
    """{"weft": ..., "nccl": ...}: weft's method below the crossover and NCCL's call, each into the same kind
    of output as auto would see (plain: NCCL's result copied into it, as auto's NCCL path does); a symmetric
    output is the front of `symmetric_out`."""
    group = w.group
    n = size // 2
    x = torch.randn(n, device=w.device).to(torch.bfloat16)
    symmetric = kind == "symmetric"
    if op == "all_reduce":
        ref = x.float().clone()
        dist.all_reduce(ref, group=group)
        method = "one_shot" if size <= tuning.value("all_reduce.one_shot_max_bytes", w.device, w.world_size) \
            else "two_shot"
        # plain: x into another tensor; in_place: into x itself; symmetric: in place in symmetric memory.
        target = symmetric_out[:n] if symmetric else torch.empty_like(x)
        target.copy_(x)
        source = x if kind == "plain" else target
        got = weft.ops.all_reduce(source, out=target, method=method)
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * w.world_size)

        # Then timed over and over: a sum in place grows, but its time does not depend on the values.
        def ours():
            weft.ops.all_reduce(source, out=target, method=method)

        def theirs():
            if kind == "plain":  # what auto's NCCL path costs there: x copied into out, reduced in place
                target.copy_(x)
            dist.all_reduce(target, group=group)
        return {"weft": ours, "nccl": theirs}
    rows = n // w.world_size * w.world_size
    x = x[:rows]
    ref = x.float().clone()
    dist.all_reduce(ref, group=group)
    ref = ref.view(w.world_size, -1)[w.rank]
    m = rows // w.world_size
    out = symmetric_out[:m] if symmetric else torch.empty(m, dtype=x.dtype, device=w.device)
    got = weft.ops.reduce_scatter(x, out=out, method="two_shot")
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * w.world_size)
    return {"weft": lambda: weft.ops.reduce_scatter(x, out=out, method="two_shot"),
            "nccl": lambda: nccl_reduce_scatter(out, x, group)}


def gemm_suite(s: Sweep) -> dict:
    """For each per-rank TP shape (cut for 2, 4 and 8 ranks; with --quick, three of this world's), the fastest of
    gemm.configs; the shapes whose fastest beats their class's config by 2 % or more go into gemm.tuned."""
    from weft.kernels import gemm
    from weft.bench.matmul import per_rank_shapes

    w = s.world
    configs = gemm.gpu_configs(w.device)
    if s.gpu:
        cases = [shape for ranks in ((w.world_size,) if s.quick else (2, 4, 8))
                 for _, shape in per_rank_shapes(ranks)]
        cases = list(dict.fromkeys(cases))[:3 if s.quick else None]
    else:
        cases = [(32, 32, 32)]
    tuned = {(m, n, k): name for m, n, k, name in tuning.value("gemm.tuned", w.device)}
    for m, n, k in cases:
        gen = torch.Generator(device=w.device).manual_seed(m * 7 + n * 3 + k)
        a = torch.randn(m, k, device=w.device, generator=gen).to(torch.bfloat16)
        b = torch.randn(k, n, device=w.device, generator=gen).to(torch.bfloat16)
        ref = (a.float() @ b.float())
        for name, c in configs.items():
            torch.testing.assert_close(gemm.matmul(a, b, config=c).float(), ref, rtol=2e-2, atol=k ** 0.5 * 2e-2)
        ms = s.time({name: (lambda c=c: gemm.matmul(a, b, config=c)) for name, c in configs.items()})
        with tuning.overrides({"gemm.tuned": []}):
            default = gemm.shape_class(m, n, k, w.device)
        best = min(ms, key=ms.get)
        if best != default and ms[best] <= 0.98 * ms[default]:
            tuned[(m, n, k)] = best
        else:
            tuned.pop((m, n, k), None)
        chosen = tuned.get((m, n, k), default)
        s.log("gemm", shape=[m, n, k], **{name: round(t * 1e3, 1) for name, t in ms.items()}, chosen=chosen)
    return {"gemm.tuned": [[m, n, k, name] for (m, n, k), name in sorted(tuned.items())]}


def _commit() -> str:
    """The commit of the weft tree that ran (WEFT_COMMIT, else git's), or the version where neither is known."""
    if os.environ.get("WEFT_COMMIT"):
        return os.environ["WEFT_COMMIT"]
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                               cwd=os.path.dirname(os.path.abspath(__file__)))
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip()
    except OSError:
        pass
    return f"weft {weft.__version__}"


def write_table(found: dict, command: str) -> str:
    """Write the values measured into the local table of this GPU model and world size, the rest of each family
    measured copied from the table it read before; returns the file's path."""
    w = weft.world()
    gpu = tuning.gpu_model(w.device)
    path = tuning.local_dir() / tuning.file_name(gpu, w.world_size)
    entries = tuning.entries(tuning.load(path, local=True)) if path.exists() else {}
    hardware = f"{w.world_size}x {torch.cuda.get_device_name(w.device) if w.device.type == 'cuda' else 'cpu'}"
    measured = dict(command=command, date=datetime.date.today().isoformat(), commit=_commit(), hardware=hardware)
    for family in dict.fromkeys(key.split(".")[0] for key in found):
        before = tuning.entries(tuning.table_for(family, gpu, w.world_size))
        for key in tuning.KEYS:
            if key.startswith(family + "."):
                entries[key] = dict(value=found[key], measured=measured, note="weft tune") if key in found \
                    else before[key]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(dict(gpu=gpu, world_size=w.world_size, values=entries), indent=1) + "\n")
    tuning.load(partial, local=True)  # what was written reads back
    partial.replace(path)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="weft tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(SUITES), help=f"suites to run, comma-separated: {', '.join(SUITES)}")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    ap.add_argument("--samples", type=int, default=None,
                    help="samples per timing (default 15 on GPUs, 5 with --quick; 1 on cpu)")
    args = ap.parse_args(argv)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in SUITES]
    if unknown or not ops:
        ap.error(f"--ops: unknown suite(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SUITES)}")
    tuning.tables()  # a malformed table already there fails now, not after the sweeps
    gpu = torch.cuda.is_available()
    weft.init(heap_size=(4 << 30) if gpu else None)
    s = Sweep(args.quick, args.samples)
    found = {}
    for op in ops:
        found.update(globals()[f"{op}_suite"](s))
    if s.world.rank == 0:
        command = f"python3 -m weft tune -n {s.world.world_size} --ops {','.join(ops)}" + (" --quick" if args.quick
                                                                                            else "")
        path = write_table(found, command)
        print(f"wrote {path}:", flush=True)
        for key, v in found.items():
            print(f"  {key} = {v}", flush=True)
    weft.barrier()
    weft.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
