"""AllGather-GEMM: c = all_gather(a_shard, dim 0) @ b, with the gather hidden under the GEMM.

Every rank holds a_shard (m, K) and b (K, N); the result is (W * m, N), whose
row chunk r is a_shard of rank r times b (the column-parallel linear layer of
tensor parallelism, with the activations sharded on tokens).

How the overlap works (one call on rank `me`):

    main stream:  barrier ─ copy a_shard → G[me] ─────── GEMM (tiles of chunk me, me+1, ..., me-1) ─ join
    copy stream:          └─ for s = 1 .. W-1: push a_shard → G[me] of rank me-s, then its flag ─┘

- G is this context's gathered buffer (W * m, K) in the symmetric heap; rank q
  writes chunk q of everybody's G. The pushes are copy-engine transfers
  (cudaMemcpyAsync to the peer's memory through NVLink): they take no SM away
  from the GEMM. Each is followed, on the same stream, by a 4-byte copy of the
  call's epoch into the peer's `ready[me]` flag: stream order puts the flag
  after the data.
- At step s rank q pushes to rank q - s, so rank d receives chunk d + s at
  step s, and at every step the W pushes go to W different ranks.
- The GEMM is the persistent TMA GEMM of gemm.py with its tiles ordered by
  arrival: first the local chunk (no wait), then chunk me + 1, me + 2, ...
  Before the K loop of a tile of chunk c it waits for `ready[c]` to reach the
  epoch, then fences the async (TMA) proxy so the loads see the pushed data.
- A device barrier starts each call: a rank pushes into a peer's G only after
  that peer's previous GEMM has finished reading it. The barrier's epoch word
  is the call's epoch, on the device, so the whole call can be captured in a
  CUDA graph and replayed with no reset.

On the cpu backend there are no streams: the pushes run on the host between
the barrier and the GEMM kernel, and the GEMM's waits see peers' pushes
through the shared heap.

`method="baseline"` is all_gather (weft) then torch.matmul, the non-overlapped
path the op falls back to where measurement shows the overlap loses (see
`auto_method`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import weft.language as wl
from weft.language import ptx

from . import gemm
from .all_gather import all_gather
from .common import check_method, check_out, world_or_raise

METHODS = ("auto", "overlap", "baseline")


# -- kernels --------------------------------------------------------------------

@triton.jit
def ag_gemm_barrier_kernel(bar, heap):
    """Start of a call: every rank's previous GEMM is done reading its gathered buffer. bar[0] = the epoch."""
    wl.barrier_all(bar, heap)


@triton.jit
def _wait_chunk(ready, c, epoch):
    """Wait until chunk c has arrived, and order the TMA loads after the acquire."""
    token = wl.wait(ready + c, 1, epoch, wl.CMP_GE)
    if not wl.INTERPRET:
        ptx.fence_proxy_async()
    return token


@triton.jit
def ag_gemm_kernel(a_desc, b_desc, c_desc, bar, ready, heap, m, N, K, RAGGED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_STAGES: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """c = G @ b, chunk by chunk in arrival order: me, me + 1, ..., me - 1 (mod W).

    The tiles are numbered chunk after chunk and dealt round-robin to the
    programs, as in a plain persistent GEMM, so the load stays balanced. A
    program waits for chunk c's flag once, before its first tile of the chunk,
    outside the tile loop. The tile and K loops are not fused (the configs'
    `flatten` is ignored): fused, this kernel measured 1.74 ms against 1.48 ms
    unfused (4 H200s, 8192x7168x8192, both with WEFT_WAIT_TIMEOUT_S set). A tile never straddles two chunks: with RAGGED (m not a
    multiple of BLOCK_M) the descriptors of G and c are 3-D (W, m, ·), which
    zero-fills loads and clips stores at the chunk's edge; otherwise they are
    2-D (W * m, ·).
    """
    pid = tl.program_id(0)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    epoch = tl.load(bar)
    num_m = tl.cdiv(m, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_chunk = num_m * num_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for step in range(world):
        c = (me + step) % world
        base = step * per_chunk  # global number of the chunk's first tile
        row0 = 0
        if step > 0:
            row0 = wl.consume_token(0, _wait_chunk(ready, c, epoch))
        first = base + (pid - base % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS  # my first tile here
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

class AgGemmContext:
    """The gathered buffer G (W * m, K), barrier words and ready flags for one (m, K, dtype), plus the
    peer views the copy engine pushes into and the copy stream it uses."""

    def __init__(self, world, m: int, k: int, dtype: torch.dtype):
        heap, w, me = world.heap, world.world_size, world.rank
        self.m = m
        self.gathered = heap.empty((w * m, k), dtype)
        self.bar = heap.empty((1 + w,), torch.int32)
        self.ready = heap.empty((w,), torch.int32)
        self.bar.zero_()
        self.ready.zero_()
        # Step s pushes my chunk into rank me - s: its G rows [me * m, (me + 1) * m) and its ready[me].
        self.pushes = []
        for s in range(1, w):
            d = (me - s) % w
            self.pushes.append((heap.peer(self.gathered, d)[me * m:(me + 1) * m], heap.peer(self.ready, d)[me:me + 1]))
        self.local = self.gathered[me * m:(me + 1) * m]
        self.stream = torch.cuda.Stream(world.device) if world.device.type == "cuda" else None
        world.barrier()  # flags are zero everywhere before anyone signals


def check_inputs(a_shard, b, world, out=None):
    gemm.check_operands("a_shard", a_shard, "b", b, world.device)
    shape = (world.world_size * a_shard.shape[0], b.shape[1])
    if out is not None:
        check_out(out, shape, a_shard.dtype, world)
        if out.data_ptr() % 16:
            raise ValueError("out must start 16-byte aligned (TMA)")
    return shape


def auto_method(m: int, n: int, k: int, world_size: int) -> str:
    """Which path `method="auto"` takes for a_shard (m, k) and b (k, n).

    Overlap everywhere measured: on 4 H200s (docs/perf.md, 2026-11-21) it was 1.10-1.52x faster than
    NCCL + cuBLAS on every TP shape, and faster than cuBLAS alone on three of them.
    """
    return "overlap"


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, method: str = "auto", out: torch.Tensor | None = None,
            return_gathered: bool = False, config: gemm.GemmConfig | None = None):
    """all_gather(a_shard, dim 0) @ b, overlapped. Collective: every rank calls it with the same shapes.

    a_shard: (m, K) on every rank; b: (K, N) (this rank's column shard of the weight); bf16, fp16 or fp32;
    K and N multiples of 16 bytes (TMA). Returns c (W * m, N), or (c, gathered A) with return_gathered.
    method: "overlap" (copy-engine gather under a persistent GEMM), "baseline" (weft all_gather, then
    torch.matmul), "auto".
    """
    world = world_or_raise()
    check_method(method, METHODS)
    shape = check_inputs(a_shard, b, world, out)
    m, k = a_shard.shape
    n = b.shape[1]
    if method == "auto":
        method = auto_method(m, n, k, world.world_size)
    if out is None:
        out = torch.empty(shape, dtype=a_shard.dtype, device=world.device)
    if method == "baseline" or shape[0] == 0 or n == 0 or k == 0:
        gathered = all_gather(a_shard)
        torch.matmul(gathered, b, out=out)
        return (out, gathered) if return_gathered else out

    key = ("ag_gemm", m, k, a_shard.dtype)
    ctx = world.context(key, lambda: AgGemmContext(world, m, k, a_shard.dtype))
    heap = world.heap.descriptor
    main = torch.cuda.current_stream() if ctx.stream is not None else None

    ag_gemm_barrier_kernel[(1,)](ctx.bar, heap, num_warps=1)
    ctx.local.copy_(a_shard)
    if main is not None:
        ctx.stream.wait_stream(main)
        with torch.cuda.stream(ctx.stream):
            _push(ctx, a_shard)
    else:
        _push(ctx, a_shard)

    cfg = config or gemm.config_for(shape[0], n, k, world.device)
    ragged = m % cfg.block_m != 0
    if ragged:
        a_desc = gemm.descriptor(ctx.gathered.view(world.world_size, m, k), (1, cfg.block_m, cfg.block_k))
        c_desc = gemm.descriptor(out.view(world.world_size, m, n), (1, cfg.block_m, cfg.block_n))
    else:
        a_desc = gemm.descriptor(ctx.gathered, (cfg.block_m, cfg.block_k))
        c_desc = gemm.descriptor(out, (cfg.block_m, cfg.block_n))
    b_desc = gemm.descriptor(b, (cfg.block_k, cfg.block_n))
    tiles = world.world_size * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(gemm.num_sms(world.device), tiles)
    ag_gemm_kernel[(programs,)](a_desc, b_desc, c_desc, ctx.bar, ctx.ready, heap, m, n, k, RAGGED=ragged,
                                NUM_PROGRAMS=programs, num_warps=cfg.num_warps, **cfg.constexprs())
    if main is not None:
        main.wait_stream(ctx.stream)
    if return_gathered:
        return out, ctx.gathered.clone()
    return out


def _push(ctx, a_shard):
    """My chunk into each peer's G, then the epoch into its ready[me]: data first, flag after (stream order)."""
    for rows, flag in ctx.pushes:
        rows.copy_(a_shard)
        flag.copy_(ctx.bar[0:1])


def _case(t: str, c: gemm.GemmConfig, ragged: bool):
    lead = "1, " if ragged else ""  # 3-D descriptors (W, m, ·) for a ragged m
    sig = dict(a_desc=f"tensordesc<{t}[{lead}{c.block_m}, {c.block_k}]>",
               b_desc=f"tensordesc<{t}[{c.block_k}, {c.block_n}]>",
               c_desc=f"tensordesc<{t}[{lead}{c.block_m}, {c.block_n}]>", bar="*i32", ready="*i32", heap="*i64",
               m="i32", N="i32", K="i32")
    return (ag_gemm_kernel, sig, dict(RAGGED=ragged, NUM_PROGRAMS=132, **c.constexprs()),
            dict(num_warps=c.num_warps, min_arch=90))


COMPILE_CASES = [(ag_gemm_barrier_kernel, dict(bar="*i32", heap="*i64"), {})] + [
    _case(t, c, ragged) for t in ("bf16", "fp16") for c in gemm.GPU_CONFIGS.values() for ragged in (False, True)
]
