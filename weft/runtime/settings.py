"""Every WEFT_* environment variable weft reads: its type, accepted range and default, in one place.

A value is read when it is used (tests and launchers change the environment between calls), and a bad
one raises a ValueError naming the variable, its value and what it accepts. An unset or empty variable
takes the default. `check_all()` (run by `weft.init()`) reads every one, so garbage anywhere fails at
init rather than in the middle of a run. This module imports nothing heavy: backend.py reads it before
torch or triton is imported. docs/design.md's settings table lists the same variables.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

_UNITS = (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))


def _bytes(text: str) -> int:
    upper = text.upper()
    mult = 1
    for suffix, unit in _UNITS:
        if upper.endswith(suffix):
            upper, mult = upper[: -len(suffix)], unit
            break
    number = float(upper)  # ValueError on garbage
    if not math.isfinite(number):
        raise ValueError(text)
    value = int(number * mult)
    if value <= 0:
        raise ValueError(text)
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


@dataclass(frozen=True)
class Delay:
    """WEFT_TEST_DELAY: each stall point of a chosen rank sleeps, with `probability`, a uniform random time of
    up to `max_us` microseconds."""
    ranks: frozenset | None  # world ranks; None: every rank
    probability: float
    max_us: float

    def stalls(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def _delay(text: str) -> Delay:
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(text)
    ranks_text, probability, max_us = parts[0].strip().lower(), float(parts[1]), float(parts[2])
    ranks = None if ranks_text == "all" else frozenset(int(r) for r in ranks_text.split(","))
    if ranks is not None and min(ranks) < 0:
        raise ValueError(text)
    if not (0 < probability <= 1 and math.isfinite(max_us) and max_us > 0):
        raise ValueError(text)
    return Delay(ranks, probability, max_us)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _decode_path(text: str) -> str:
    value = text.lower()
    if value not in ("fused", "layers", "persistent"):
        raise ValueError(text)
    return value


def _rail(text: str) -> str:
    value = text.lower()
    if value not in ("nccl", "nvshmem"):
        raise ValueError(text)
    return value


def _backend(text: str) -> str:
    value = text.lower()
    if value not in ("cpu", "cuda"):
        raise ValueError(text)
    return value


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], object]
    accepted: str  # what the error message and the docs say it takes
    default: str  # the default, in words
    meaning: str


SETTINGS = {s.name: s for s in (
    Setting("WEFT_BACKEND", _backend, "cpu or cuda", "cuda when a GPU is visible, else cpu",
            "cpu runs every kernel under Triton's interpreter"),
    Setting("WEFT_HEAP_SIZE", _bytes, "a positive number of bytes (4096, 64MiB, 1.5G)", "2 GiB on GPUs, 64 MiB on cpu",
            "symmetric heap per rank (or weft.init(heap_size=...))"),
    Setting("WEFT_WORKSPACE_BYTES", _bytes, "a positive number of bytes (4096, 64MiB, 1.5G)",
            "128 MiB on GPUs, 4 MiB on cpu", "workspace each op family takes from the heap (or "
            "weft.init(workspace_bytes=...))"),
    Setting("WEFT_INIT_TIMEOUT_S", _positive_seconds, "seconds > 0", "300",
            "how long init, the process group's collectives and host barriers wait for the other ranks"),
    Setting("WEFT_WAIT_TIMEOUT_S", _positive_seconds, "seconds > 0",
            "300 on the cpu backend; unset on GPUs: waits never give up",
            "every device-side wait gives up after this long with a report (compiled in on GPUs: never benchmark "
            "with it)"),
    Setting("WEFT_EXIT_GRACE_S", _positive_seconds, "seconds > 0", "60",
            "`weft run`: once a rank has exited 0, how long the others may take to follow before they are stopped"),
    Setting("WEFT_KILL_GRACE_S", _positive_seconds, "seconds > 0", "5",
            "`weft run`: how long a stopped or signalled rank may take to exit before it is killed"),
    Setting("WEFT_TEST_DELAY", _delay, "RANKS:PROBABILITY:MAX_US (all:0.05:2000, 1,2:0.5:500; "
            "probability in (0, 1], max_us > 0)", "unset: no delay",
            "cpu backend, for tests: the chosen ranks stall at random before each access to a peer (a push, a "
            "notify, a copy-engine copy): each stall point sleeps, with that probability, up to max_us"),
    Setting("WEFT_P2P_KERNEL", _flag, "0 or 1",
            "per message on GPUs: the kernel up to weft.tuning's p2p.kernel_max_bytes, the process group's above",
            "1: send/recv on GPUs through weft's device kernel; 0: through the process group's send/recv (NCCL) "
            "(the cpu backend always uses the kernel)"),
    Setting("WEFT_P2P_PROGRAMS", _positive_int, "an integer > 0", "weft.tuning's p2p.programs on GPUs, 1 on cpu",
            "programs of the p2p kernel: each moves its part of every message through a stream of its own"),
    Setting("WEFT_LOCAL_WORLD_SIZE", _positive_int, "an integer > 0 that divides the world size",
            "unset: LOCAL_WORLD_SIZE (torchrun's ranks per node), else every rank on one node",
            "ranks per node: splits one machine's ranks into simulated nodes of this many (`weft run "
            "--local-world-size`), whose peers are reached only through the network primitives"),
    Setting("WEFT_RAIL", _rail, "nccl or nvshmem", "nccl",
            "GPUs, a world that spans nodes: the hierarchical ops' exchange between nodes (the rail) through NCCL "
            "on the rail's process group, or weft's exchange kernel over NVSHMEM (every symmetric allocation of "
            "the process then NVSHMEM's: docs/nodes.md); the cpu backend's rail is always weft's kernel"),
    Setting("WEFT_DECODE", _decode_path, "fused, layers or persistent",
            "fused at decode batch buckets up to weft.tuning's decode.fused_max_m, layers above",
            "the decoder's decode step (weft.models): fused (weft/kernels/decode.py: a GEMV with the norm, rotary, "
            "SiLU or residual add fused in, five launches a layer), layers (the layers' GEMMs and pointwise "
            "kernels) or persistent (weft/kernels/decode_step.py: the fused path's work, every layer in one "
            "persistent launch; one rank, one stage, else the default choice)"),
    Setting("WEFT_BENCH_OUT", str, "a directory", "bench_results", "`weft bench`'s output folder (or --out)"),
)}


def get(name: str, default=None):
    """The parsed value of the WEFT_* variable `name`, or `default` when it is unset or empty."""
    setting = SETTINGS[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return setting.parse(text)
    except (ValueError, OverflowError):
        raise ValueError(f"{name}={text!r}: expected {setting.accepted}") from None


def check_all() -> None:
    """Parse every WEFT_* variable that is set, raising on the first bad one."""
    for name in SETTINGS:
        get(name)


# The cpu backend's default wait timeout: no interpreted wait hangs for ever (a member that never makes its half
# of a call). On GPUs the timeout is compiled into every wait, so it stays off unless asked for.
CPU_WAIT_TIMEOUT_S = 300.0


def wait_timeout_s() -> float:
    """WEFT_WAIT_TIMEOUT_S; unset: CPU_WAIT_TIMEOUT_S under the interpreter (the cpu backend), else 0 (GPU waits
    never give up)."""
    from .backend import INTERPRET

    return get("WEFT_WAIT_TIMEOUT_S", CPU_WAIT_TIMEOUT_S if INTERPRET else 0.0)


def test_delay() -> Delay | None:
    """WEFT_TEST_DELAY, None when unset."""
    return get("WEFT_TEST_DELAY")


def decode_path() -> str | None:
    """WEFT_DECODE ("fused", "layers" or "persistent"), None when unset (the tuning data decides per batch)."""
    return get("WEFT_DECODE")


def rail() -> str:
    """WEFT_RAIL ("nccl" or "nvshmem"), "nccl" when unset."""
    return get("WEFT_RAIL", "nccl")


def init_timeout_s() -> float:
    return get("WEFT_INIT_TIMEOUT_S", 300.0)


def exit_grace_s() -> float:
    return get("WEFT_EXIT_GRACE_S", 60.0)


def kill_grace_s() -> float:
    return get("WEFT_KILL_GRACE_S", 5.0)
