"""AllGather-GEMM: c = all_gather(a_shard, dim 0) @ b, with the gather hidden under the GEMM.

Every rank holds a_shard (m, K) and b (K, N); the result is (W * m, N), whose
row chunk r is a_shard of rank r times b (the column-parallel linear layer of
tensor parallelism, with the activations sharded on tokens).

How the overlap works (one call on rank `me`):

    main stream:  start (a_shard → G[me], barrier) ─ GEMM (chunk me, me+1, ..., me-1) ─ join
    copy stream:                    └─ for s = 1 .. W-1: a_shard → G[me] of rank me-s, then its flag ─┘

- G is this context's gathered buffer (W * m, K) in the symmetric heap, a
  tile map in its dense form (`wl.ShardMapping`): chunk q, rank q's shard, is
  one producer tile, and its flag is `ready[q]`. Rank q writes chunk q of
  everybody's G. The pushes are copy-engine transfers (cudaMemcpyAsync to the
  peer's memory through NVLink): they take no SM away from the GEMM. Each is
  followed, on the same stream, by a stream memory operation that writes 1
  into the peer's flag of the tile: stream order puts the flag after the data
  (`CopyEnginePush`, the copy engine's `tile_push`, two driver calls).
- At step s rank q pushes to rank q - s, so rank d receives chunk d + s at
  step s, and at every step the W pushes go to W different ranks.
- The GEMM is the persistent TMA GEMM of gemm.py with its tiles ordered by
  arrival: first the local chunk (no wait), then chunk me + 1, me + 2, ...
  Before the K loop of its first GEMM tile of chunk c a program waits for
  tile c (`tile_wait_tiles`: an acquire on ready[c], then the async-proxy
  fence that makes its TMA loads see the pushed data).
- `ag_gemm_start_kernel` starts each call: its programs copy a_shard into
  G[me] (a kernel, not a copy-engine call: one launch instead of two driver
  calls of host time), and its program 0 lowers my W flags to 0 and then
  joins a device barrier. So a rank pushes into a peer's G (and raises its
  flag) only after that peer's previous GEMM has finished reading G and its
  flags have been lowered: a flag at 1 means "this call's chunk is here",
  and the value the pushes write is a constant, which a CUDA-graph replay
  writes again. The barrier's words hold the call's epoch on the device, so
  the whole call can be captured and replayed with no reset. The barrier
  stays `barrier_all`: it orders calls, not tiles (the tile primitives leave
  buffer reuse between epochs to the caller).

On the cpu backend there are no streams: the pushes run on the host between
the barrier and the GEMM kernel, and the GEMM's waits see peers' pushes
through the shared heap.

`method="baseline"` is all_gather (weft) then torch.matmul, the non-overlapped
path the op falls back to where measurement shows the overlap loses (see
`auto_method`) and where the overlap cannot take the call (`overlap_refusal`:
TMA's layout and alignment rules, a gathered A larger than the workspace).

The workspace is one per world (`AgGemmWorkspace`), viewed as (W * m, K) by
each call: the start barrier makes any change of shape between calls safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning
from ..runtime.streams import StreamSet
from ..runtime.tiles import CopyEnginePush
from . import gemm
from .all_gather import all_gather
from .blocks import copy, first_item
from .common import (Launch, check_method, check_out, check_world_size, matmul_operands, out_kind, plan, signature,
                     workspace, world_or_raise, world_size, zero_everywhere)
from .registry import declare_op, fresh, into, no_config

METHODS = ("auto", "overlap", "baseline")
# "auto" overlaps from ag_gemm.overlap_min_rows gathered rows (weft.tuning; see auto_method). The start
# kernel's copy of a_shard into the gathered buffer takes ag_gemm.start on GPUs (elements a block, most
# programs, bytes a program copies), and this under the interpreter.
CPU_START = dict(block=256, max_programs=2, program_bytes=256 << 10)


# -- kernels --------------------------------------------------------------------

@triton.jit(do_not_specialize=["n", "chunk"])
def ag_gemm_start_kernel(a_shard, local, bar, ready, heap, n, chunk, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Start of a call. Program p copies elements [p * chunk, (p + 1) * chunk) of a_shard (n elements) into
    `local`, my own chunk of the gathered buffer; program 0 then lowers my flags ready[0..W), which this
    call's pushes raise to 1, and joins the barrier (bar[0] = the epoch), which no rank passes before every
    rank's previous GEMM is done reading its gathered buffer and its flags."""
    p = tl.program_id(0)
    lo = p * chunk
    copy(local, a_shard, lo, tl.maximum(tl.minimum(lo + chunk, n), lo), BLOCK, VEC)
    if p == 0:
        for q in range(wl.num_ranks(heap)):
            tl.store(ready + q, 0)
        wl.barrier_all(bar, heap)


@triton.jit
def ag_gemm_kernel(a_desc, b_desc, c_desc, ready, heap, m, N, K, RAGGED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_STAGES: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """c = G @ b, chunk by chunk in arrival order: me, me + 1, ..., me - 1 (mod W).

    G is a dense tile map (`wl.ShardMapping`): chunk c, rank c's m rows, is
    one producer tile, flagged in ready[c]. The GEMM tiles are numbered chunk
    after chunk and dealt round-robin to the programs, as in a plain persistent
    GEMM, so the load stays balanced. A program waits for chunk c
    (`tile_wait_tiles`, with the fence its TMA loads need) once, before its
    first GEMM tile of the chunk, outside the tile loop. The tile and K loops
    are not fused (the configs' `flatten` is ignored): fused, this kernel
    measured 1.74 ms against 1.48 ms unfused (4 H200s, 8192x7168x8192, both
    with WEFT_WAIT_TIMEOUT_S set). A GEMM tile never straddles two chunks:
    with RAGGED (m not a multiple of BLOCK_M) the descriptors of G and c are
    3-D (W, m, ·), which zero-fills loads and clips stores at the chunk's
    edge; otherwise they are 2-D (W * m, ·).
    """
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    chunks = wl.ShardMapping(world, m, K)
    num_m = tl.cdiv(m, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_chunk = num_m * num_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for step in range(world):
        c = (me + step) % world
        base = step * per_chunk  # global number of the chunk's first tile
        row0 = 0
        if step > 0:  # my own chunk is in place before the launch
            row0 = wl.consume_token(0, wl.tile_wait_tiles(chunks, ready, c, 1, 1, tma=True))
        first = first_item(base, NUM_PROGRAMS)  # my first tile here
        for tile in tl.range(first, base + per_chunk, NUM_PROGRAMS):
            pid_m, pid_n = gemm.tile_of(tile - base, num_m, num_n, GROUP_M)
            row = row0 + pid_m * BLOCK_M
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k in tl.range(k_tiles, num_stages=NUM_STAGES):
                if RAGGED:
                    a = a_desc.load([c, row, k * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
                else:
                    a = a_desc.load([c * m + row, k * BLOCK_K])
                b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
                acc = gemm.dot(a, b, acc)
            out = acc.to(c_desc.dtype)
            if RAGGED:
                c_desc.store([c, row, pid_n * BLOCK_N], out.reshape(1, BLOCK_M, BLOCK_N))
            else:
                c_desc.store([c * m + row, pid_n * BLOCK_N], out)


# -- host side ------------------------------------------------------------------

class AgGemmWorkspace:
    """The gathered buffer (workspace_bytes, viewed as (W * m, K) per call shape), barrier words and ready
    flags, and the copy stream the pushes use; one for every shape."""

    def __init__(self, world):
        heap, w = world.heap, world.world_size
        self.bytes = world.workspace_bytes // 256 * 256
        self.gathered = heap.empty((self.bytes,), torch.uint8)
        self.bar = heap.empty((1 + w,), torch.int32)
        self.ready = heap.empty((w,), torch.int32)
        self.streams = StreamSet(world.device, 1) if world.device.type == "cuda" else None  # the pushes' stream
        zero_everywhere(world, self.bar, self.ready)


def overlap_refusal(world, a_shard, b, out) -> str | None:
    """Why the overlapped kernel cannot take this call (TMA and workspace constraints), or None."""
    m, k = a_shard.shape
    n = b.shape[1]
    for name, t in (("a_shard", a_shard), ("b", b), ("out", out)):
        if t is None:
            continue
        if not t.is_contiguous():
            return f"{name} must be contiguous"
        if t.data_ptr() % 16:
            return f"{name} must start 16-byte aligned (TMA)"
    for name, cols in (("K", k), ("N", n)):
        if cols * a_shard.element_size() % 16:
            return f"{name} = {cols} is not a multiple of 16 bytes ({16 // a_shard.element_size()} elements; TMA)"
    if min(m, n, k) == 0:
        return "an empty dimension"
    need = world.world_size * m * k * a_shard.element_size()
    if need > world.workspace_bytes // 256 * 256:
        return (f"the gathered A takes {need} bytes, more than the workspace ({world.workspace_bytes} bytes: "
                "raise WEFT_WORKSPACE_BYTES)")
    return None


def auto_method(m: int, n: int, k: int, world) -> str:
    """Which path `method="auto"` takes for a_shard (m, k) and b (k, n) where the overlap can take it.

    Overlap from ag_gemm.overlap_min_rows (weft.tuning) gathered rows: on 4 H200s (docs/perf.md, 2026-11-21)
    it was 1.10-1.52x faster than NCCL + cuBLAS on every TP shape (4096 rows and more), and on 2 H200s eager
    (2026-11-22) 1.21x at 4096 rows; at 128 rows the GEMM is too short to hide the overlap's host and launch
    cost (88 us against 48 us for all_gather + cuBLAS), so small calls take the baseline.
    """
    min_rows = tuning.value("ag_gemm.overlap_min_rows", world.device, world.world_size)
    return "overlap" if m * world.world_size >= min_rows else "baseline"


@declare_op(tensors=("a_shard", "b", "out"), collective=True)
def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, method: str = "auto", out: torch.Tensor | None = None,
            return_gathered: bool = False, config: gemm.GemmConfig | None = None):
    """all_gather(a_shard, dim 0) @ b, overlapped. Collective: every rank calls it with the same shapes.

    a_shard: (m, K) on every rank; b: (K, N) (this rank's column shard of the weight); bf16, fp16 or fp32;
    any layout and size. Returns c (W * m, N), or (c, gathered A) with return_gathered.
    method: "overlap" (copy-engine gather under a persistent GEMM; needs contiguous, 16-byte aligned
    operands with K and N multiples of 16 bytes, and a gathered A that fits the workspace), "baseline"
    (weft all_gather, then torch.matmul), "auto" (overlap where it can take the call, else baseline).
    """
    world = world_or_raise()
    found = plan(world, lambda: ("ag_gemm", signature(a_shard), signature(b), method, out_kind(world, out),
                                 None if out is None else signature(out), bool(return_gathered), config),
                 lambda: _ag_gemm_plan(world, a_shard, b, method, out, return_gathered, config))
    return found(a_shard, b, out)


def _ag_gemm_plan(world, a_shard, b, method, out, return_gathered, config):
    check_method(method, METHODS)
    gemm.check_operands("a_shard", a_shard, "b", b, world.device, layout=False)
    w = world.world_size
    m, k = a_shard.shape
    n = b.shape[1]
    shape = (w * m, n)
    if out is not None:
        check_out(out, shape, a_shard.dtype, world)
    refusal = overlap_refusal(world, a_shard, b, out)
    if method == "overlap" and refusal:
        raise ValueError(f"method='overlap' cannot take this call: {refusal}")
    if method == "auto":
        method = "baseline" if refusal else auto_method(m, n, k, world)

    dtype, device = a_shard.dtype, a_shard.device  # not a_shard itself: a plan keeps no caller tensor

    def result(out):
        return torch.empty(shape, dtype=dtype, device=device) if out is None else out

    if method == "baseline":
        def run(a_shard, b, out):
            gathered = all_gather.eager(a_shard)
            c = torch.matmul(gathered, b, out=result(out)) if out is None or out.is_contiguous() else \
                out.copy_(torch.matmul(gathered, b))
            return (c, gathered) if return_gathered else c
        return run

    ws = workspace(world, "ag_gemm", AgGemmWorkspace)
    me = world.rank
    gathered = ws.gathered[:w * m * k * a_shard.element_size()].view(a_shard.dtype).view(w * m, k)
    # Step s pushes tile me (my chunk) into rank me - s: its G rows [me * m, (me + 1) * m), then 1 into its flag
    # ready[me].
    pushes = [CopyEnginePush(world.heap.peer(gathered, (me - s) % w)[me * m:(me + 1) * m],
                             world.heap.peer(ws.ready, (me - s) % w)[me:me + 1], 1) for s in range(1, w)]
    local = gathered[me * m:(me + 1) * m]
    heap = world.heap.descriptor
    cfg = config or gemm.config_for(shape[0], n, k, world.device)
    ragged = m % cfg.block_m != 0
    sample = result(out)
    if ragged:  # 3-D descriptors (W, m, .): loads zero-filled and stores clipped at each chunk's edge
        a_desc = gemm.descriptor(gathered.view(w, m, k), (1, cfg.block_m, cfg.block_k))
        c_desc = gemm.descriptor(sample.view(w, m, n), (1, cfg.block_m, cfg.block_n))
    else:
        a_desc = gemm.descriptor(gathered, (cfg.block_m, cfg.block_k))
        c_desc = gemm.descriptor(sample, (cfg.block_m, cfg.block_n))
    b_desc = gemm.descriptor(b, (cfg.block_k, cfg.block_n))
    tiles = w * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(gemm.num_sms(world.device), tiles)
    start_rule = tuning.value("ag_gemm.start", world.device, w) if world.device.type == "cuda" else CPU_START
    elements, block = m * k, start_rule["block"]
    wanted = min(start_rule["max_programs"],
                 triton.cdiv(elements * a_shard.element_size(), start_rule["program_bytes"]))
    chunk = triton.cdiv(triton.cdiv(elements, wanted), block) * block
    start = Launch(ag_gemm_start_kernel, (triton.cdiv(elements, chunk),),
                   (a_shard, local, ws.bar, ws.ready, heap, elements, chunk),
                   dict(BLOCK=block, VEC=16 // a_shard.element_size()), num_warps=4)
    start_fixed = tuple(map(start.address, (local, ws.bar, ws.ready, heap)))
    launch = Launch(ag_gemm_kernel, (programs,), (a_desc, b_desc, c_desc, ws.ready, heap, m, n, k),
                    dict(RAGGED=ragged, **cfg.constexprs(), NUM_PROGRAMS=programs), cfg.num_warps)
    streams = ws.streams

    def run(a_shard, b, out):
        res = result(out)
        start(start.address(a_shard), *start_fixed, elements, chunk)
        if streams is None:
            for push in pushes:
                push(a_shard)
        else:
            main, side = streams.current(), streams.sides[0]
            streams.wait(side, main)
            for push in pushes:
                push(a_shard, side[0])
        launch(a_desc, b_desc.on(b), c_desc.on(res.view(w, m, n) if ragged else res), ws.ready, heap, m, n, k)
        b_desc.off()  # the plan keeps no caller tensor (gemm.Descriptor)
        c_desc.off()
        if streams is not None:
            streams.wait(main, side)
        return (res, gathered.clone()) if return_gathered else res
    return run


# -- the operator: torch.ops.weft.ag_gemm(a_shard, b, world_size, method, return_gathered) -> (c, gathered A, or an
# empty (0, K)). Autograd (docs/design.md): grad_a_shard = gemm_rs(grad_c, bᵀ), grad_b = gatheredᵀ @ grad_c with the
# gathered A the forward returns.

@ag_gemm.define
def ag_gemm_op(a_shard: torch.Tensor, b: torch.Tensor, world_size: int, method: str = "auto",
               return_gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    check_world_size(world_size)
    if return_gathered:
        c, gathered = ag_gemm.eager(a_shard, b, method=method, return_gathered=True)
        return c, fresh(gathered, a_shard)
    return ag_gemm.eager(a_shard, b, method=method), a_shard.new_empty((0, a_shard.shape[1]))


@ag_gemm_op.register_fake
def _(a_shard, b, world_size, method="auto", return_gathered=False):
    matmul_operands("a_shard", a_shard, "b", b)
    rows = world_size * a_shard.shape[0]
    return (a_shard.new_empty((rows, b.shape[1])),
            a_shard.new_empty((rows if return_gathered else 0, a_shard.shape[1])))


@ag_gemm.traced
def _(a_shard, b, method="auto", out=None, return_gathered=False, config=None):
    no_config(config)
    c, gathered = torch.ops.weft.ag_gemm(a_shard, b, world_size(), method,
                                         return_gathered or (torch.is_grad_enabled() and b.requires_grad))
    c = into(out, c)
    return (c, gathered) if return_gathered else c


def _ag_gemm_setup(ctx, inputs, output):
    a_shard, b, _, _, return_gathered = inputs
    # b's gradient takes the gathered A from the output; without it (return_gathered=False) the backward
    # gathers a_shard again.
    ctx.save_for_backward(a_shard, b, output[1] if ctx.needs_input_grad[1] else None)
    ctx.return_gathered = return_gathered
    # An output nobody used gets None, not zeros: ag_gemm asks for the gathered A for the backward's sake alone
    # whenever b needs a gradient, and a reduce_scatter of zeros would be a wasted collective.
    ctx.set_materialize_grads(False)


def _ag_gemm_backward(ctx, grad_c, grad_gathered):
    from .all_reduce import reduce_scatter
    from .gemm_rs import gemm_rs

    a_shard, b, gathered = ctx.saved_tensors
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        if grad_c is not None:
            # bᵀ made contiguous: the overlapped gemm_rs needs contiguous operands (a copy of the weight shard costs
            # far less than losing the overlap).
            grad_a = gemm_rs(grad_c, b.t().contiguous())
        if ctx.return_gathered and grad_gathered is not None:  # else it is the empty placeholder's
            scattered = reduce_scatter(grad_gathered)
            grad_a = scattered if grad_a is None else grad_a + scattered
    if ctx.needs_input_grad[1] and grad_c is not None:
        if not ctx.return_gathered:
            gathered = all_gather(a_shard)
        grad_b = gathered.t() @ grad_c
    return grad_a, grad_b, None, None, None


ag_gemm_op.register_autograd(_ag_gemm_backward, setup_context=_ag_gemm_setup)


def _case(t: str, c: gemm.GemmConfig, ragged: bool):
    lead = "1, " if ragged else ""  # 3-D descriptors (W, m, ·) for a ragged m
    sig = dict(a_desc=f"tensordesc<{t}[{lead}{c.block_m}, {c.block_k}]>",
               b_desc=f"tensordesc<{t}[{c.block_k}, {c.block_n}]>",
               c_desc=f"tensordesc<{t}[{lead}{c.block_m}, {c.block_n}]>", ready="*i32", heap="*i64",
               m="i32", N="i32", K="i32")
    return (ag_gemm_kernel, sig, dict(RAGGED=ragged, NUM_PROGRAMS=132, **c.constexprs()),
            dict(num_warps=c.num_warps, min_arch=90))


COMPILE_CASES = [
    (ag_gemm_start_kernel, dict(a_shard=t, local=t, bar="*i32", ready="*i32", heap="*i64", n="i32", chunk="i32"),
     dict(BLOCK=2048, VEC=16 // size), dict(num_warps=4))
    for t, size in (("*bf16", 2), ("*fp16", 2), ("*fp32", 4))
] + [
    _case(t, c, ragged) for t in ("bf16", "fp16") for c in gemm.shipped_configs() for ragged in (False, True)
]
