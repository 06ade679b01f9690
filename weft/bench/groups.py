"""groups: the collectives and overlapped GEMMs on groups of N/2 ranks against the process group's own on the same
groups, and the same op on the world as a reference (what a group costs, or gains, against the world).

Layouts at N ranks (N even): "consecutive", groups of N/2 consecutive ranks ([0, 1], [2, 3] on 4), the TP groups of
a DP job; and, at N >= 4, "strided", every other rank ([0, 2], [1, 3]). Every group of a layout runs its op at the
same time, as the TP groups of a DP job do. The groups are made with weft.new_group, and beside them the process
group's own subgroups (torch.distributed.new_group) for the baseline; every rank makes every group, in one order.

Ops: all_reduce, all_gather and reduce_scatter (bf16, method auto) at --sizes (size: the all_reduce tensor, the
all_gather output, the reduce_scatter input, per rank, as the reduction suites); ag_gemm and gemm_rs (--gemm-method,
default overlap) at --gemm-shapes, M × N × K tensor-parallel MLP shapes split over the group of G = N/2: ag_gemm
(the up projection) gathers A (M, K) from shards of M / G rows onto a B shard (K, N / G); gemm_rs (the down
projection) multiplies A (M, N / G) by a B shard (N / G, K) and scatters M / G rows of the sum.

Rows (the markdown's columns): "weft, group of G" (the op with group=); the process group's own on the same
subgroups, "nccl, group of G" (all_reduce, all_gather_into_tensor, reduce_scatter_tensor; for the GEMM ops the
collective and torch.matmul in turn), the baseline; "reference: weft, world of N", the op over the whole world at
the same per-rank sizes (the same all_reduce tensor, all_gather output and reduce_scatter input; the same gathered A
and B shard of ag_gemm, whose shards are then M / N rows; the same A and B shard of gemm_rs, which then scatters
M / N rows). At the world the op spans N ranks, so that row is a reference, not a baseline; it is timed with the
consecutive layout's cases only (the same op on the same world for both layouts). Every result is checked against
the process group's on the same ranks before timing: all_gather bit for bit, the reductions within a tolerance.

Two views (--view), as the other suites: CUDA-graph replay and eager back-to-back calls; medians of the slowest
rank (weft.bench.timing). On GPUs the world's heap and each group's (made on the group's first use) are HEAP_SIZE
per rank: three heaps with both layouts. The bracketed figure is left out (the report mixes sizes and GEMM shapes);
the JSON's gbps holds the bus bandwidth of the collectives' rows (nccl-tests' factors at the op's own group size), 0
for the GEMM ops'.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft.testing.reference import all_gather_ref, reduce_scatter_ref

from . import sweep
from .report import Row, human_bytes
from .timing import cycling, time_calls

SUITE = "groups"
BANDWIDTH = None  # µs only: the cases are sizes and GEMM shapes
RIVAL = "reference"  # the markdown's "best weft vs best reference": world time / group time (above 1: the group wins)
# ag_gemm's gathered A (M × K) and gemm_rs's partials (M × K) at the default shape are 64 MiB each, on the group
# and the world alike; with room to spare. HEAP_SIZE is the world's heap and each group's (3 heaps per rank).
WORKSPACE_BYTES = str(512 << 20)
HEAP_SIZE = "6GiB"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
GEMM_OPS = ("ag_gemm", "gemm_rs")
GEMM_TOLERANCE = 2e-2  # relative (Frobenius) error against the process group's collective and torch.matmul
ROTATE = sweep.ROTATE


def add_arguments(p) -> None:
    p.add_argument("--ops", default=",".join(COLLECTIVES + GEMM_OPS),
                   help=f"comma-separated subset of {', '.join(COLLECTIVES + GEMM_OPS)} (default: all)")
    p.add_argument("--sizes", default="64KiB,1MiB,16MiB,64MiB",
                   help="the collectives' sizes per rank, comma-separated (bytes; KiB, MiB suffixes)")
    p.add_argument("--gemm-shapes", default="8192x14336x4096",
                   help="the GEMM ops' tensor-parallel shapes M x N x K (tokens, intermediate, hidden), "
                        "comma-separated; N is split over the group")
    p.add_argument("--gemm-method", choices=("overlap", "auto"), default="overlap",
                   help="method of ag_gemm and gemm_rs (default overlap)")
    p.add_argument("--samples", type=int, default=20, help="timed samples per implementation, case and view")
    p.add_argument("--view", choices=("graph", "eager", "both"), default="both",
                   help="CUDA-graph replay, eager back-to-back calls, or both")


UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def _size(text: str) -> int:
    """4096, 64KiB, 1MiB -> bytes (ValueError on anything else)."""
    text = text.strip().upper()
    unit = next((u for u in UNITS if text.endswith(u)), None)
    return int(text[:-len(unit)]) * UNITS[unit] if unit else int(text)


def _sizes(args) -> list[int]:
    try:
        sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sizes must be positive byte counts (KiB, MiB, GiB suffixes), comma-separated, got "
                         f"{args.sizes!r}")
    return sizes


def _gemm_shapes(args, world_size: int, group_size: int) -> list[tuple[int, int, int]]:
    shapes = sweep.gemm_shapes(args.gemm_shapes, "MxNxK")
    for m, n, k in shapes:  # the world reference's shards are M / world rows
        if m % world_size or n % group_size:
            raise ValueError(f"--gemm-shapes: {m}x{n}x{k} needs M divisible by the world size {world_size} and N "
                             f"by the group size {group_size}")
    return shapes


def layouts(world_size: int) -> dict[str, list[list[int]]]:
    """{layout: its groups' world ranks}: consecutive halves, and every other rank where N >= 4."""
    if world_size < 2 or world_size % 2:
        raise ValueError(f"weft bench groups needs an even number of ranks (groups of N/2), got {world_size}")
    half = world_size // 2
    found = {"consecutive": [list(range(first, first + half)) for first in range(0, world_size, half)]}
    if world_size >= 4:
        found["strided"] = [list(range(start, world_size, 2)) for start in range(2)]
    return found


def _make_groups(found: dict) -> dict[str, tuple]:
    """{layout: (this rank's weft Group, its torch ProcessGroup)}. Collective over the world: every rank makes every
    group of every layout, in the same order."""
    mine = {}
    for name, groups in found.items():
        for ranks in groups:
            weft_group = weft.new_group(ranks)
            pg = dist.new_group(ranks)
            if weft.rank() in ranks:
                mine[name] = (weft_group, pg)
    return mine


def _bus_factor(op: str, size: int) -> float:
    """nccl-tests' bus bandwidth factor of `op` over `size` ranks."""
    return (2 if op == "all_reduce" else 1) * (size - 1) / size


def _collective(op: str, size: int, weft_group, pg, span: int, label: str):
    """(weft fn(i), baseline fn(i)) of `op` at `size` bytes per rank over `span` ranks (weft_group, pg: the same
    ranks; None, the world's group: the world), weft's checked against the baseline's."""
    return sweep.collective_case(op, size, span, weft_group, pg, label, "the process group's")


def _gemm(op: str, shape: tuple[int, int, int], group_size: int, weft_group, pg, span: int, method: str,
          label: str):
    """(weft fn(), baseline fn()) of `op` on the TP shape split over a group of `group_size`, run over `span` ranks
    at the same per-rank sizes (weft_group, pg: those ranks), weft's checked against the baseline's."""
    big_m, big_n, big_k = shape
    n_shard = big_n // group_size
    dev = weft.device()
    gen = torch.Generator(device=dev).manual_seed(7 + weft.rank())
    if op == "ag_gemm":  # shard (M / span, K) @ (K, N / G), gathered to (M, N / G)
        a = torch.randn(big_m // span, big_k, device=dev, generator=gen).to(torch.bfloat16)
        b = (torch.randn(big_k, n_shard, device=dev, generator=gen) / big_k ** 0.5).to(torch.bfloat16)
        gathered = torch.empty(big_m, big_k, dtype=a.dtype, device=dev)
        out, ref = (torch.empty(big_m, n_shard, dtype=a.dtype, device=dev) for _ in range(2))

        def base_fn():
            all_gather_ref(gathered, a, pg)
            return torch.matmul(gathered, b, out=ref)

        weft_fn = lambda: weft.ops.ag_gemm(a, b, method=method, out=out, group=weft_group)  # noqa: E731
    else:  # (M, N / G) @ (N / G, K), rows [r M / span, (r + 1) M / span) of the sum
        a = torch.randn(big_m, n_shard, device=dev, generator=gen).to(torch.bfloat16)
        b = (torch.randn(n_shard, big_k, device=dev, generator=gen) / big_n ** 0.5).to(torch.bfloat16)
        partial = torch.empty(big_m, big_k, dtype=a.dtype, device=dev)
        out, ref = (torch.empty(big_m // span, big_k, dtype=a.dtype, device=dev) for _ in range(2))

        def base_fn():
            torch.matmul(a, b, out=partial)
            reduce_scatter_ref(ref, partial, pg)
            return ref

        weft_fn = lambda: weft.ops.gemm_rs(a, b, method=method, out=out, group=weft_group)  # noqa: E731
    want = base_fn().float()
    out.fill_(float("nan"))
    got = weft_fn().float()
    err = ((got - want).norm() / want.norm()).item()
    if not err < GEMM_TOLERANCE:
        raise RuntimeError(f"{label}: relative error {err:.2e} against the process group's collective + torch.matmul")
    return weft_fn, base_fn


def _names(world_size: int, baseline: str) -> tuple[str, str, str]:
    """(weft on the group, the baseline on the group, weft on the world): the markdown's columns."""
    half = world_size // 2
    return f"weft, group of {half}", f"{baseline}, group of {half}", f"reference: weft, world of {world_size}"


def baseline_impl(args) -> str:
    """The row the markdown compares weft's with: the process group's own on the same group."""
    w = weft.world()
    return _names(w.world_size, dist.get_backend(w.group))[1]


def _time(case: str, impls: dict, factors: dict, nbytes: int, calls: int, args) -> list[Row]:
    """Rows of impls {name: fn()} in each view, `calls` back-to-back calls a sample; gbps = factors[name] * nbytes /
    time (0 without a factor)."""
    w = weft.world()
    gpu = w.device.type == "cuda"
    calls = calls if gpu else 1  # the interpreter is slow; the cpu backend checks the harness, not speed
    rows = []
    for view in ("graph", "eager") if args.view == "both" else (args.view,):
        times = time_calls(impls, calls=calls, samples=args.samples, warmup=5 if gpu else 1,
                           graph=gpu and view == "graph")
        for name, ms in times.items():
            factor = factors.get(name.removesuffix(" (eager)"), 0.0)
            rows.append(Row(SUITE, case, name, ms, factor * nbytes / ms / 1e6, nbytes, w.world_size, view))
        weft.barrier()
    return rows


def run(args) -> list[Row]:
    w = weft.world()
    world_size = w.world_size
    found = layouts(world_size)
    group_size = world_size // 2
    ops = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(ops) - set(COLLECTIVES + GEMM_OPS))
    if unknown:
        raise ValueError(f"--ops: unknown {unknown}; choose from {', '.join(COLLECTIVES + GEMM_OPS)}")
    sizes = _sizes(args)
    shapes = _gemm_shapes(args, world_size, group_size)
    baseline = dist.get_backend(w.group)
    weft_name, base_name, world_name = _names(world_size, baseline)
    mine = _make_groups(found)
    for name, groups in found.items():
        sweep.note(f"{name}: groups {groups}")
    first = next(iter(found))  # the layout whose cases also time the world reference
    rows = []
    for op in (o for o in COLLECTIVES if o in ops):
        for size in sizes:
            if size // 2 // world_size == 0:  # the world's all_gather shard: at least one element
                continue
            for layout, (weft_group, pg) in mine.items():
                case = f"{op} {human_bytes(size)}, {layout}"
                weft_fn, base_fn = _collective(op, size, weft_group, pg, group_size, case)
                impls = {weft_name: weft_fn, base_name: base_fn}
                factors = dict.fromkeys(impls, _bus_factor(op, group_size))
                if layout == first:
                    impls[world_name] = _collective(op, size, None, w.group, world_size, f"{case} (world)")[0]
                    factors[world_name] = _bus_factor(op, world_size)
                calls = 20 if size < (1 << 20) else ROTATE  # >= ROTATE: a replay cycles through every input set
                rows += _time(case, {k: cycling(f, ROTATE) for k, f in impls.items()}, factors, size, calls, args)
    for op in (o for o in GEMM_OPS if o in ops):
        for shape in shapes:
            for layout, (weft_group, pg) in mine.items():
                parts = "all_gather, then torch.matmul" if op == "ag_gemm" else "torch.matmul, then reduce_scatter"
                case = f"{op} {'×'.join(map(str, shape))}, {layout} ({baseline}: {parts})"
                impls = dict(zip((weft_name, base_name), _gemm(op, shape, group_size, weft_group, pg, group_size,
                                                               args.gemm_method, case)))
                if layout == first:
                    impls[world_name] = _gemm(op, shape, group_size, None, w.group, world_size, args.gemm_method,
                                              f"{case} (world)")[0]
                flops = 2 * shape[0] * (shape[1] // group_size) * shape[2]  # per rank, the same at the world
                rows += _time(case, impls, {}, flops, 3, args)
    return _ordered(rows)


def _ordered(rows: list[Row]) -> list[Row]:
    """Per view, the cases as run (the views' tables are apart in the markdown)."""
    views = list(dict.fromkeys(r.view for r in rows))
    return sorted(rows, key=lambda r: views.index(r.view))


def meta(args) -> dict:
    """The report's notes: the layouts and what each row is."""
    w = weft.world()
    baseline = dist.get_backend(w.group)
    weft_name, base_name, world_name = _names(w.world_size, baseline)
    return {
        "layouts": "; ".join(f"{name}: {groups}" for name, groups in layouts(w.world_size).items()) +
                   " (every group runs its op at the same time)",
        "rows": f"{weft_name}: the op with group= (collectives method auto, ag_gemm / gemm_rs method "
                f"{args.gemm_method}); {base_name}: the process group's own on the same ranks (the GEMM ops: the "
                f"collective and torch.matmul in turn), the baseline; {world_name}: the op over all "
                f"{w.world_size} ranks at the same per-rank sizes, timed with the first layout's cases only. At the "
                f"world the op spans {w.world_size} ranks, not {w.world_size // 2}: a reference, not a baseline "
                "(\"best weft vs best reference\": world time / group time, above 1 the group is faster); an impl "
                "marked (eager) could not be captured in a CUDA graph",
        "sizes": "collectives: bytes per rank of the all_reduce tensor, the all_gather output, the reduce_scatter "
                 "input; GEMM ops: M×N×K, N split over the group (ag_gemm: (M / G, K) shards @ (K, N / G); gemm_rs: "
                 "(M, N / G) @ (N / G, K) to M / G rows)",
    }
