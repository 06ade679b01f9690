"""GEMM-ReduceScatter: the row-parallel linear layer of tensor parallelism.

    out on rank r = rows [r * m, (r + 1) * m) of  sum over ranks q of a_q @ b_q,   m = M / W,

where every rank holds a (M, K_local) (A sharded on K) and b_shard (K_local, N).

"overlap" runs two kernels, one after the other on the same stream:

1. `gemm_rs_kernel`, a persistent GEMM (grid = min(#SMs, #tiles)) over this
   rank's a @ b_shard. The output rows are split into W chunks of m rows;
   chunk c belongs to rank c. Tiles never straddle chunks: they are numbered
   (chunk, then row block and column block inside it, in gemm.tile_of's
   grouped order). Rank `me` visits chunks in the order me + 1, me + 2, ...,
   me (its own last), so at any moment the ranks write to different
   destinations. A finished tile leaves at once: the epilogue stores it
   (in the output dtype) straight into slot [me] of the destination rank's
   symmetric receive buffer (NVLink stores on the GPU), then signals it.
   Communication thus overlaps the GEMM of the following tiles.
2. `gemm_rs_reduce_kernel`: for each tile of my chunk, wait for its W
   flags, sum the W slots in rank order 0..W-1 in fp32, write `out`. It is a
   separate launch because a GEMM program must not wait on other programs:
   under the interpreter they run one after another, and on the GPU a
   persistent grid filling every SM cannot rely on others being scheduled.
   Nothing in the GEMM waits, so every GEMM completes and every wait ends.

Flags: one int32 per (tile of the destination's chunk, source rank), laid out
flags[tile * W + source], so one `wait` covers a tile's W contributions. A
source SETs its flag to the epoch (release, after its stores of the tile);
the reduce waits for flag >= epoch. Flags are never reset.

The epoch lives on the device (so CUDA-graph replays count it): two int32
words, [done, current]. Every GEMM program reads epoch = done + 1 and its
program 0 stores current = epoch; every reduce program reads current and its
program 0 stores done = epoch. Each word is written only by a kernel that
does not read it, and read by the kernel after, in stream order.

Workspace per (M, N, dtype, tiling), from the symmetric heap once: the receive
buffer of 2 x W x (m, N) elements (epoch e uses half e % 2; slot q of a half is
what rank q sent), the flags, the epoch words.

Why parity double buffering needs no extra handshake. Rank q's GEMM of epoch
e + 1 writes into half (e + 1) % 2 = (e - 1) % 2 of peer p's buffer, whose
last reader is p's reduce of epoch e - 1. That read is finished in time:
  p's reduce(e - 1) completes  ->  (stream order on p) p's GEMM(e) starts,
  and sends its tiles of chunk q to q, each flagged e after its data
  ->  q's reduce(e) waits for all of them (every rank sends every rank at
  least one tile per epoch)  ->  (stream order on q) q's GEMM(e + 1) starts
  and only then writes into p's half (e + 1) % 2.
So the writer of a half is always two epochs ahead of the half's previous
reader, and the chain runs through the very pair (p, q) involved. The same
chain shows that a flag can run ahead by at most one epoch while its tile is
still awaited: p's GEMM(e + 1) may flag e + 1 before q's reduce(e) has seen
e (it writes the other half, so the epoch-e data is untouched; and the
release of e + 1 comes after p's epoch-e stores, so acquiring e + 1 also
makes them visible); p's GEMM(e + 2) needs q's epoch-(e + 1) tiles, which
q sends only after its reduce(e). Hence "flag >= e" is exact enough.

"baseline" is torch.matmul then weft.ops.reduce_scatter: the fallback where
measurement shows the overlap loses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import weft.language as wl

from . import gemm
from .all_reduce import _cast, reduce_scatter
from .common import check_method, check_out, no_capture_for_setup, world_or_raise

METHODS = ("auto", "overlap", "baseline")

# Elements a reduce program handles per tile part on the GPU (rows = this / BLOCK_N): enough work per
# program for a memory-bound sum, few enough registers for W loads in flight.
REDUCE_PART_ELEMENTS = 8192


# -- device helpers -------------------------------------------------------------

@triton.jit
def _tile_ptrs(base, row0, col0, N, ROWS: tl.constexpr, COLS: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointers to base[row0:+ROWS, col0:+COLS] of a row-major (., N) matrix. ALIGNED is the host's
    promise that every row segment starts 16-byte aligned (base aligned, N and col0 a multiple of 16
    bytes), so that whole tiles move as 16-byte vectors; the hints go where the pointers are made."""
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    ptrs = base + (rows[:, None].to(tl.int64) * N + cols[None, :])
    if ALIGNED:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [16, 16]), [1, COLS])
    return ptrs


@triton.jit
def _edge_mask(row0, col0, rows_end, N, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    return (rows < rows_end)[:, None] & (cols < N)[None, :]


# -- kernels --------------------------------------------------------------------

@triton.jit
def gemm_rs_kernel(a_desc, b_desc, recv, flags, epochs, heap, M, N, K, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
                   NUM_PROGRAMS: tl.constexpr):
    """a @ b_shard, each tile pushed into slot [me] of its destination's `recv` and flagged there.

    Program p computes tiles p, p + NUM_PROGRAMS, ... of the sequence: chunk me + 1, ..., chunk me
    (mine last); inside a chunk, gemm.tile_of's grouped order.
    """
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    epoch = tl.load(epochs) + 1
    m = M // world
    num_m = tl.cdiv(m, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_chunk = num_m * num_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    # Slot [me] of the half this epoch writes, as an offset valid on every rank.
    slot = ((epoch % 2) * world + me).to(tl.int64) * m * N
    for tile in range(tl.program_id(0), world * per_chunk, NUM_PROGRAMS):
        chunk = (me + 1 + tile // per_chunk) % world
        t = tile % per_chunk
        pid_m, pid_n = gemm.tile_of(t, num_m, num_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = gemm.mma(a_desc, b_desc, chunk * m + row0, col0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
        val = _cast(acc, recv.dtype.element_ty)
        dst = wl.symm_at(recv, chunk, heap) + slot
        if (row0 + BLOCK_M <= m) & (col0 + BLOCK_N <= N):
            tl.store(_tile_ptrs(dst, row0, col0, N, BLOCK_M, BLOCK_N, True), val)
        else:
            # Rows past the chunk would land in the next slot: mask them (and columns past N).
            tl.store(_tile_ptrs(dst, row0, col0, N, BLOCK_M, BLOCK_N, False), val,
                     mask=_edge_mask(row0, col0, m, N, BLOCK_M, BLOCK_N))
        wl.notify(flags + t * world + me, chunk, heap, epoch)
    if tl.program_id(0) == 0:
        tl.store(epochs + 1, epoch)  # read by the reduce launched next


@triton.jit
def gemm_rs_reduce_kernel(recv, out, flags, epochs, heap, m, N, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SUB_M: tl.constexpr,
                          OUT_ALIGNED: tl.constexpr):
    """out = sum over ranks q of slot q of this epoch's half of `recv`, tile by tile as flags arrive.

    Program p handles rows [s * SUB_M, (s + 1) * SUB_M) of tile t, for t = p // (BLOCK_M // SUB_M),
    s = p % (BLOCK_M // SUB_M): tiles in the order the GEMMs send them.
    """
    p = tl.program_id(0)
    split: tl.constexpr = BLOCK_M // SUB_M
    t = p // split
    epoch = tl.load(epochs + 1)
    num_m = tl.cdiv(m, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = gemm.tile_of(t, num_m, num_n, GROUP_M)
    row0 = pid_m * BLOCK_M + (p % split) * SUB_M
    col0 = pid_n * BLOCK_N
    token = wl.wait(flags + t * WORLD, WORLD, epoch, wl.CMP_GE)
    slot_elems = tl.cast(m, tl.int64) * N
    half = wl.consume_token(recv, token) + (epoch % 2) * WORLD * slot_elems
    acc = tl.zeros([SUB_M, BLOCK_N], tl.float32)
    if (row0 + SUB_M <= m) & (col0 + BLOCK_N <= N):
        for q in tl.static_range(WORLD):  # unrolled: all W loads in flight before the adds need them
            acc += tl.load(_tile_ptrs(half + q * slot_elems, row0, col0, N, SUB_M, BLOCK_N, True)).to(tl.float32)
        tl.store(_tile_ptrs(out, row0, col0, N, SUB_M, BLOCK_N, OUT_ALIGNED), _cast(acc, out.dtype.element_ty))
    else:
        mask = _edge_mask(row0, col0, m, N, SUB_M, BLOCK_N)
        for q in tl.static_range(WORLD):
            v = tl.load(_tile_ptrs(half + q * slot_elems, row0, col0, N, SUB_M, BLOCK_N, False), mask=mask, other=0.0)
            acc += v.to(tl.float32)
        tl.store(_tile_ptrs(out, row0, col0, N, SUB_M, BLOCK_N, False), _cast(acc, out.dtype.element_ty), mask=mask)
    if p == 0:
        tl.store(epochs, epoch)  # read by the next call's GEMM


# -- host side ------------------------------------------------------------------

class GemmRSContext:
    """Receive buffer (2 x W x (m, N), by epoch parity), per-(tile, source) flags and the epoch words."""

    def __init__(self, world, m: int, n: int, dtype: torch.dtype, tiles_per_chunk: int):
        heap, w = world.heap, world.world_size
        self.recv = heap.empty((2, w, m, n), dtype)
        self.flags = heap.empty((tiles_per_chunk * w,), torch.int32)
        self.epochs = heap.empty((2,), torch.int32)  # [done, current]
        self.flags.zero_()
        self.epochs.zero_()
        world.barrier()  # flags are zero everywhere before anyone signals


def _config(m_total: int, m: int, n: int, k: int, device: torch.device) -> gemm.GemmConfig:
    cfg = gemm.config_for(m_total, n, k, device)
    if m < cfg.block_m:
        # Tiles never straddle chunks: a chunk shorter than the block wastes rows; size for the chunk.
        cfg = gemm.config_for(m, n, k, device)
    return cfg


def gemm_rs(a: torch.Tensor, b_shard: torch.Tensor, method: str = "auto",
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Rank r gets rows [r * M / W, (r + 1) * M / W) of the sum over ranks of a @ b_shard.

    a: (M, K_local), b_shard: (K_local, N), same dtype (bf16, fp16, fp32), contiguous, rows a multiple
    of 16 bytes (TMA); M divisible by the world size. Returns (M / W, N) in that dtype, accumulated in
    fp32 (each rank's partial product is rounded to the dtype once, as with matmul + reduce_scatter).
    method: "overlap" (GEMM tiles pushed to their owners as they finish, then a reduce), "baseline"
    (torch.matmul + weft.ops.reduce_scatter), "auto". `out`: any contiguous (M / W, N) tensor of
    the dtype on this device. Collective: every rank calls it with the same shapes and method.
    """
    world = world_or_raise()
    check_method(method, METHODS)
    gemm.check_operands("a", a, "b_shard", b_shard, world.device)
    w = world.world_size
    m_total, k = a.shape
    n = b_shard.shape[1]
    if m_total % w:
        raise ValueError(f"a has {m_total} rows, not divisible by the world size {w}")
    if k == 0:
        raise ValueError("a has 0 columns: K_local must be positive")
    m = m_total // w
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    else:
        check_out(out, (m, n), a.dtype, world)
    if m == 0 or n == 0:
        return out
    if method == "auto":
        # Measured on 4 H200s (docs/perf.md, 2026-11-21): overlap 1.01-1.13x faster than cuBLAS + NCCL
        # on every TP shape, so it is the default everywhere measured.
        method = "overlap"
    if method == "baseline":
        return reduce_scatter(torch.matmul(a, b_shard), out=out)

    cfg = _config(m_total, m, n, k, a.device)
    num_n = triton.cdiv(n, cfg.block_n)
    tiles_per_chunk = triton.cdiv(m, cfg.block_m) * num_n
    key = ("gemm_rs", m_total, n, a.dtype, cfg)
    if key not in world.contexts:
        no_capture_for_setup("weft.ops.gemm_rs")
    ctx = world.context(key, lambda: GemmRSContext(world, m, n, a.dtype, tiles_per_chunk))
    heap = world.heap.descriptor
    programs = min(gemm.num_sms(a.device), w * tiles_per_chunk)
    gemm_rs_kernel[(programs,)](
        gemm.descriptor(a, (cfg.block_m, cfg.block_k)), gemm.descriptor(b_shard, (cfg.block_k, cfg.block_n)),
        ctx.recv, ctx.flags, ctx.epochs, heap, m_total, n, k, NUM_PROGRAMS=programs, num_warps=cfg.num_warps,
        **cfg.constexprs())
    sub_m = cfg.block_m if a.device.type != "cuda" else max(1, min(cfg.block_m, REDUCE_PART_ELEMENTS // cfg.block_n))
    gemm_rs_reduce_kernel[(tiles_per_chunk * (cfg.block_m // sub_m),)](
        ctx.recv, out, ctx.flags, ctx.epochs, heap, m, n, WORLD=w, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP_M=cfg.group_m, SUB_M=sub_m, OUT_ALIGNED=out.data_ptr() % 16 == 0, num_warps=8 if a.is_cuda else 4)
    return out


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    (gemm_rs_kernel,
     dict(a_desc=f"tensordesc<{t}[{c.block_m}, {c.block_k}]>", b_desc=f"tensordesc<{t}[{c.block_k}, {c.block_n}]>",
          recv=f"*{t}", flags="*i32", epochs="*i32", heap="*i64", M="i32", N="i32", K="i32"),
     dict(NUM_PROGRAMS=132, **c.constexprs()), dict(num_warps=c.num_warps, min_arch=90))
    for t in ("bf16", "fp16") for c in gemm.GPU_CONFIGS.values()
] + [
    (gemm_rs_reduce_kernel,
     dict(recv=f"*{t}", out=f"*{t}", flags="*i32", epochs="*i32", heap="*i64", m="i32", N="i32"),
     dict(WORLD=wd, BLOCK_M=c.block_m, BLOCK_N=c.block_n, GROUP_M=c.group_m,
          SUB_M=min(c.block_m, REDUCE_PART_ELEMENTS // c.block_n), OUT_ALIGNED=al),
     dict(num_warps=8, min_arch=90))
    for t in ("bf16", "fp16") for c in gemm.GPU_CONFIGS.values() for wd, al in ((8, True), (2, False))
]
