"""Smoke test of the rail's exchange over NVSHMEM (WEFT_RAIL=nvshmem), to run before the GPU tests: a hang here
costs one layout's time limit, not a test suite's.

    python3 scripts/probe_rail_nvshmem.py [--layouts 2:1,4:1,4:2] [--calls 1000] [--timeout 150]

starts, for each layout N:L (N ranks as nodes of L: `weft run -n N --local-world-size L`, simulated nodes on this
machine's GPUs), this script's ranks in their own process group with WEFT_RAIL=nvshmem, NVSHMEM's single-host
settings (scripts/probe_nvshmem.py's; a value set in the environment is kept) and a 1 MiB workspace (so that
the larger messages go through the exchange in several passes); each layout is killed after --timeout seconds
(the ranks also dump their stacks and exit on their own a few seconds before). Each rank:
- checks that weft.init took the NVSHMEM route (torch's symmetric memory on NVSHMEM);
- runs one hierarchical all_gather, all_reduce and reduce_scatter (the exchange's all-to-all form) of a small
  size, of all_gather's one full pass and of a several-pass size, each against NCCL's (all_gather bit for bit);
- then --calls consecutive calls of each op on fixed inputs: every output bit for bit the first one, every 100th
  against NCCL; with µs per call (eager, host clock) beside NCCL's own collective.
Prints "reached:" lines as it goes (a hang shows where), one line per layout: ok / FAILED / HUNG.
On the cpu backend (WEFT_BACKEND=cpu, no GPU) the same checks run over the cpu rail (weft's kernel on the simulated
network, gloo as the reference), with --calls cut to 3: a check of the script itself.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import subprocess
import sys
import time

# NVSHMEM on one host through torch, as scripts/probe_nvshmem.py found it: no network transport, bootstrap over
# loopback (this script's folder is on sys.path, whether run directly or by torchrun).
from probe_nvshmem import ENV as NVSHMEM_ENV  # noqa: E402
RANK_ENV = {"WEFT_RAIL": "nvshmem", "WEFT_WORKSPACE_BYTES": "1MiB", "WEFT_HEAP_SIZE": "64MiB"}
CHECK_EVERY = 100
EXIT_MARGIN_S = 10  # the ranks dump their stacks and exit this long before the layout's limit


def _stage(rank, text):
    print(f"reached: rank {rank}: {text}", flush=True)


def _cases(world, device):
    """(name, weft call, NCCL reference, exact) for each op and size, on inputs drawn once."""
    import torch
    import torch.distributed as dist

    import weft

    size, rank = world.world_size, world.rank
    gen = torch.Generator(device).manual_seed(101 + rank)
    # The NVSHMEM exchange's slot: a third of the workspace over the rail's other members (one per other node);
    # messages of several slots go in passes.
    slot = world.workspace_bytes // 3 // (len(world.nodes) - 1)
    cases = []
    for n in (4099, slot // 4, 3 * slot + 17):  # floats: one pass, one full pass of all_gather, several passes
        x = torch.randn(n, generator=gen, device=device)
        xs = torch.randn(size * n, generator=gen, device=device)

        def gathered(x=x):
            out = torch.empty(size * x.numel(), device=device)
            dist.all_gather_into_tensor(out, x)
            return out

        def reduced(x=x):
            out = x.clone()
            dist.all_reduce(out)
            return out

        def scattered(xs=xs, n=n):
            out = torch.empty(n, device=device)
            dist.reduce_scatter_tensor(out, xs)
            return out

        cases += [(f"all_gather {n}", lambda x=x: weft.ops.all_gather(x, method="push"), gathered, True),
                  (f"all_reduce {n}", lambda x=x: weft.ops.all_reduce(x, method="two_shot"), reduced, False),
                  (f"reduce_scatter {n}", lambda xs=xs: weft.ops.reduce_scatter(xs, method="two_shot"), scattered,
                   False)]
    return cases


def _per_call_us(fn, calls, sync):
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return round((time.perf_counter() - t0) / calls * 1e6, 1)


def rank_main(calls: int) -> None:
    import torch

    import weft

    w = weft.init()
    rank = w.rank
    device = w.device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    assert w.topology.spans_nodes, "the layout's nodes must be smaller than the world"
    if cuda:
        import torch.distributed._symmetric_memory as symm_mem

        assert w.rail_route == "nvshmem", f"rail route {w.rail_route!r}, not nvshmem"
        assert symm_mem.get_backend(device) == "NVSHMEM", symm_mem.get_backend(device)
    else:
        calls = min(calls, 3)
    _stage(rank, f"init, rail {w.rail_route}, nodes {w.nodes}")
    cases = _cases(w, device)
    for name, call, reference, exact in cases:
        got, want = call(), reference()
        sync()
        if exact:
            assert torch.equal(got, want), f"{name}: differs from NCCL's"
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=f"{name}: against NCCL's")
        _stage(rank, f"{name}: one call ok")
    for name, call, reference, exact in cases:
        first = call().clone()
        want = reference()
        mismatches = torch.zeros((), dtype=torch.int32, device=device)
        for i in range(1, calls + 1):
            got = call()
            mismatches += (got.view(torch.uint8) != first.view(torch.uint8)).any().int()  # no host sync per call
            if i % CHECK_EVERY == 0:
                if exact:
                    assert torch.equal(got, want), f"{name}: call {i} differs from NCCL's"
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=f"{name}: call {i}")
        sync()
        assert int(mismatches) == 0, f"{name}: {int(mismatches)} of {calls} calls differ from the first"
        weft_us = _per_call_us(call, min(calls, 100), sync)
        nccl_us = _per_call_us(reference, min(calls, 100), sync)
        _stage(rank, f"{name}: {calls} calls ok; us per eager call {weft_us} "
                     f"(the process group's collective {nccl_us})")
    sync()
    w.barrier()
    print(f"rank {rank}: ok", flush=True)
    sys.stdout.flush()
    os._exit(0)  # no NVSHMEM teardown: a hang there is not the exchange's


def driver(layouts, calls: int, timeout: float) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    for key, value in {**NVSHMEM_ENV, **RANK_ENV}.items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PROBE_RAIL_TIMEOUT_S"] = str(max(timeout - EXIT_MARGIN_S, 5))
    failed = 0
    for n, local in layouts:
        cmd = [sys.executable, "-m", "weft", "run", "-n", str(n), "--local-world-size", str(local),
               os.path.abspath(__file__), "--rank", "--calls", str(calls)]
        print(f"== {n} ranks as nodes of {local}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            status = "ok" if code == 0 else f"FAILED (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks
            proc.wait()
            status = f"HUNG (killed after {timeout} s)"
        failed += status != "ok"
        print(f"== {n} ranks as nodes of {local}: {status}, {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="2:1,4:1,4:2", help="N:L, comma-separated: N ranks as nodes of L")
    p.add_argument("--calls", type=int, default=1000, help="consecutive calls of each op")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per layout before it counts as hung")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # a rank under `weft run`
    args = p.parse_args()
    if args.calls < CHECK_EVERY:
        p.error(f"--calls must be at least {CHECK_EVERY}")
    if args.rank:
        faulthandler.dump_traceback_later(float(os.environ.get("PROBE_RAIL_TIMEOUT_S", "140")), exit=True)
        rank_main(args.calls)
        return
    if args.timeout <= EXIT_MARGIN_S:
        p.error(f"--timeout must be more than {EXIT_MARGIN_S} s")
    try:
        layouts = [tuple(int(v) for v in item.split(":")) for item in args.layouts.split(",")]
    except ValueError:
        p.error(f"--layouts: expected N:L,..., got {args.layouts!r}")
    bad = [f"{n}:{local}" for n, local in layouts if not (0 < local < n and n % local == 0)]
    if bad:
        p.error(f"--layouts {bad}: L must divide N and be smaller (nodes of L ranks, at least two nodes)")
    raise SystemExit(driver(layouts, args.calls, args.timeout))


if __name__ == "__main__":
    main()
