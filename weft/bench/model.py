"""A cost model of the collectives on several nodes: per op, the bytes each link carries and the predicted time,
weft's hierarchical ops (weft/kernels/hierarchical.py) beside NCCL's ring and tree; and of ag_gemm and gemm_rs
across nodes (`gemm_cost`) beside NCCL's ring collective and the GEMM in turn.

Links: each GPU's NVLink (per direction) inside a node, and between nodes each GPU's own link of `Cluster.links`:
by default its InfiniBand NIC (`IB_LINKS`, rail-optimised nodes: 8 × 400 Gb/s per node of 8); simulated nodes on
one machine (`weft run --local-world-size`) cross "nodes" by NCCL over NVLink instead (`SIMULATED_LINKS`, what
`weft bench nodes` predicts with). A phase costs its latency plus its bytes over the link's effective bandwidth. The
phases of weft's ops run one after another as implemented (`us`: no pipelining between the node's kernels and
the network yet); `pipelined_us` is the same bytes with the NVLink and network phases overlapped chunk by chunk,
as NCCL's ring streams them. Times in µs, sizes in bytes.

Calibration: NVLINK_EFFICIENCY and NVLINK_PHASE_US are weft's own single-node measurements (docs/perf.md, 4× H200
bf16 all_reduce: two-shot symmetric in place at 512 MiB, 353 GB/s bus bandwidth of 450; LL one-shot at 4 KiB,
4.1 µs); `single_node_check()` compares the model with those tables. The network's constants are not measured
here: IB_EFFICIENCY is a typical RDMA write efficiency, NET_STEP_US and NCCL's latencies are NCCL's own tuning
model's (tuning.cc of NCCL 2.7: base and per-step latencies of each protocol, LL / LL128 / Simple; NCCL picks
the fastest, so does the model, with LL's and LL128's share of payload in their words). Check them against
nccl-tests on the machines before trusting a crossover.

The GEMM ops: GEMM_TFLOPS is cuBLAS's bf16 rate on one H200 at TP shapes (docs/performance/data/gemm.json,
2026-11-21: 8192x3584x8192 in 656.9 µs, 732 TFLOP/s; 8192x6656x16384 in 2565.3 µs, 697), the same on H100 (the same
dense bf16 peak; H200's extra memory bandwidth matters little to these GEMMs). A node's overlapped op hides its
NVLink traffic under its GEMM (the slower of the two sets its time).

`python -m weft.bench.model` prints the tables of docs/nodes.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

NVLINK_GBPS = 450.0  # per GPU, per direction (NVLink 4: 18 links)
NVLINK_EFFICIENCY = 353.0 / 450.0  # docs/perf.md: 4× H200 all_reduce, symmetric in place, 512 MiB
NVLINK_PHASE_US = 4.1  # docs/perf.md: LL one-shot all_reduce of 4 KiB on 4× H200 (one NVLink phase)
IB_GBPS = 50.0  # one 400 Gb/s NIC per GPU
IB_EFFICIENCY = 0.9
NET_STEP_US = 6.6  # one network step (NCCL's ring step over the network, Simple protocol)
# NCCL 2.7's tuning model, per protocol (LL, LL128, Simple): base latency, step latency on NVLink and on the
# network, for ring and tree; and the payload share of each protocol's words.
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_BASE_US = {"ring": (3.6, 3.6, 8.4), "tree": (4.4, 4.4, 0.0)}
NCCL_STEP_US = {"ring": {"nvlink": (0.4, 2.5, 5.7), "net": (0.9, 2.5, 6.6)},
                "tree": {"nvlink": (0.5, 1.9, 28.0), "net": (5.0, 7.5, 50.0)}}
NCCL_PAYLOAD = (0.5, 120 / 128, 1.0)
GEMM_TFLOPS = 700.0  # bf16 dense, cuBLAS on 1× H200 at TP shapes (see the module docstring)

OPS = ("all_reduce", "all_gather", "reduce_scatter")
GEMM_OPS = ("ag_gemm", "gemm_rs")


@dataclass(frozen=True)
class Links:
    """Each GPU's link between nodes: `gbps` per direction at `efficiency`, `step_us` per step of weft's rail
    exchange, and which of NCCL's step latencies its ring pays per step between nodes (`nccl_steps`: "net" or
    "nvlink", keys of NCCL_STEP_US's)."""
    name: str
    gbps: float
    efficiency: float
    step_us: float
    nccl_steps: str = "net"


IB_LINKS = Links("InfiniBand, one 400 Gb/s NIC per GPU", IB_GBPS, IB_EFFICIENCY, NET_STEP_US)
# Simulated nodes: the rail is NCCL over NVLink. weft's own NVLink efficiency (as inside a node) and NCCL's tuning
# model's ring step on NVLink with the Simple protocol (its step latency between NVLink peers) per rail step.
SIMULATED_LINKS = Links("NVLink (simulated nodes: NCCL on the rail between GPUs of one machine)", NVLINK_GBPS,
                        NVLINK_EFFICIENCY, NCCL_STEP_US["ring"]["nvlink"][2], "nvlink")


@dataclass(frozen=True)
class Cluster:
    """`nodes` machines of `gpus` GPUs, each GPU with its own link between nodes (`links`: one NIC each by
    default)."""
    nodes: int
    gpus: int
    links: Links = IB_LINKS

    @property
    def world(self) -> int:
        return self.nodes * self.gpus


def _nvlink_us(nbytes: float) -> float:
    return nbytes / (NVLINK_GBPS * NVLINK_EFFICIENCY * 1e3)


def _net_us(nbytes: float, links: Links) -> float:
    return nbytes / (links.gbps * links.efficiency * 1e3)


@dataclass(frozen=True)
class Cost:
    """One op's prediction: bytes each GPU sends over NVLink and over its NIC, the time, and (weft's) the time
    with the NVLink and network phases overlapped."""
    nvlink_bytes: float
    ib_bytes: float
    us: float
    pipelined_us: float | None = None


def weft_cost(op: str, size: int, c: Cluster) -> Cost:
    """weft's hierarchical op on `size` bytes (all_reduce: the tensor; all_gather: the output; reduce_scatter: the
    input). Inside a node weft's two-shot / push kernels (one NVLink phase each), between nodes the rail's
    exchange: every rail member sends its part to the N - 1 others (one network step)."""
    n, gpus = c.nodes, c.gpus
    if op == "all_reduce":
        intra = 2 * (gpus - 1) / gpus * size  # node reduce_scatter + node all_gather
        net = 2 * (n - 1) / n * size / gpus if n > 1 else 0.0  # the rail's all_reduce of 1/L
        phases = 2 if gpus > 1 else 0
    elif op in ("all_gather", "reduce_scatter"):
        intra = (gpus - 1) / gpus * size
        net = (n - 1) / n * size / gpus if n > 1 else 0.0  # the rail's share: its nodes' blocks of one place
        phases = 1 if gpus > 1 else 0
    else:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    net_steps = (2 if op == "all_reduce" else 1) if n > 1 else 0
    latency = phases * NVLINK_PHASE_US + net_steps * c.links.step_us
    net_us = _net_us(net, c.links)
    return Cost(intra, net, latency + _nvlink_us(intra) + net_us, latency + max(_nvlink_us(intra), net_us))


def nccl_ring_cost(op: str, size: int, c: Cluster) -> Cost:
    """NCCL's ring over all W GPUs, nodes in order: one channel per NIC, so each ring's one crossing per node has a
    NIC of its own. Every ring edge carries 2 (W - 1) / W (all_reduce) or (W - 1) / W of the size over the rings;
    NVLink and the network stream at once (the slower one sets the time)."""
    w = c.world
    factor = 2 * (w - 1) / w if op == "all_reduce" else (w - 1) / w
    per_gpu = factor * size
    net = per_gpu / c.gpus if c.nodes > 1 else 0.0  # a NIC carries one of the GPUs' rings
    steps = 2 * (w - 1) if op == "all_reduce" else w - 1
    net_steps = (2 if op == "all_reduce" else 1) * (c.nodes - 1) if c.nodes > 1 else 0
    best = math.inf
    for p in range(len(NCCL_PROTOCOLS)):
        step = NCCL_STEP_US["ring"]
        latency = NCCL_BASE_US["ring"][p] + (steps - net_steps) * step["nvlink"][p] + \
            net_steps * step[c.links.nccl_steps][p]
        best = min(best, latency + max(_nvlink_us(per_gpu), _net_us(net, c.links)) / NCCL_PAYLOAD[p])
    return Cost(per_gpu, net, best)


def nccl_tree_cost(size: int, c: Cluster) -> Cost:
    """NCCL's tree all_reduce: a chain inside each node, a double binary tree between nodes; each node sends
    about the whole size up and receives it down over its NICs, each GPU the size over NVLink both ways."""
    net = size / c.gpus if c.nodes > 1 else 0.0
    levels = math.ceil(math.log2(c.nodes)) if c.nodes > 1 else 0
    best = math.inf
    for p in range(len(NCCL_PROTOCOLS)):
        step = NCCL_STEP_US["tree"]
        latency = NCCL_BASE_US["tree"][p] + 2 * ((c.gpus - 1) * step["nvlink"][p] +
                                                 levels * step[c.links.nccl_steps][p])
        best = min(best, latency + max(_nvlink_us(2 * size), _net_us(2 * net, c.links)) / NCCL_PAYLOAD[p])
    return Cost(2 * size, net, best)


@dataclass(frozen=True)
class GemmCost:
    """ag_gemm's or gemm_rs's prediction on one GPU: bytes it sends over NVLink and over its NIC, the GEMM alone,
    weft's op across nodes (weft/kernels/hierarchical.py, as implemented) and NCCL's ring collective then the
    GEMM (the baseline). Times in µs."""
    nvlink_bytes: float
    ib_bytes: float
    gemm_us: float
    us: float
    baseline_us: float


def gemm_cost(op: str, m: int, k: int, n: int, c: Cluster, element_bytes: int = 2) -> GemmCost:
    """One GPU's (m, k) @ (k, n) of `op` over the whole cluster: ag_gemm's gathered A is (m, k), gemm_rs's a is
    (m, k) (k: this GPU's slice of K) and its partial products (m, n).

    The data the network carries is the all_gather's (ag_gemm: the shards) or the reduce_scatter's (gemm_rs: the
    node sums), so the bytes per link are those ops' on the gathered A or the partials. Time, with N nodes:
    a node block (the node's overlapped op on 1/N of the rows) costs its GEMM or its NVLink traffic, whichever is
    longer, plus one NVLink phase (its start barrier); ag_gemm runs the rail's all_gather beside the first block
    (its own node's), then the N - 1 others; gemm_rs runs the N - 1 other nodes' blocks, then the rail's exchange
    beside its own node's block."""
    if op not in GEMM_OPS:
        raise ValueError(f"op must be one of {GEMM_OPS}, got {op!r}")
    nodes, gpus = c.nodes, c.gpus
    gemm_us = 2 * m * k * n / (GEMM_TFLOPS * 1e6)
    moved = (m * k if op == "ag_gemm" else m * n) * element_bytes  # the gathered A, or the partial products
    collective = weft_cost("all_gather" if op == "ag_gemm" else "reduce_scatter", moved, c)
    block = max(gemm_us, _nvlink_us(collective.nvlink_bytes)) / nodes + (NVLINK_PHASE_US if gpus > 1 else 0.0)
    net = c.links.step_us + _net_us(collective.ib_bytes, c.links) if nodes > 1 else 0.0
    us = max(block, net) + (nodes - 1) * block
    ring = nccl_ring_cost("all_gather" if op == "ag_gemm" else "reduce_scatter", moved, c)
    return GemmCost(collective.nvlink_bytes, collective.ib_bytes, gemm_us, us, ring.us + gemm_us)


# docs/perf.md, 4× and 2× H200 bf16 all_reduce, µs: (GPUs, bytes) -> measured (two-shot symmetric in place above
# 1 MiB, the LL one-shot at 4 KiB).
MEASURED_ALL_REDUCE_US = {(4, 4 << 10): 4.1, (4, 16 << 20): 81.2, (4, 64 << 20): 296.7, (4, 512 << 20): 2281.6,
                          (2, 16 << 20): 56.1, (2, 64 << 20): 192.2, (2, 512 << 20): 1480.7}


def single_node_check() -> list[tuple[int, int, float, float]]:
    """(GPUs, bytes, predicted µs, measured µs) for each single-node measurement the model is held to."""
    rows = []
    for (gpus, size), measured in MEASURED_ALL_REDUCE_US.items():
        cost = weft_cost("all_reduce", size, Cluster(1, gpus))
        if size <= 4 << 10:  # one LL phase, not two
            cost = Cost(cost.nvlink_bytes, 0.0, NVLINK_PHASE_US + _nvlink_us(cost.nvlink_bytes))
        rows.append((gpus, size, cost.us, measured))
    return rows


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


SIZES = (64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30)
CLUSTERS = (Cluster(2, 8), Cluster(4, 8))
# The GEMM ops' shapes: Llama-3 70B's MLP (hidden 8192, FFN 28672) split over every GPU, at these token counts.
TOKENS = (4096, 16384, 65536)
HIDDEN, FFN = 8192, 28672


def gemm_shapes(op: str, c: Cluster) -> list[tuple[int, int, int]]:
    """One GPU's (m, k, n) of `op` (ag_gemm: the up projection, gemm_rs: the down one) at each of TOKENS."""
    if op == "ag_gemm":
        return [(t, HIDDEN, FFN // c.world) for t in TOKENS]
    return [(t, FFN // c.world, HIDDEN) for t in TOKENS]


def tables() -> str:
    """The markdown of docs/nodes.md's cost tables."""
    out = []
    for c in CLUSTERS:
        out.append(f"{c.nodes}×{c.gpus} GPUs:\n")
        out.append("| op | size | NVLink MB / GPU | IB MB / NIC | weft hierarchical µs | weft, phases overlapped µs | "
                   "NCCL ring µs | NCCL tree µs |")
        out.append("|---|---|---|---|---|---|---|---|")
        for op in OPS:
            for size in SIZES:
                h, r = weft_cost(op, size, c), nccl_ring_cost(op, size, c)
                tree = f"{nccl_tree_cost(size, c).us:.0f}" if op == "all_reduce" else "—"
                out.append(f"| {op} | {_size(size)} | {h.nvlink_bytes / 1e6:.1f} | {h.ib_bytes / 1e6:.1f} | "
                           f"{h.us:.0f} | {h.pipelined_us:.0f} | {r.us:.0f} | {tree} |")
        out.append("")
    for c in CLUSTERS:
        out.append(f"ag_gemm and gemm_rs, {c.nodes}×{c.gpus} GPUs (bf16; m×k×n: one GPU's GEMM):\n")
        out.append("| op | m×k×n | NVLink MB / GPU | IB MB / NIC | GEMM alone µs | weft across nodes µs | "
                   "NCCL ring + GEMM µs |")
        out.append("|---|---|---|---|---|---|---|")
        for op in GEMM_OPS:
            for m, k, n in gemm_shapes(op, c):
                g = gemm_cost(op, m, k, n, c)
                out.append(f"| {op} | {m}×{k}×{n} | {g.nvlink_bytes / 1e6:.1f} | {g.ib_bytes / 1e6:.1f} | "
                           f"{g.gemm_us:.0f} | {g.us:.0f} | {g.baseline_us:.0f} |")
        out.append("")
    out.append("Single node, the model against docs/perf.md (all_reduce, bf16, H200):\n")
    out.append("| GPUs | size | model µs | measured µs |")
    out.append("|---|---|---|---|")
    for gpus, size, predicted, measured in single_node_check():
        out.append(f"| {gpus} | {_size(size)} | {predicted:.1f} | {measured:.1f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(tables(), end="")
