"""What the reduction suites share: options and size sweep, inputs, the check against the process
group's collective, torch's symmetric-memory baselines, and the timing of every implementation in two
views: CUDA-graph replay (every implementation) and eager back-to-back calls (those on plain tensors)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft.testing.reference import all_gather_ref, reduce_scatter_ref

from .report import Row, human_bytes
from .timing import cycling, time_calls

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Against NCCL, which may round to the dtype after every partial sum where weft rounds once.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}
ROTATE = 4  # input sets cycled through, so repeated calls don't all hit in L2
ONE_SHOT_MAX_BYTES = 8 << 20  # one-shot reads W x the data: not timed above this
TORCH_SYMM_DTYPES = (torch.bfloat16, torch.float32)  # what torch's symm_mem kernels dispatch on
FOCUS = "weft auto"  # the row the markdown compares with the baseline in every view (plain output)


def add_arguments(p, what: str) -> None:
    p.add_argument("--min-bytes", type=int, default=4 << 10, help=f"smallest {what}")
    p.add_argument("--max-bytes", type=int, default=256 << 20, help=f"largest {what} (powers of 2 from the smallest)")
    p.add_argument("--samples", type=int, default=50, help="timed samples per implementation, size and view")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--view", choices=("graph", "eager", "both"), default="both",
                   help="CUDA-graph replay of every implementation, eager back-to-back calls of those on plain "
                        "tensors, or both")


def sizes(args, factor: int = 2) -> list[int]:
    """--min-bytes to --max-bytes, each `factor` times the one before."""
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        raise ValueError(f"need 1 <= --min-bytes <= --max-bytes, got {args.min_bytes} and {args.max_bytes}")
    out, size = [], args.min_bytes
    while size <= args.max_bytes:
        out.append(size)
        size *= factor
    return out


def note(text: str) -> None:
    if weft.rank() == 0:
        print(f"note: {text}", flush=True)


def inputs(n: int, dtype: torch.dtype, sets: int = ROTATE) -> list[torch.Tensor]:
    """`sets` inputs of n elements, different on every rank (seeded by rank: torch's default seed is the same
    in every process). randn / W keeps sums near unit scale, so rounding differences stay inside TOLERANCE."""
    w = weft.world()
    gen = torch.Generator(device=w.device).manual_seed(1 + w.rank)
    return [(torch.randn(n, device=w.device, generator=gen) / w.world_size).to(dtype) for _ in range(sets)]


def check(name: str, got: torch.Tensor, ref: torch.Tensor, baseline: str, size: int) -> None:
    tol = TOLERANCE[ref.dtype]
    try:
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    except AssertionError as e:
        raise RuntimeError(f"{name}: mismatch against {baseline} at {human_bytes(size)}: {e}") from None


def gemm_shapes(text: str, form: str) -> list[tuple[int, int, int]]:
    """`--gemm-shapes`: comma-separated AxBxC of positive ints (`form` names the axes in the error)."""
    try:
        shapes = [tuple(int(d) for d in s.split("x")) for s in text.split(",") if s]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise ValueError(f"--gemm-shapes must be {form}, comma-separated, got {text!r}")
    return shapes


def collective_case(op: str, size: int, span: int, weft_group, pg, label: str, baseline: str):
    """(weft fn(i), baseline fn(i)) of all_reduce / all_gather / reduce_scatter on bf16 input set i at `size` bytes
    (the all_reduce tensor, the all_gather output, the reduce_scatter input) over `span` ranks: weft's op with
    group=`weft_group` (None: the world) into one output, the process group `pg`'s collective (all_reduce in
    place); weft's result checked against the baseline's first (all_gather bit for bit) before any timing."""
    dtype = torch.bfloat16
    n = size // dtype.itemsize // (1 if op == "all_reduce" else span)  # elements per rank's input (or shard)
    xs = inputs(n * (span if op == "reduce_scatter" else 1), dtype)
    dev = weft.device()
    if op == "all_reduce":
        ref = xs[0].clone()
        dist.all_reduce(ref, group=pg)
        in_place = [x.clone() for x in xs]
        out = torch.empty_like(ref)
        weft_fn = lambda i: weft.ops.all_reduce(xs[i], out=out, group=weft_group)  # noqa: E731
        base_fn = lambda i: dist.all_reduce(in_place[i], group=pg)  # noqa: E731
    elif op == "all_gather":
        ref = torch.empty(n * span, dtype=dtype, device=dev)
        all_gather_ref(ref, xs[0], pg)
        out = torch.empty_like(ref)
        weft_fn = lambda i: weft.ops.all_gather(xs[i], out=out, group=weft_group)  # noqa: E731
        base_fn = lambda i: all_gather_ref(out, xs[i], pg)  # noqa: E731
    else:
        ref = torch.empty(n, dtype=dtype, device=dev)
        reduce_scatter_ref(ref, xs[0], pg)
        out = torch.empty_like(ref)
        weft_fn = lambda i: weft.ops.reduce_scatter(xs[i], out=out, group=weft_group)  # noqa: E731
        base_fn = lambda i: reduce_scatter_ref(out, xs[i], pg)  # noqa: E731
    out.fill_(float("nan"))
    got = weft_fn(0)
    if op == "all_gather":  # pure data movement: bit for bit
        if not torch.equal(got, ref):
            raise RuntimeError(f"{label}: all_gather mismatch against {baseline} at {human_bytes(size)}")
    else:
        check(label, got, ref, baseline, size)
    return weft_fn, base_fn


def torch_symm_op(name: str, dtype: torch.dtype):
    """torch.ops.symm_mem.<name>, or None (with a note) where it cannot run here."""
    if weft.device().type != "cuda":
        note(f"torch.ops.symm_mem.{name} runs on cuda only: skipped")
        return None
    op = getattr(torch.ops.symm_mem, name, None)
    if op is None:
        note(f"torch {torch.__version__} has no torch.ops.symm_mem.{name}: skipped")
        return None
    if dtype not in TORCH_SYMM_DTYPES:
        note(f"torch.ops.symm_mem.{name} has no {dtype} kernel: skipped")
        return None
    return op


def symm_copies(xs: list[torch.Tensor]) -> torch.Tensor:
    """The inputs copied, one per row, into one allocation of torch's symmetric memory (torch's allocator,
    not weft's heap), rendezvoused: what torch's symm_mem ops read their peers' data from. Row i is a
    1-D view at a 16-byte-aligned offset, which the ops accept."""
    import torch.distributed._symmetric_memory as symm_mem

    w = weft.world()
    buf = symm_mem.empty(len(xs), xs[0].numel(), dtype=xs[0].dtype, device=w.device)
    symm_mem.rendezvous(buf, w.group.group_name)
    for row, x in zip(buf, xs):
        row.copy_(x)
    return buf


def time_impls(suite: str, impls: dict, plain: set, size: int, nbytes: int, bus_factor: float, args) -> list[Row]:
    """One row per implementation and view of args.view: `impls[name](i)` runs it on input set i; `plain`
    names those on plain tensors. View "graph": every impl, its calls replayed from a CUDA graph (NCCL,
    weft and torch's symm_mem ops all capture). View "eager": the plain ones, called back to back (what a
    program that does not capture sees, host cost included). GB/s = bus_factor * nbytes / time."""
    w = weft.world()
    gpu = w.device.type == "cuda"
    # >= ROTATE: a replay cycles through every input set. Few calls at large sizes keep a run of the suite
    # to 256 MiB at 20 samples under 2 minutes.
    calls = 20 if nbytes < (1 << 20) else ROTATE
    if not gpu:
        calls = 1  # the interpreter is slow; the cpu backend checks the harness, not speed
    rows = []
    for view in ("graph", "eager") if args.view == "both" else (args.view,):
        steps = {name: cycling(f, ROTATE) for name, f in impls.items() if view == "graph" or name in plain}
        times = time_calls(steps, calls=calls, samples=args.samples, warmup=5 if gpu else 1,
                           graph=gpu and view == "graph")
        rows += [Row(suite, human_bytes(size), name, ms, bus_factor * nbytes / ms / 1e6, nbytes, w.world_size, view)
                 for name, ms in times.items()]
        weft.barrier()
    return rows
