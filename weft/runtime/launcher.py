"""`weft run -n N script.py [args]`: start N ranks, and leave nothing behind.

Nodes: `--local-world-size L` splits the N ranks into simulated nodes of L (WEFT_LOCAL_WORLD_SIZE: peers on
another node are reached only through the network primitives, weft.runtime.topology); on GPUs, `--nnodes M
--node-rank R --master-addr A [--master-port P] -n L` starts this machine's L ranks of an M-node job through
torchrun (run on every node, each with its own R).

GPU (cuda backend): torchrun, one process per GPU, with NVLink multicast disabled in the environment
(backend.SAFE_ENV), every output line prefixed with its rank. cpu backend: N processes on this machine
with torchrun's variables set and the interpreter on, every output line prefixed with its rank; their
rendezvous store is the launcher's own, listening on 127.0.0.1 only.

The launcher starts each process in a process group of its own and watches them:
- SIGINT or SIGTERM to the launcher goes on to every group; what still runs WEFT_KILL_GRACE_S later is
  killed, and the launcher exits 128 + the signal's number.
- a rank that fails (exits non-zero) has the others stopped at once; a rank that exits 0 while the others
  do not follow within WEFT_EXIT_GRACE_S (it left without weft.finalize() while they wait for it) has them
  stopped too. The launcher names the rank that left first and its exit code, and exits non-zero.
- stopping is SIGTERM to each group, then SIGKILL to the groups and every process descended from the
  ranks WEFT_KILL_GRACE_S later; the ranks are also killed if the launcher itself dies (PR_SET_PDEATHSIG).
The cpu heap is an anonymous memfd (heap.cpu_heap), so no /dev/shm file exists to be left behind.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from . import settings
from .backend import BACKEND, SAFE_ENV

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback address that is free now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _loopback_store():
    """A TCP key-value store served by this process on 127.0.0.1 (a socket bound here, handed to torch's
    server: its own would listen on every interface); returns (store, port)."""
    import torch.distributed as dist

    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(LOOPBACK, port, None, True, datetime.timedelta(seconds=settings.init_timeout_s()),
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    sock.detach()  # the store's server owns the descriptor now, and closes it
    return store, port


def _command(target: list[str]) -> list[str]:
    return [sys.executable, "-u", *target]


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.buffer.write(prefix.encode() + line)
        sink.flush()


def _die_with_launcher():
    """A child's pre-exec hook: the kernel sends it SIGKILL when the launcher dies (Linux), so a launcher
    killed outright (SIGKILL, out of memory) takes its ranks with it."""
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _popen(cmd, env, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, start_new_session=True,
                            preexec_fn=_die_with_launcher if _prctl is not None else None, **kwargs)


def _descendants(pids) -> list[int]:
    """Every live process descended from `pids` (from /proc's parent links; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list[subprocess.Popen], sig: int) -> None:
    """Send `sig` to every process group, wait WEFT_KILL_GRACE_S for the processes to exit, then SIGKILL the
    groups and every descendant (one that left its group included)."""
    descendants = _descendants([p.pid for p in procs])
    for p in procs:
        _signal(p.pid, sig, group=True)
    deadline = time.monotonic() + settings.kill_grace_s()
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in descendants:
        _signal(pid, signal.SIGKILL, group=False)
    for p in procs:
        _signal(p.pid, signal.SIGKILL, group=True)
        p.wait()


def _exit_text(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _supervise(procs: list[subprocess.Popen], label, exit_grace: float | None, timeout: float | None) -> int:
    """Wait for `procs` to end (see the module docstring); returns the launcher's exit code. `label(i)` names
    process i in messages; `exit_grace` None: no grace rule (one torchrun process)."""
    received: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    # One waiter per process, so that exits are ordered as they happened, not as a poll loop finds them.
    exits: list[tuple[int, int, float]] = []  # (index, code, when)
    for i, p in enumerate(procs):
        threading.Thread(target=lambda i, p: exits.append((i, p.wait(), time.monotonic())), args=(i, p),
                         daemon=True).start()
    try:
        start = time.monotonic()
        while True:
            if received:
                sig = received[0]
                print(f"weft run: got {signal.Signals(sig).name}; passed on to every rank", file=sys.stderr)
                _stop(procs, sig)
                return 128 + sig
            done = sorted(exits, key=lambda e: e[2])
            failed = [(i, code) for i, code, _ in done if code != 0]
            if len(done) == len(procs):
                if not failed:
                    _stop(procs, signal.SIGKILL)  # whatever a rank left running in its group
                    return 0
                i, code = failed[0]
                print(f"weft run: {label(i)} {_exit_text(code)}", file=sys.stderr)
                return code if code > 0 else 128 - code
            if failed:
                i, code = failed[0]
                _stop(procs, signal.SIGTERM)
                print(f"weft run: {label(i)} {_exit_text(code)}; the other ranks were stopped", file=sys.stderr)
                return code if code > 0 else 128 - code
            if done and exit_grace is not None and time.monotonic() - done[0][2] > exit_grace:
                i = done[0][0]
                waiting = [label(j) for j, p in enumerate(procs) if p.poll() is None]
                _stop(procs, signal.SIGTERM)
                print(f"weft run: {label(i)} left first (exit code 0) and {', '.join(waiting)} did not follow "
                      f"within {exit_grace:g} s (WEFT_EXIT_GRACE_S): they were stopped", file=sys.stderr)
                return 1
            if timeout is not None and time.monotonic() - start > timeout:
                _stop(procs, signal.SIGTERM)
                print(f"weft run: timed out after {timeout:g} s; all ranks stopped", file=sys.stderr)
                return 124
            time.sleep(0.05)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_cpu(n: int, target: list[str], env: dict | None = None, timeout: float | None = None) -> int:
    exit_grace, _ = settings.exit_grace_s(), settings.kill_grace_s()  # bad values fail before anything starts
    store, port = _loopback_store()
    base = dict(os.environ, **SAFE_ENV, **(env or {}))
    # The ranks are the store's clients (torchrun's agent-store convention), never its server.
    base.update(WEFT_BACKEND="cpu", TRITON_INTERPRET="1", MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),
                TORCHELASTIC_USE_AGENT_STORE="True", WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                PYTHONUNBUFFERED="1")
    base.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a local run's connections stay on the loopback device
    procs, pumps = [], []
    try:
        for r in range(n):
            p = _popen(_command(target), dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
            procs.append(p)
            for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, f"[rank {r}] " if n > 1 else "", sink), daemon=True)
                t.start()
                pumps.append(t)
        return _supervise(procs, lambda r: f"rank {r}", exit_grace, timeout)
    finally:
        if any(p.poll() is None for p in procs):  # the launcher itself failed (or was interrupted) mid-start
            _stop(procs, signal.SIGTERM)
        for t in pumps:
            t.join(timeout=2)
        del store


DEFAULT_MASTER_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class Nodes:
    """A multi-node GPU job as torchrun takes it: `nnodes` machines, this one `node_rank`, the rendezvous on
    `master_addr`:`master_port` (node 0's address, reachable from every node)."""
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self):
        for name in ("nnodes", "node_rank", "master_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"--{name.replace('_', '-')} must be an int, got {type(value).__name__}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not self.master_addr and self.nnodes > 1:
            raise ValueError("--master-addr: the address of node 0, which every node reaches, is required with "
                             "--nnodes")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port in (0, 65536), got {self.master_port}")


def torchrun_command(n: int, target: list[str], nodes: Nodes | None = None) -> list[str]:
    """torchrun's command line for `n` ranks on this machine (of every node, with `nodes`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nodes is None or nodes.nnodes == 1:
        cmd.append("--standalone")
    else:
        # A static rendezvous: node ranks as given, node 0's agent serves the store on master_addr:master_port.
        cmd += [f"--nnodes={nodes.nnodes}", f"--node-rank={nodes.node_rank}", f"--master-addr={nodes.master_addr}",
                f"--master-port={nodes.master_port}"]
    cmd += [f"--nproc-per-node={n}", "--tee=3"]
    if target and target[0] == "-m":
        cmd += ["-m", *target[1:]]
    else:
        cmd += list(target)
    return cmd


def run_torchrun(n: int, target: list[str], env: dict | None = None, nodes: Nodes | None = None) -> int:
    settings.kill_grace_s()
    cmd = torchrun_command(n, target, nodes)
    full_env = dict(os.environ, **SAFE_ENV, **(env or {}), PYTHONUNBUFFERED="1")
    proc = _popen(cmd, full_env)
    try:
        # torchrun stops its workers when one fails, and on SIGINT / SIGTERM (which _supervise passes on).
        return _supervise([proc], lambda i: "torchrun", None, None)
    finally:
        if proc.poll() is None:
            _stop([proc], signal.SIGTERM)


def run(n: int, target: list[str], backend: str | None = None, env: dict | None = None,
        local_world_size: int | None = None, nodes: Nodes | None = None) -> int:
    """Start `n` ranks of `target` on this machine. `local_world_size`: ranks per simulated node (it must divide
    n); `nodes`: this machine's place in a multi-node GPU job (cuda backend only)."""
    if n < 1:
        raise ValueError(f"-n must be >= 1, got {n}")
    if not target:
        raise ValueError("nothing to run: give a script (and its arguments) or -m module")
    backend = backend or BACKEND
    env = dict(env or {})
    if local_world_size is not None:
        if isinstance(local_world_size, bool) or not isinstance(local_world_size, int):
            raise TypeError(f"--local-world-size must be an int, got {type(local_world_size).__name__}")
        if local_world_size < 1 or n % local_world_size:
            raise ValueError(f"--local-world-size must be a positive divisor of -n {n}, got {local_world_size}")
        if nodes is not None and nodes.nnodes > 1:
            raise ValueError("--local-world-size simulates nodes on one machine; with --nnodes each machine is a "
                             "node of -n ranks")
        env["WEFT_LOCAL_WORLD_SIZE"] = str(local_world_size)
    if backend == "cuda":
        return run_torchrun(n, target, env, nodes)
    if nodes is not None and nodes.nnodes > 1:
        raise ValueError("--nnodes: the cpu backend runs on one machine; simulate nodes with --local-world-size")
    return run_cpu(n, target, env)
