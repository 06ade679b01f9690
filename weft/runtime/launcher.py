"""`weft run -n N script.py [args]`: start N ranks.

GPU (cuda backend): torchrun, one process per GPU, with NVLink multicast
disabled in the environment, every output line prefixed with its rank.
cpu backend: N processes on this machine with torchrun's variables set and
the interpreter on. If one rank fails, the others are stopped and its exit
is reported, so a crash never leaves the job hanging.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from .backend import BACKEND, SAFE_ENV


def _command(target: list[str]) -> list[str]:
    return [sys.executable, "-u", *target]


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.buffer.write(prefix.encode() + line)
        sink.flush()


def run_cpu(n: int, target: list[str], env: dict | None = None, timeout: float | None = None) -> int:
    from ..testing.ranks import free_port

    port = free_port()
    base = dict(os.environ, **SAFE_ENV, **(env or {}))
    base.update(WEFT_BACKEND="cpu", TRITON_INTERPRET="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), PYTHONUNBUFFERED="1")
    procs, pumps = [], []
    for r in range(n):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        p = subprocess.Popen(_command(target), env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
        procs.append(p)
        for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, f"[rank {r}] " if n > 1 else "", sink), daemon=True)
            t.start()
            pumps.append(t)
    deadline = None if timeout is None else time.monotonic() + timeout
    failed = None
    while True:
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            failed = bad[0]
            break
        if all(c == 0 for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            failed = (None, 124)
            break
        time.sleep(0.05)
    if failed is not None:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    for t in pumps:
        t.join(timeout=2)
    if failed is None:
        return 0
    rank, code = failed
    if rank is None:
        print(f"weft run: timed out after {timeout:g} s; all ranks stopped", file=sys.stderr)
    else:
        print(f"weft run: rank {rank} exited with code {code}; the other ranks were stopped", file=sys.stderr)
    return code or 1


def run_torchrun(n: int, target: list[str], env: dict | None = None) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "--tee=3"]
    if target and target[0] == "-m":
        cmd += ["-m", *target[1:]]
    else:
        cmd += list(target)
    full_env = dict(os.environ, **SAFE_ENV, **(env or {}), PYTHONUNBUFFERED="1")
    return subprocess.call(cmd, env=full_env)


def run(n: int, target: list[str], backend: str | None = None, env: dict | None = None) -> int:
    if n < 1:
        raise ValueError(f"-n must be >= 1, got {n}")
    if not target:
        raise ValueError("nothing to run: give a script (and its arguments) or -m module")
    backend = backend or BACKEND
    if backend == "cuda":
        return run_torchrun(n, target, env)
    return run_cpu(n, target, env)
