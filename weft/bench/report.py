"""Bench output: JSON rows, a markdown table (sizes down, implementations across), a PNG plot."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass
class Row:
    suite: str
    case: str        # e.g. "64 MiB"
    impl: str        # e.g. "weft push", "nccl"
    ms: float        # median per call, slowest rank
    gbps: float      # the suite's bandwidth (default: algorithmic, result bytes / time), 0 where meaningless
    nbytes: int = 0
    world_size: int = 1


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


ALGBW = "algorithmic bandwidth (GB/s)"


def _best(by, case, impls, prefix):
    times = [by[(case, i)].ms for i in impls if i.startswith(prefix) and (case, i) in by]
    return min(times) if times else None


def _unit(bandwidth: str) -> str:
    """"GB/s" of "bus bandwidth (GB/s)", "TFLOP/s" of "TFLOP/s of the GEMM"."""
    inner = bandwidth[bandwidth.find("(") + 1:bandwidth.find(")")] if "(" in bandwidth else ""
    return inner or bandwidth.split()[0]


def markdown(rows: list[Row], baseline: str | None = None, rival: str | None = None,
             bandwidth: str = ALGBW) -> str:
    """`baseline`: an impl the best weft row is compared with; `rival`: a prefix of impls (e.g. "torch")
    whose best is compared with the best weft row too; `bandwidth`: what the bracketed figure is."""
    cases = list(dict.fromkeys(r.case for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    by = {(r.case, r.impl): r for r in rows}
    rival = rival if rival and any(i.startswith(rival) for i in impls) else None
    head = ["size"] + [f"{i} µs ({_unit(bandwidth)})" for i in impls]
    if baseline:
        head += [f"best weft vs {baseline}"]
    if rival:
        head += [f"best weft vs best {rival}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        cells = [c]
        for i in impls:
            r = by.get((c, i))
            cells.append("—" if r is None else f"{r.ms * 1e3:.1f} ({r.gbps:.0f})")
        best = _best(by, c, impls, "weft")
        if baseline:
            ok = best is not None and (c, baseline) in by
            cells.append(f"{by[(c, baseline)].ms / best:.2f}×" if ok else "—")
        if rival:
            other = _best(by, c, impls, rival)
            cells.append(f"{other / best:.2f}×" if best is not None and other is not None else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str, bandwidth: str = ALGBW) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for impl in dict.fromkeys(r.impl for r in rows):
        rs = sorted((r for r in rows if r.impl == impl), key=lambda r: r.nbytes)
        x = [r.nbytes for r in rs]
        ax1.plot(x, [r.ms * 1e3 for r in rs], marker="o", label=impl)
        ax2.plot(x, [r.gbps for r in rs], marker="o", label=impl)
    for ax, label in ((ax1, "latency (µs, slowest rank)"), (ax2, bandwidth)):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax1.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[Row], out_dir: str, name: str, title: str, baseline: str | None = None,
          rival: str | None = None, bandwidth: str = ALGBW) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1)
    table = markdown(rows, baseline, rival, bandwidth)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(f"## {title}\n\ncells: µs per call (median, slowest rank), in brackets {bandwidth}\n\n{table}\n")
    plot(rows, os.path.join(out_dir, f"{name}.png"), title, bandwidth)
    return table
