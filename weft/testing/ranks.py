"""Run one function on N forked cpu ranks, each with weft initialised.

A rank that raises makes the call raise `RankFailure` with that rank's
traceback; the other ranks are killed, not left waiting. A run that outlasts
`timeout` is killed too, and the error says which ranks were still running;
first each of them, one after another, writes every thread's Python stack to
stderr under a line naming it (faulthandler, on SIGUSR1): a hang shows where.
"""
from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import time
import traceback

from ..runtime.launcher import free_port


# How long a timed-out run waits for each rank's stacks before the next rank's (and killing them).
STACKS_S = 0.5


class RankFailure(AssertionError):
    pass


def _rank_main(fn, rank, world_size, port, args, kwargs, results, env):
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_ranks asks for the stacks of a rank it times out
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import weft

        weft.init()
        value = fn(*args, **kwargs)
        weft.finalize()
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - report everything, with the rank
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()  # the traceback is in the pipe before this rank exits
        os._exit(1)


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, env: dict | None = None, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` cpu ranks; returns each rank's return value."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, kwargs, results, env or {}),
                         daemon=True) for r in range(world_size)]
    # Everything this process holds, garbage included, frozen for the ranks: a forked rank must never run the
    # finalizer of an object it inherited (a torch.distributed process group's joins threads that exist only in
    # the parent: a gloo group's destructor would wait for ever inside the rank's gc.collect()), and frozen
    # objects are never collected there. No gc.collect() first: it cost ~0.2 s a call once transformers is
    # imported; the parent collects its garbage as usual once unfrozen.
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
    values, done = [None] * world_size, set()
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except Exception:  # queue.Empty
                for r, p in enumerate(procs):
                    if r not in done and p.exitcode not in (None, 0) and results.empty():
                        time.sleep(0.5)  # a traceback may still be in flight
                        if results.empty():
                            raise RankFailure(f"rank {r} died with exit code {p.exitcode}")
                if time.monotonic() > deadline:
                    waiting = sorted(set(range(world_size)) - done)
                    for r in waiting:  # one after another: dumps written at once interleave on the shared fd
                        if procs[r].is_alive():
                            os.write(2, f"\n--- rank {r} (pid {procs[r].pid}) at run_ranks' timeout:\n".encode())
                            os.kill(procs[r].pid, signal.SIGUSR1)
                            time.sleep(STACKS_S)
                    raise RankFailure(f"timed out after {timeout:g} s; ranks still running: {waiting} (each wrote "
                                      f"its threads' Python stacks to stderr)")
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
            done.add(rank)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    return values
