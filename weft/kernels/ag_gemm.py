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

Every call runs over a group (default the world; W is its size, ranks are
group ranks). The workspace is one per group (`AgGemmWorkspace`), viewed as
(W * m, K) by each call: the start barrier makes any change of shape between
calls safe. On a group of one there is nothing to gather: the call is
torch.matmul alone, with no workspace and no communication kernel. On a group
that spans nodes the overlap is this op on each node's members and the
network between them (`hierarchical.AgGemm`, docs/nodes.md), bit for bit the
same result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning
from ..runtime.streams import StreamSet
from ..runtime.tiles import CopyEnginePush
from . import gemm, hierarchical
from .all_gather import all_gather
from .blocks import copy, first_item
from .common import (Launch, Plan, check_method, check_out, group_name, group_size, matmul_operands, plan,
                     resolve, signature, signature_words, signatures, workspace, zero_everywhere)
from .registry import declare_op, fresh, into, no_config

METHODS = ("auto", "overlap", "baseline")
# "auto" overlaps from ag_gemm.overlap_min_rows gathered rows (weft.tuning; see auto_method). The start
# kernel's copy of a_shard into the gathered buffer takes ag_gemm.start on GPUs (elements a block, most
# programs, bytes a program copies), and this under the interpreter.
CPU_START = dict(block=256, max_programs=2, program_bytes=256 << 10)


# -- kernels --------------------------------------------------------------------

@triton.jit(do_not_specialize=["n", "chunk", "fp"])
def ag_gemm_start_kernel(a_shard, local, bar, ready, heap, n, chunk, sig, err, fp, BLOCK: tl.constexpr,
                         VEC: tl.constexpr):
    """Start of a call. Program p copies elements [p * chunk, (p + 1) * chunk) of a_shard (n elements) into
    `local`, my own chunk of the gathered buffer; program 0 then lowers my flags ready[0..W), which this
    call's pushes raise to 1, and joins the barrier (bar[0] = the epoch), which no rank passes before every
    rank's previous GEMM is done reading its gathered buffer and its flags. Program 0 signs the call (the
    barrier's epoch) before the barrier and checks every member's signature after it: a mismatch trips the
    family, and the GEMM kernel then writes nothing."""
    p = tl.program_id(0)
    lo = p * chunk
    copy(local, a_shard, lo, tl.maximum(tl.minimum(lo + chunk, n), lo), BLOCK, VEC)
    if p == 0:
        for q in range(wl.num_ranks(heap)):
            tl.store(ready + q, 0)
        epoch = tl.load(bar) + 1  # the epoch barrier_all takes
        wl.sign(sig, epoch, fp, heap)
        wl.barrier_all(bar, heap)
        wl.check_signed(sig, epoch, fp, heap, err, op="ag_gemm")


@triton.jit
def ag_gemm_kernel(a_desc, b_desc, c_desc, ready, heap, m, N, K, sig, RAGGED: tl.constexpr,
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
    edge; otherwise they are 2-D (W * m, ·). A family tripped by a signature
    mismatch (the start kernel's check) writes nothing.
    """
    if not wl.signature_live(sig, heap):
        return
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
    flags, and the copy stream the pushes use; one for every shape, one per group."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        self.bytes = group.workspace_bytes // 256 * 256
        self.gathered = heap.empty((self.bytes,), torch.uint8)
        self.bar = heap.empty((1 + w,), torch.int32)
        self.ready = heap.empty((w,), torch.int32)
        self.streams = StreamSet(group.device, 1) if group.device.type == "cuda" else None  # the pushes' stream
        # The signature words; no epoch counter to resynchronise after a mismatch: every call makes one start
        # launch on every member, whatever its shapes, so the barrier's epochs stay in step.
        self.sig = signature_words(group, w)
        self.errors = signatures(group)
        self.errors.register(self.sig)
        zero_everywhere(group, self.bar, self.ready, self.sig)


def overlap_refusal(group, a_shard, b, out) -> str | None:
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
    need = group.size * m * k * a_shard.element_size()
    if need > group.workspace_bytes // 256 * 256:
        return (f"the gathered A takes {need} bytes, more than the workspace ({group.workspace_bytes} bytes: "
                "raise WEFT_WORKSPACE_BYTES)")
    return None


def auto_method(m: int, n: int, k: int, group) -> str:
    """Which path `method="auto"` takes for a_shard (m, k) and b (k, n) where the overlap can take it.

    Overlap from ag_gemm.overlap_min_rows (weft.tuning, by group size) gathered rows: on 4 H200s (docs/performance/overlapped_gemm.md,
    2026-11-21) it was 1.10-1.52x faster than NCCL + cuBLAS on every TP shape (4096 rows and more), and on 2 H200s
    eager (2026-11-22) 1.21x at 4096 rows; at 128 rows the GEMM is too short to hide the overlap's host and launch
    cost (88 us against 48 us for all_gather + cuBLAS), so small calls take the baseline.
    """
    min_rows = tuning.value("ag_gemm.overlap_min_rows", group.device, group.size)
    return "overlap" if m * group.size >= min_rows else "baseline"


@declare_op(tensors=("a_shard", "b", "out"), collective=True)
def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, method: str = "auto", out: torch.Tensor | None = None,
            return_gathered: bool = False, config: gemm.GemmConfig | None = None,
            group=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """all_gather(a_shard, dim 0) @ b over `group` (default: the world), overlapped. Collective: every member
    calls it with the same shapes.

    a_shard: (m, K) on every member; b: (K, N) (this rank's column shard of the weight); bf16, fp16 or fp32;
    any layout and size. Returns c (W * m, N), W the group size, member i's rows at [i * m, (i + 1) * m), or
    (c, gathered A) with return_gathered.
    method: "overlap" (copy-engine gather under a persistent GEMM; needs contiguous, 16-byte aligned
    operands with K and N multiples of 16 bytes, and a gathered A that fits the workspace), "baseline"
    (weft all_gather, then torch.matmul), "auto" (overlap where it can take the call, else baseline).
    On a group of one there is nothing to gather: every method is torch.matmul alone (no workspace, no
    communication kernel); "overlap" still refuses what it refuses on more ranks.
    """
    g = resolve(group)
    # The key holds no out_kind: nothing here depends on whether out is symmetric, and asking would make a
    # group of one's heap.
    found = plan(g, lambda: ("ag_gemm", signature(a_shard), signature(b), method,
                             None if out is None else signature(out), bool(return_gathered), config),
                 lambda: AgGemmPlan(g, a_shard, b, method, out, return_gathered, config))
    return found.run(a_shard, b, out)


class AgGemmPlan(Plan):
    """An ag_gemm of one signature: a plain GEMM (a group of one), all_gather + torch.matmul, or the overlap's
    start kernel, pushes and GEMM kernel with their workspace views."""

    def __init__(self, group, a_shard, b, method, out, return_gathered, config):
        super().__init__(group)
        check_method(method, METHODS)
        gemm.check_operands("a_shard", a_shard, "b", b, group.device, layout=False)
        w = group.size
        m, k = a_shard.shape
        n = b.shape[1]
        self.shape = (w * m, n)
        if out is not None:
            check_out(out, self.shape, a_shard.dtype, group)
        refusal = overlap_refusal(group, a_shard, b, out)
        if method == "overlap" and refusal:
            raise ValueError(f"method='overlap' cannot take this call: {refusal}")
        if method == "auto":
            method = "baseline" if refusal else auto_method(m, n, k, group)
        self.return_gathered = bool(return_gathered)
        self.dtype, self.device = a_shard.dtype, a_shard.device  # not a_shard itself: a plan keeps no caller tensor
        if w == 1:
            self.run = self.run_matmul
        elif method == "baseline":
            self.run = self.run_baseline
        elif group.topology.spans_nodes:
            # Across nodes: the node's overlap and the rail's all_gather (weft/kernels/hierarchical.py), with the
            # flat op's tiling (the same bits); nodes of unequal member counts have no rails: the baseline.
            h = hierarchical.hierarchy(group)
            cfg = config or gemm.config_for(w * m, n, k, group.device)
            self.run = self.run_baseline if h is None else \
                hierarchical.AgGemm(group, h, a_shard, b, cfg, self.return_gathered).run
        else:
            self.prepare_overlap(group, a_shard, b, out, config)
            self.run = self.run_overlap

    def result(self, out):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device) if out is None else out

    def gemm_into(self, a, b, out):
        """torch.matmul(a, b) into out (a fresh tensor without one; any layout of out)."""
        if out is None or out.is_contiguous():
            return torch.matmul(a, b, out=self.result(out))
        return out.copy_(torch.matmul(a, b))

    def run_matmul(self, a_shard, b, out):
        # A group of one: the gathered A is a_shard itself (a copy of it where it is returned).
        c = self.gemm_into(a_shard, b, out)
        return (c, a_shard.clone(memory_format=torch.contiguous_format)) if self.return_gathered else c

    def run_baseline(self, a_shard, b, out):
        gathered = all_gather.eager(a_shard, group=self.group)
        c = self.gemm_into(gathered, b, out)
        return (c, gathered) if self.return_gathered else c

    def prepare_overlap(self, group, a_shard, b, out, config):
        w, me = group.size, group.rank
        m, k = a_shard.shape
        n = b.shape[1]
        self.ws = ws = workspace(group, "ag_gemm", AgGemmWorkspace)
        self.m, self.n, self.k = m, n, k
        self.gathered = gathered = ws.gathered[:w * m * k * a_shard.element_size()].view(a_shard.dtype).view(w * m, k)
        # Step s pushes tile me (my chunk) into member me - s: its G rows [me * m, (me + 1) * m), then 1 into its
        # flag ready[me].
        self.pushes = [CopyEnginePush(group.heap.peer(gathered, (me - s) % w)[me * m:(me + 1) * m],
                                      group.heap.peer(ws.ready, (me - s) % w)[me:me + 1], 1) for s in range(1, w)]
        local = gathered[me * m:(me + 1) * m]
        self.heap = heap = group.heap.descriptor
        cfg = config or gemm.config_for(self.shape[0], n, k, group.device)
        self.ragged = ragged = m % cfg.block_m != 0
        sample = self.result(out)
        if ragged:  # 3-D descriptors (W, m, .): loads zero-filled and stores clipped at each chunk's edge
            self.a_desc = gemm.descriptor(gathered.view(w, m, k), (1, cfg.block_m, cfg.block_k))
            self.c_desc = gemm.descriptor(sample.view(w, m, n), (1, cfg.block_m, cfg.block_n))
        else:
            self.a_desc = gemm.descriptor(gathered, (cfg.block_m, cfg.block_k))
            self.c_desc = gemm.descriptor(sample, (cfg.block_m, cfg.block_n))
        self.b_desc = gemm.descriptor(b, (cfg.block_k, cfg.block_n))
        tiles = w * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        programs = min(gemm.num_sms(group.device), tiles)
        start_rule = tuning.value("ag_gemm.start", group.device, w) if group.device.type == "cuda" else CPU_START
        self.elements, block = m * k, start_rule["block"]
        wanted = min(start_rule["max_programs"],
                     triton.cdiv(self.elements * a_shard.element_size(), start_rule["program_bytes"]))
        self.chunk = triton.cdiv(triton.cdiv(self.elements, wanted), block) * block
        # The GEMM's tiling is each member's own business: not in the signature.
        self.fp = self.sign("ag_gemm", m=m, n=n, k=k, dtype=str(a_shard.dtype).removeprefix("torch."))
        self.start = Launch(ag_gemm_start_kernel, (triton.cdiv(self.elements, self.chunk),),
                            (a_shard, local, ws.bar, ws.ready, heap, self.elements, self.chunk, ws.sig,
                             ws.errors.tensor, self.fp),
                            dict(BLOCK=block, VEC=16 // a_shard.element_size()), num_warps=4)
        self.start_fixed = tuple(map(self.start.address, (local, ws.bar, ws.ready, heap)))
        self.sig_fixed = tuple(map(self.start.address, (ws.sig, ws.errors.tensor)))
        self.launch = Launch(ag_gemm_kernel, (programs,),
                             (self.a_desc, self.b_desc, self.c_desc, ws.ready, heap, m, n, k, ws.sig),
                             dict(RAGGED=ragged, **cfg.constexprs(), NUM_PROGRAMS=programs), cfg.num_warps)

    def run_overlap(self, a_shard, b, out):
        m, n, k, w = self.m, self.n, self.k, self.group.size
        res = self.result(out)
        self.start(self.start.address(a_shard), *self.start_fixed, self.elements, self.chunk, *self.sig_fixed, self.fp)
        self.ws.errors.raise_recorded()  # on the cpu backend, before anything is pushed to a peer
        streams = self.ws.streams
        if streams is None:
            for push in self.pushes:
                push(a_shard)
        else:
            main, side = streams.current(), streams.sides[0]
            streams.wait(side, main)
            for push in self.pushes:
                push(a_shard, side[0])
        self.launch(self.a_desc, self.b_desc.on(b), self.c_desc.on(res.view(w, m, n) if self.ragged else res),
                    self.ws.ready, self.heap, m, n, k, self.sig_fixed[0])
        self.b_desc.off()  # the plan keeps no caller tensor (gemm.Descriptor)
        self.c_desc.off()
        if streams is not None:
            streams.wait(main, side)
        return (res, self.gathered.clone()) if self.return_gathered else res


# -- the operator: torch.ops.weft.ag_gemm(a_shard, b, group_name, method, return_gathered) -> (c, gathered A, or an
# empty (0, K)). Autograd (docs/design.md): grad_a_shard = gemm_rs(grad_c, bᵀ), grad_b = gatheredᵀ @ grad_c with the
# gathered A the forward returns, over the same group.

@ag_gemm.define
def ag_gemm_op(a_shard: torch.Tensor, b: torch.Tensor, group_name: str, method: str = "auto",
               return_gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if return_gathered:
        c, gathered = ag_gemm.eager(a_shard, b, method=method, return_gathered=True, group=group_name)
        return c, fresh(gathered, a_shard)
    return ag_gemm.eager(a_shard, b, method=method, group=group_name), a_shard.new_empty((0, a_shard.shape[1]))


@ag_gemm_op.register_fake
def _(a_shard, b, group_name, method="auto", return_gathered=False):
    matmul_operands("a_shard", a_shard, "b", b)
    rows = group_size(group_name) * a_shard.shape[0]
    return (a_shard.new_empty((rows, b.shape[1])),
            a_shard.new_empty((rows if return_gathered else 0, a_shard.shape[1])))


@ag_gemm.traced
def _(a_shard, b, method="auto", out=None, return_gathered=False, config=None, group=None):
    no_config(config)
    c, gathered = torch.ops.weft.ag_gemm(a_shard, b, group_name(group), method,
                                         return_gathered or (torch.is_grad_enabled() and b.requires_grad))
    c = into(out, c)
    return (c, gathered) if return_gathered else c


def _ag_gemm_setup(ctx, inputs, output):
    a_shard, b, group, _, return_gathered = inputs
    # b's gradient takes the gathered A from the output; without it (return_gathered=False) the backward
    # gathers a_shard again.
    ctx.save_for_backward(a_shard, b, output[1] if ctx.needs_input_grad[1] else None)
    ctx.return_gathered = return_gathered
    ctx.group_name = group  # the backward's collectives run over the forward's group
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
            grad_a = gemm_rs(grad_c, b.t().contiguous(), group=ctx.group_name)
        if ctx.return_gathered and grad_gathered is not None:  # else it is the empty placeholder's
            scattered = reduce_scatter(grad_gathered, group=ctx.group_name)
            grad_a = scattered if grad_a is None else grad_a + scattered
    if ctx.needs_input_grad[1] and grad_c is not None:
        if not ctx.return_gathered:
            gathered = all_gather(a_shard, group=ctx.group_name)
        grad_b = gathered.t() @ grad_c
    return grad_a, grad_b, None, None, None


ag_gemm_op.register_autograd(_ag_gemm_backward, setup_context=_ag_gemm_setup)


def _case(t: str, c: gemm.GemmConfig, ragged: bool):
    lead = "1, " if ragged else ""  # 3-D descriptors (W, m, ·) for a ragged m
    sig = dict(a_desc=f"tensordesc<{t}[{lead}{c.block_m}, {c.block_k}]>",
               b_desc=f"tensordesc<{t}[{c.block_k}, {c.block_n}]>",
               c_desc=f"tensordesc<{t}[{lead}{c.block_m}, {c.block_n}]>", ready="*i32", heap="*i64",
               m="i32", N="i32", K="i32", sig="*i64")
    return (ag_gemm_kernel, sig, dict(RAGGED=ragged, NUM_PROGRAMS=132, **c.constexprs()),
            dict(num_warps=c.num_warps, min_arch=90))


COMPILE_CASES = [
    (ag_gemm_start_kernel, dict(a_shard=t, local=t, bar="*i32", ready="*i32", heap="*i64", n="i32", chunk="i32",
                                sig="*i64", err="*i64", fp="i32"),
     dict(BLOCK=2048, VEC=16 // size), dict(num_warps=4))
    for t, size in (("*bf16", 2), ("*fp16", 2), ("*fp32", 4))
] + [
    _case(t, c, ragged) for t in ("bf16", "fp16") for c in gemm.shipped_configs() for ragged in (False, True)
]
