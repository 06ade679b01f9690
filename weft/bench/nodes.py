"""nodes: weft's ops across simulated nodes, each layout beside the single-node op, the process group's own and the
cost model's prediction, in one report.

Layouts (--local-sizes; default N, N / 2 and 1 ranks per node at N ranks): the topology is fixed at weft.init(),
so the suite starts the world once per layout (weft.finalize(), WEFT_LOCAL_WORLD_SIZE, weft.init()) in the same
ranks, and times every op there. Ops: all_reduce, all_gather and reduce_scatter (method auto, bf16) from
--min-bytes to --max-bytes in x4 steps (size: the all_reduce tensor, the all_gather output, the reduce_scatter
input, as the reduction suites), ag_gemm and gemm_rs (method overlap) at --gemm-shapes, m × k × n per rank (ag_gemm:
the shard (m, k) @ (k, n) to (W m, n); gemm_rs: (W m, k) @ (k, n), k this rank's slice of K, to m rows).

Rows (the markdown's columns): "weft N/L×L", the op on N / L nodes of L ranks (the hierarchical form of
weft/kernels/hierarchical.py: the node's kernels inside a node, the rail's NCCL between nodes); "single node
1×N", the op on one node of N (L = N); the process group's own (nccl: all_reduce, all_gather_into_tensor,
reduce_scatter_tensor; for the GEMM ops the collective and torch.matmul in turn), timed in the single-node world
(NCCL across the whole machine does not see simulated nodes); "model ...", weft/bench/model.py's prediction for
each: the simulated nodes' rails with the links of model.SIMULATED_LINKS (NCCL over NVLink between the GPUs of
one machine; model.IB_LINKS where the nodes are machines of their own), the single node, NCCL's ring on one node
(the GEMM ops: the ring, then the GEMM). Every result is checked against the process group's before it is timed,
and a layout that spans nodes must have taken the hierarchical form.

Two views (--view), as the other suites: CUDA-graph replay and eager back-to-back calls; medians of the slowest
rank (weft.bench.timing). An op that cannot be captured is timed eagerly in the graph view, its name marked
"(eager)". Where the world spans nodes the ranks line up before a sample on NCCL (weft's device barrier reaches
this node's ranks only). The bracketed figure is left out (the report mixes sizes and GEMM shapes); the JSON's
gbps holds the algorithmic bandwidth of the collectives' rows, 0 for the GEMM ops' and the model's.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import weft
from weft.testing.reference import all_gather_ref, reduce_scatter_ref

from . import model, sweep
from .report import Row, human_bytes
from .timing import time_calls

SUITE = "nodes"
BANDWIDTH = None  # µs only: the cases are sizes and GEMM shapes
RIVAL = "single node"  # the markdown compares the best layout across nodes with the single-node op
# ag_gemm's gathered A and gemm_rs's received partials at the default shapes on 8 GPUs (448 MiB), and the node's
# and rail's heaps that the hierarchical ops make from it (7 and 2 workspaces).
WORKSPACE_BYTES = str(512 << 20)
HEAP_SIZE = "6GiB"  # the single-node families' workspaces (the layouts across nodes use their node's and rail's)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
GEMM_OPS = ("ag_gemm", "gemm_rs")
GEMM_TOLERANCE = 2e-2  # relative (Frobenius) error against the process group's collective and torch.matmul


def add_arguments(p) -> None:
    p.add_argument("--local-sizes", default="",
                   help="ranks per simulated node of each layout, comma-separated (default: N, N/2, 1 that divide N)")
    p.add_argument("--ops", default=",".join(COLLECTIVES + GEMM_OPS),
                   help=f"comma-separated subset of {', '.join(COLLECTIVES + GEMM_OPS)} (default: all)")
    p.add_argument("--min-bytes", type=int, default=64 << 10, help="smallest collective size")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest collective size (x4 steps)")
    p.add_argument("--gemm-shapes", default="1024x8192x4096,4096x4096x8192",
                   help="the GEMM ops' m x k x n per rank, comma-separated")
    p.add_argument("--samples", type=int, default=20, help="timed samples per implementation, case and view")
    p.add_argument("--view", choices=("graph", "eager", "both"), default="both",
                   help="CUDA-graph replay, eager back-to-back calls, or both")


def _machine_ranks(world_size: int) -> int:
    """Ranks on this machine: torchrun's LOCAL_WORLD_SIZE where the job spans machines, else the world."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(text) if text else world_size


def layouts(args, world_size: int) -> list[int]:
    """The ranks per node of each layout, in the order they run: each must divide this machine's ranks (a simulated
    node is part of a machine)."""
    if world_size < 2:
        raise ValueError(f"weft bench nodes needs at least 2 ranks, got {world_size}")
    machine = _machine_ranks(world_size)
    if args.local_sizes:
        try:
            sizes = [int(s) for s in args.local_sizes.split(",")]
        except ValueError:
            raise ValueError(f"--local-sizes must be integers, comma-separated, got {args.local_sizes!r}") from None
    else:
        sizes = [s for s in (machine, machine // 2, 1) if s >= 1 and machine % s == 0]
    bad = [s for s in sizes if s < 1 or machine % s]
    if bad:
        raise ValueError(f"--local-sizes: {bad} do not divide the {machine} ranks of this machine")
    return list(dict.fromkeys(sizes))


def links(world_size: int) -> model.Links:
    """The links between the layouts' nodes: NVLink where every node is part of this machine, else the network."""
    return model.SIMULATED_LINKS if _machine_ranks(world_size) == world_size else model.IB_LINKS


def gemm_shapes(args) -> list[tuple[int, int, int]]:
    return sweep.gemm_shapes(args.gemm_shapes, "MxKxN per rank")


def _label(local: int, world_size: int) -> str:
    return f"single node 1×{world_size}" if local == world_size else f"weft {world_size // local}×{local}"


def _restart(local: int):
    """The world again with `local` ranks per node (the same ranks, a new process group and heap)."""
    if len(weft.world().nodes[0]) == local:
        return weft.world()
    weft.finalize()
    os.environ["WEFT_LOCAL_WORLD_SIZE"] = str(local)
    return weft.init()


def _check_path(w, op: str) -> None:
    """Across nodes every plan of `op` must be the hierarchical form (a fallback would time something else)."""
    if not w.topology.spans_nodes:
        return
    plans = [p for key, p in w.plans.items() if key[0] == op]
    forms = {getattr(p.run, "__self__", None).__class__.__module__ for p in plans}
    if forms != {"weft.kernels.hierarchical"}:
        raise RuntimeError(f"{op} across nodes took {sorted(forms)}, not weft.kernels.hierarchical")


def _collective(w, op: str, size: int, baseline: str, with_baseline: bool) -> dict:
    """{impl: fn(i)} for input set i of `op` at `size` bytes, checked."""
    weft_fn, base_fn = sweep.collective_case(op, size, w.world_size, None, w.group, op, baseline)
    _check_path(w, op)
    impls = {_label(len(w.nodes[0]), w.world_size): weft_fn}
    if with_baseline:
        impls[baseline] = base_fn
    return impls


def _gemm(w, op: str, m: int, k: int, n: int, baseline: str, with_baseline: bool):
    """{impl: fn()} of `op` on one rank's m x k x n, checked against the collective and torch.matmul."""
    world, dev, g = w.world_size, w.device, w.group
    gen = torch.Generator(device=dev).manual_seed(7 + w.rank)
    if op == "ag_gemm":
        a = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        b = (torch.randn(k, n, device=dev, generator=gen) / k ** 0.5).to(torch.bfloat16)
        gathered = torch.empty(world * m, k, dtype=a.dtype, device=dev)
        out, ref = (torch.empty(world * m, n, dtype=a.dtype, device=dev) for _ in range(2))

        def base_fn():
            all_gather_ref(gathered, a, g)
            return torch.matmul(gathered, b, out=ref)

        weft_fn = lambda: weft.ops.ag_gemm(a, b, method="overlap", out=out)  # noqa: E731
    else:
        a = torch.randn(world * m, k, device=dev, generator=gen).to(torch.bfloat16)
        b = (torch.randn(k, n, device=dev, generator=gen) / (k * world) ** 0.5).to(torch.bfloat16)
        partial = torch.empty(world * m, n, dtype=a.dtype, device=dev)
        out, ref = (torch.empty(m, n, dtype=a.dtype, device=dev) for _ in range(2))

        def base_fn():
            torch.matmul(a, b, out=partial)
            reduce_scatter_ref(ref, partial, g)
            return ref

        weft_fn = lambda: weft.ops.gemm_rs(a, b, method="overlap", out=out)  # noqa: E731
    want = base_fn().float()
    out.fill_(float("nan"))
    got = weft_fn().float()
    err = ((got - want).norm() / want.norm()).item()
    if not err < GEMM_TOLERANCE:
        raise RuntimeError(f"{op} {m}x{k}x{n}: relative error {err:.2e} against {baseline} + torch.matmul")
    _check_path(w, op)
    impls = {_label(len(w.nodes[0]), w.world_size): weft_fn}
    if with_baseline:
        impls[baseline] = base_fn
    return impls


def _predictions(case: str, nbytes: int, view: str, world_size: int, layout_sizes: list[int], baseline: str,
                 cost) -> list[Row]:
    """The model's rows of a case: `cost(cluster)` -> (weft µs, baseline µs) for each layout and NCCL on one node."""
    rows = []
    for local in layout_sizes:
        cluster = model.Cluster(world_size // local, local, links(world_size))
        rows.append(Row(SUITE, case, f"model {_label(local, world_size)}", cost(cluster)[0] / 1e3, 0.0, nbytes,
                        world_size, view))
    if _machine_ranks(world_size) == world_size:  # NCCL on one node: no link between nodes in its prediction
        rows.append(Row(SUITE, case, f"model {baseline} ring", cost(model.Cluster(1, world_size))[1] / 1e3, 0.0,
                        nbytes, world_size, view))
    return rows


def _views(args) -> tuple[str, ...]:
    return ("graph", "eager") if args.view == "both" else (args.view,)


def run(args) -> list[Row]:
    world_size = weft.world().world_size
    layout_sizes = layouts(args, world_size)
    shapes = gemm_shapes(args)
    ops = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(ops) - set(COLLECTIVES + GEMM_OPS))
    if unknown:
        raise ValueError(f"--ops: unknown {unknown}; choose from {', '.join(COLLECTIVES + GEMM_OPS)}")
    sizes = sweep.sizes(args, factor=4)
    baseline_layout = max(layout_sizes)  # the process group's own, timed once: in the single-node world if any
    rows = []
    for local in layout_sizes:
        w = _restart(local)
        baseline = dist.get_backend(w.group)
        gpu = w.device.type == "cuda"
        with_baseline = local == baseline_layout
        sweep.note(f"{_label(local, world_size)}: nodes {[list(n) for n in w.nodes]}")
        for op in (o for o in COLLECTIVES if o in ops):
            for size in sizes:
                if size // 2 // world_size == 0:
                    continue
                impls = _collective(w, op, size, baseline, with_baseline)
                for row in sweep.time_impls(SUITE, impls, set(impls), size, size, 1.0, args):
                    row.case = f"{op} {human_bytes(size)}"
                    rows.append(row)
        for op in (o for o in GEMM_OPS if o in ops):
            for m, k, n in shapes:
                impls = _gemm(w, op, m, k, n, baseline, with_baseline)
                flops = 2 * world_size * m * k * n
                for view in _views(args):
                    times = time_calls(impls, calls=3 if gpu else 1, samples=args.samples, warmup=3 if gpu else 1,
                                       graph=gpu and view == "graph")
                    rows += [Row(SUITE, _gemm_case(op, m, k, n, baseline), name, ms, 0.0, flops, world_size, view)
                             for name, ms in times.items()]
                    weft.barrier()
        weft.barrier()
    baseline = dist.get_backend(weft.world().group)
    rows += _model_rows(args, world_size, layout_sizes, sizes, shapes, ops, baseline)
    return _ordered(rows, world_size, layout_sizes, baseline)


def _gemm_case(op: str, m: int, k: int, n: int, baseline: str) -> str:
    parts = "all_gather, then torch.matmul" if op == "ag_gemm" else "torch.matmul, then reduce_scatter"
    return f"{op} {m}×{k}×{n} per rank ({baseline}: {parts})"


def _model_rows(args, world_size, layout_sizes, sizes, shapes, ops, baseline) -> list[Row]:
    rows = []
    for view in _views(args):
        for op in (o for o in COLLECTIVES if o in ops):
            for size in sizes:
                if size // 2 // world_size == 0:
                    continue
                rows += _predictions(f"{op} {human_bytes(size)}", size, view, world_size, layout_sizes, baseline,
                                     lambda c, op=op, size=size: (model.weft_cost(op, size, c).us,
                                                                  model.nccl_ring_cost(op, size, c).us))
        for op in (o for o in GEMM_OPS if o in ops):
            for m, k, n in shapes:
                rows += _predictions(_gemm_case(op, m, k, n, baseline), 2 * world_size * m * k * n, view, world_size,
                                     layout_sizes, baseline,
                                     lambda c, op=op, m=m, k=k, n=n: (
                                         model.gemm_cost(op, world_size * m, k, n, c).us,
                                         model.gemm_cost(op, world_size * m, k, n, c).baseline_us))
    return rows


def _ordered(rows: list[Row], world_size: int, layout_sizes: list[int], baseline: str) -> list[Row]:
    """Rows in report order: per view, cases as run; columns: the layouts across nodes (fewest ranks per node
    first), the single node, the process group's own, then each one's prediction."""
    labels = [_label(local, world_size) for local in sorted(layout_sizes)]
    impl_rank = {name: i for i, name in enumerate(labels + [baseline] + [f"model {lab}" for lab in labels] +
                                                  [f"model {baseline} ring"])}
    views = list(dict.fromkeys(r.view for r in rows))
    cases = list(dict.fromkeys(r.case for r in rows))

    def key(r: Row):
        impl = r.impl.removesuffix(" (eager)")
        return views.index(r.view), cases.index(r.case), impl_rank.get(impl, len(impl_rank)), r.impl

    return sorted(rows, key=key)


def meta(args) -> dict:
    """The report's notes: the layouts, the model's links between nodes, what each row is."""
    w = weft.world()
    net = links(w.world_size)
    return {
        "layouts": ", ".join(f"{_label(s, w.world_size)} ({w.world_size // s} node{'s' * (s < w.world_size)} of {s})"
                             for s in layouts(args, w.world_size)),
        "rows": "weft A×B: the op on A simulated nodes of B ranks (hierarchical: the node's kernels, the rail's "
                + ("NCCL" if w.device.type == "cuda" else "simulated network") + " between nodes); single node: the "
                "op on one node; collectives method auto (weft's choice per size, NCCL where the tuning table says "
                "so, inside a node as on one), ag_gemm / gemm_rs method overlap; an impl marked (eager) could not be "
                "captured in a CUDA graph",
        "model": f"weft/bench/model.py; links between nodes: {net.name}: {net.gbps:g} GB/s per direction at "
                 f"{net.efficiency:.0%}, {net.step_us:g} µs per rail step, NCCL's {net.nccl_steps} step latencies; "
                 f"NVLink inside a node {model.NVLINK_GBPS:g} GB/s at {model.NVLINK_EFFICIENCY:.0%}, "
                 f"{model.NVLINK_PHASE_US:g} µs per phase; GEMM at {model.GEMM_TFLOPS:g} TFLOP/s",
        "heap": "heap_used_bytes: the last layout's world",
    }
