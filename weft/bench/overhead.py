"""overhead: what a call of every op costs a program that calls it eagerly, against NCCL and torch's symm_mem ops.

Two views of every (op, size, implementation), in one run:
- host: CPU time to issue one call: time.perf_counter around `--calls` calls issued back to back, over the
  calls. On GPUs the calls queue behind a torch.cuda._sleep kernel that outlasts the loop, so the figure is
  the host's cost of issuing them, not the device's time (timing.issue_times).
- eager: the same back-to-back calls, CUDA events around the batch (timing.time_calls, no graph): what a
  program that does not capture sees, the larger of host and device time per call.
Implementations: weft (method "auto", plain tensors, out=None: `y = weft.ops.all_reduce(x)`); "weft group": the
same call over a group of every rank made by weft.new_group (what passing a group costs); the process
group's collective as programs call it ("nccl"; gloo on the cpu backend: all_reduce, broadcast in place,
all_gather_into_tensor / reduce_scatter_tensor into an output, a one-element all_reduce for the barrier;
for the GEMM ops torch.matmul and that collective); torch's symm_mem op where one exists (GPUs only, its
input in torch symmetric memory as it requires): "torch one_shot" / "torch two_shot" (all_reduce), "torch
symm_mem" (reduce_scatter_out, fused_all_gather_matmul, fused_matmul_reduce_scatter, matmul + one_shot for
gemm_ar). Anchors ("anchor"): a bare @triton.jit launch of 10 arguments, and the CUDA-graph replay of one
weft all_reduce (GPUs only).
Sizes: collectives at 8 KiB and 1 MiB bf16 per rank (x's bytes: all_gather's shard, reduce_scatter's
whole input), and 64 MiB in the eager view only; ag_gemm and gemm_rs on the TP shapes 4096x14336x4096
and 4096x4096x14336 and the same at M=128, gemm_ar at M=1 and 16 with N=5120, K=25600 (cut for the
world size as in the gemm suite); flash_decode at batch 8 over 4K positions against torch's SDPA, and
sp_flash_decode at batch 1 over 8K positions per rank against flash_decode + the process group's all_gather
+ a torch merge (Llama-3-8B heads). Every result is checked against the baseline's before timing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import weft
from weft.testing.graphs import capture
from weft.testing.reference import all_gather_ref, reduce_scatter_ref

from . import gemm, sweep
from .attention import lse_merge, sdpa_decode
from .reducescatter import TORCH_WORLD_SIZES
from .report import Row, human_bytes
from .timing import issue_times, time_calls

SUITE = "overhead"
BANDWIDTH = None  # cells are µs only
RIVAL = "torch"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "device_barrier", "ag_gemm", "gemm_rs", "gemm_ar",
       "flash_decode", "sp_flash_decode")
SIZES, EAGER_SIZES = (8 << 10, 1 << 20), (64 << 20,)
GEMM_SHAPES = {"ag_gemm": [(4096, 14336, 4096), (128, 14336, 4096)],
               "gemm_rs": [(4096, 4096, 14336), (128, 4096, 14336)],
               "gemm_ar": [(1, 5120, 25600), (16, 5120, 25600)]}
CALLS, SAMPLES = 300, 20
# A GEMM op issues up to 2W + 3 operations a call (pushes, flags, GEMM) and a stream queues ~1000 before a
# launch blocks; a 64 MiB message runs for most of a millisecond: these get a tenth of the calls.
FEWER = 10
# --quick: a check of the harness (the cpu backend's interpreter runs a call in ~50 ms), not a measurement.
QUICK = dict(sizes=(256, 1 << 10), eager_sizes=(4 << 10,), scale=64, calls=2, samples=2)


def add_arguments(p) -> None:
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ", ".join(OPS))
    p.add_argument("--calls", type=int, default=None, help=f"calls per sample (default {CALLS}; GEMMs and 64 MiB "
                   f"messages a {FEWER}th of it)")
    p.add_argument("--samples", type=int, default=None, help=f"samples per implementation and view (default {SAMPLES})")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 calls, 2 samples: checks the harness (cpu)")


@triton.jit
def ten_args_kernel(p0, p1, p2, p3, p4, n0, n1, n2, n3, n4):
    """Ten arguments, one store: a launch that costs what launching costs."""
    tl.store(p0, n0 + n1 + n2 + n3 + n4)


@dataclass
class Case:
    label: str
    impls: dict              # name -> fn() returning what is checked against the baseline's result (None: nothing)
    nbytes: int = 0
    views: tuple = ("host", "eager")
    fewer: bool = False      # a FEWER-th of the calls
    gemm: bool = False       # checked by relative error (rounding in long sums), not element-wise


def _collective(op: str, size: int, w, baseline: str, views, same) -> Case:
    """op on a message of `size` bytes per rank. Each impl returns its result (torch.distributed's calls
    return None: `or out`). "weft group": the same call with group=`same`, a group of every rank made by
    weft.new_group (what a group costs beside the world)."""
    dtype = torch.bfloat16
    n = size // dtype.itemsize // w.world_size * w.world_size  # reduce_scatter: rows divisible by W
    x = sweep.inputs(n, dtype, sets=1)[0]
    mine, ref = x.clone(), x.clone()  # in place: weft's broadcast, NCCL's all_reduce and broadcast
    group, name = w.group, w.group.group_name
    if op == "all_reduce":
        impls = {"weft": lambda: weft.ops.all_reduce(x),
                 baseline: lambda: dist.all_reduce(ref, group=group) or ref}
        one_shot = sweep.torch_symm_op("one_shot_all_reduce", dtype)
        two_shot = sweep.torch_symm_op("two_shot_all_reduce_", dtype)
        if one_shot is not None:
            symm_in = sweep.symm_copies([x])[0]
            impls["torch one_shot"] = lambda: one_shot(symm_in, "sum", name)
        if two_shot is not None:
            symm_inout = sweep.symm_copies([x])[0]
            impls["torch two_shot"] = lambda: two_shot(symm_inout, "sum", name)
    elif op == "all_gather":
        out = torch.empty(w.world_size * n, dtype=dtype, device=w.device)
        impls = {"weft": lambda: weft.ops.all_gather(x), baseline: lambda: all_gather_ref(out, x, group) or out}
    elif op == "reduce_scatter":
        out, torch_out = (torch.empty(n // w.world_size, dtype=dtype, device=w.device) for _ in range(2))
        impls = {"weft": lambda: weft.ops.reduce_scatter(x), baseline: lambda: reduce_scatter_ref(out, x, group) or out}
        torch_rs = sweep.torch_symm_op("reduce_scatter_out", dtype)
        aligned = n % (w.world_size * 16 // dtype.itemsize) == 0  # what its kernels take
        if torch_rs is not None and w.world_size in TORCH_WORLD_SIZES and aligned:
            symm_in = sweep.symm_copies([x])[0]
            impls["torch symm_mem"] = lambda: torch_rs(symm_in, name, False, torch_out)
    else:  # broadcast
        impls = {"weft": lambda: weft.ops.broadcast(mine), baseline: lambda: dist.broadcast(ref, 0, group=group) or ref}
    impls["weft group"] = {"all_reduce": lambda: weft.ops.all_reduce(x, group=same),
                           "all_gather": lambda: weft.ops.all_gather(x, group=same),
                           "reduce_scatter": lambda: weft.ops.reduce_scatter(x, group=same),
                           "broadcast": lambda: weft.ops.broadcast(mine, group=same)}[op]
    return Case(f"{op} {human_bytes(size)}", impls, n * dtype.itemsize, views, fewer=size > SIZES[-1])


def _gemm(op: str, shape, w, baseline: str, scale: int, same) -> Case:
    m, n, k = gemm.local_shape({"ag_gemm": "ag", "gemm_rs": "rs", "gemm_ar": "ar"}[op], *shape, w.world_size, scale)
    dev, group, name = w.device, w.group, w.group.group_name
    a = torch.randn(m, k, device=dev).to(torch.bfloat16)
    b = (torch.randn(k, n, device=dev) / (k * w.world_size) ** 0.5).to(torch.bfloat16)
    if op == "ag_gemm":
        g = torch.empty(w.world_size * m, k, dtype=a.dtype, device=dev)
        impls = {"weft": lambda: weft.ops.ag_gemm(a, b),
                 baseline: lambda: all_gather_ref(g, a, group) or torch.matmul(g, b)}
        fused = sweep.torch_symm_op("fused_all_gather_matmul", a.dtype)
        if fused is not None:
            impls["torch symm_mem"] = lambda: fused(a, [b], 0, name, return_A=False)[1][0]
    elif op == "gemm_rs":
        out = torch.empty(m // w.world_size, n, dtype=a.dtype, device=dev)
        impls = {"weft": lambda: weft.ops.gemm_rs(a, b),
                 baseline: lambda: reduce_scatter_ref(out, torch.matmul(a, b), group) or out}
        fused = sweep.torch_symm_op("fused_matmul_reduce_scatter", a.dtype)
        if fused is not None:
            impls["torch symm_mem"] = lambda: fused(a, b, "sum", 0, name)
    else:  # gemm_ar
        def nccl():
            p = torch.matmul(a, b)
            dist.all_reduce(p, group=group)
            return p

        impls = {"weft": lambda: weft.ops.gemm_ar(a, b), baseline: nccl}
        one_shot = sweep.torch_symm_op("one_shot_all_reduce", a.dtype)
        if one_shot is not None:
            from torch.distributed import _symmetric_memory as symm_mem

            ps = symm_mem.empty((m, n), dtype=a.dtype, device=dev)
            symm_mem.rendezvous(ps, name)
            impls["torch symm_mem"] = lambda: one_shot(torch.matmul(a, b, out=ps), "sum", name)
    impls["weft group"] = lambda: getattr(weft.ops, op)(a, b, group=same)
    M, N, K = shape
    return Case(f"{op} {M}x{N}x{K} (per rank {m}x{n}x{k})", impls, 2 * m * n * k, fewer=True, gemm=True)


def _attention(op: str, w, baseline: str, scale: int) -> Case:
    """Decode attention with Llama-3-8B's heads (32 / 8, head_dim 128, bf16): flash_decode at batch 8 over
    4K positions against torch's scaled_dot_product_attention; sp_flash_decode at batch 1 over 8K positions
    per rank against flash_decode's partials gathered by the process group and merged by torch."""
    dev = w.device
    batch, length = (8, 4096) if op == "flash_decode" else (1, 8192)
    heads, kv_heads, d = 32, 8, 128
    if scale > 1:  # --quick: the interpreter's scale
        batch, length, heads, kv_heads, d = 1, length // scale, 4, 2, 64
    gen = torch.Generator(device=dev).manual_seed(11)  # the same q everywhere
    q = torch.randn(batch, heads, d, device=dev, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(batch, length, kv_heads, d, device=dev).to(torch.bfloat16) for _ in range(2))
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    kv_bytes = 2 * k.numel() * k.element_size()
    if op == "flash_decode":
        impls = {"weft": lambda: weft.ops.flash_decode(q, k, v, lens), "torch sdpa": lambda: sdpa_decode(q, k, v)}
        return Case(f"flash_decode b{batch} kv{length}", impls, kv_bytes, gemm=True)
    mine = torch.empty(heads, d + 1, device=dev)
    gathered = torch.empty(w.world_size, heads, d + 1, device=dev)

    def process_group():
        out, lse = weft.ops.flash_decode(q, k, v, lens, return_lse=True)
        mine[:, :d], mine[:, d] = out[0], lse[0]
        all_gather_ref(gathered.view(-1), mine.view(-1), w.group)
        return lse_merge(gathered, d).to(q.dtype)[None]

    impls = {"weft": lambda: weft.ops.sp_flash_decode(q, k, v, lens), baseline: process_group}
    return Case(f"sp_flash_decode b1 kv{length} per rank", impls, kv_bytes, gemm=True)


def _anchors(w, size: int):
    t = torch.zeros(1, dtype=torch.int32, device=w.device)
    yield Case("bare @triton.jit launch, 10 args",
               {"anchor": lambda: ten_args_kernel[(1,)](t, t, t, t, t, 2, 3, 4, 5, 6)})
    if w.device.type != "cuda":
        sweep.note("the CUDA-graph replay anchor runs on cuda only: skipped")
        return
    x = sweep.inputs(size // 2, torch.bfloat16, sets=1)[0]
    weft.ops.all_reduce(x)  # its workspace is made outside capture
    g = capture(lambda: weft.ops.all_reduce(x), warmups=1)
    yield Case(f"CUDA graph replay of one call (weft all_reduce {human_bytes(size)})", {"anchor": g.replay})


def _cases(args, w, baseline):
    sizes, eager_sizes, scale = (QUICK["sizes"], QUICK["eager_sizes"], QUICK["scale"]) if args.quick else \
        (SIZES, EAGER_SIZES, 1)
    same = weft.new_group(range(w.world_size))  # every rank again, as a group of its own: the "weft group" rows
    for op in args.ops.split(","):
        if op not in OPS:
            raise ValueError(f"--ops: unknown op {op!r} (ops: {', '.join(OPS)})")
        if op == "device_barrier":
            one = torch.ones(1, device=w.device)
            yield Case(op, {"weft": weft.ops.device_barrier, "weft group": lambda: weft.ops.device_barrier(group=same),
                            baseline: lambda: dist.all_reduce(one, group=w.group)})
        elif op in ("flash_decode", "sp_flash_decode"):
            yield _attention(op, w, baseline, scale)
        elif op in GEMM_SHAPES:
            for shape in GEMM_SHAPES[op]:
                yield _gemm(op, shape, w, baseline, scale, same)
        else:
            for size in sizes:
                yield _collective(op, size, w, baseline, ("host", "eager"), same)
            for size in eager_sizes:
                yield _collective(op, size, w, baseline, ("eager",), same)
    yield from _anchors(w, sizes[0])


def _check(case: Case, baseline: str) -> None:
    """Every impl's result against the baseline's (or, where the process group has none, torch's), on the same
    inputs (this also creates weft's workspaces)."""
    baseline = baseline if baseline in case.impls else next((n for n in case.impls if n.startswith("torch")), None)
    ref = case.impls[baseline]() if baseline is not None else None
    if ref is None:
        return
    ref = ref.clone()
    for name, f in list(case.impls.items()):
        if name == baseline:
            continue
        try:
            got = f()
        except Exception as e:  # noqa: BLE001 - torch's ops do not take every shape; weft's must
            if not name.startswith("torch"):
                raise
            sweep.note(f"{case.label} {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}; skipped")
            del case.impls[name]
            continue
        if case.gemm:
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                raise RuntimeError(f"{case.label} {name}: relative error {err:.2e} against {baseline}")
        else:
            sweep.check(f"{case.label} {name}", got, ref, baseline, case.nbytes)


def run(args) -> list[Row]:
    w = weft.world()
    gpu = w.device.type == "cuda"
    baseline = dist.get_backend(w.group)  # "nccl" on GPUs, "gloo" on the cpu backend
    calls = args.calls or (QUICK["calls"] if args.quick else CALLS)
    samples = args.samples or (QUICK["samples"] if args.quick else SAMPLES)
    warmup = 5 if gpu else 1
    rows = []
    for case in _cases(args, w, baseline):
        _check(case, baseline)
        n = max(1, calls // FEWER) if case.fewer else calls
        times = {}
        if "host" in case.views:
            times["host"] = issue_times(case.impls, calls=n, samples=samples, warmup=warmup)
        times["eager"] = time_calls(case.impls, calls=n, samples=samples, warmup=warmup)
        for view, by_impl in times.items():
            rows += [Row(SUITE, case.label, impl, ms, 0.0, case.nbytes, w.world_size, view)
                     for impl, ms in by_impl.items()]
        if w.rank == 0:
            for impl in case.impls:
                print(f"{case.label} {impl}: " + ", ".join(f"{v} {t[impl] * 1e3:.1f} us" for v, t in times.items()),
                      flush=True)
        weft.barrier()
    return rows
