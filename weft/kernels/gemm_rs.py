"""GEMM-ReduceScatter: the row-parallel linear layer of tensor parallelism.

    out on rank r = rows [r * m, (r + 1) * m) of  sum over ranks q of a_q @ b_q,   m = M / W,

where every rank holds a (M, K_local) (A sharded on K) and b_shard (K_local, N).
Row chunk c (rows [c * m, (c + 1) * m)) of every rank's partial product
belongs to rank c.

How the overlap works (one call on rank `me`, W ranks):

    main stream:  start ─ P_me+1 ──────── P_me+3 ─ ... ─┬─ final GEMM (chunk me + received) ─ join
    side stream:       └───────── P_me+2 ──────── ... ─────┘                                      │
    copy stream:              └ push ┘  └ push ┘  └ push ...                                   ───┘
                              (to me+1) (to me+2) (to me+3)

- The partials of my chunk are a tile map in its dense form
  (`wl.ShardMapping`): tile q is rank q's partial, and its flag is ready[q].
  The map names tiles and flags only: the received tiles sit in `recv` in
  rotated slots (below), my own stays in registers.
- `gemm_rs_start_kernel` (1 program) lowers the flags of the peers' tiles
  to 0 and raises my own, ready[me] = 1 (plain stores: the final GEMM comes
  after them in stream order), then joins a device barrier across the
  ranks: it ends only when every rank's previous call has finished its final
  GEMM, the last reader of its receive buffer and of its flags.
- Steps s = 1 .. W - 1, chunk c = me + s (mod W): the partial P_c =
  a[c * m:(c + 1) * m] @ b_shard goes into a send slot (gemm.matmul,
  the persistent TMA GEMM, or cuBLAS where no tiling of the chunk fills the
  GPU well: gemm_rs.cublas_chunks_below_fill in weft.tuning), and the copy stream, after waiting for it, pushes
  it into slot (me - c - 1) mod W of rank c's symmetric `recv` (a copy-engine
  transfer through NVLink: no SM is taken from the GEMMs), then writes 1
  into rank c's flag of tile me, ready[me], by a stream memory operation:
  stream order puts the flag after the data (`CopyEnginePush`, the copy
  engine's `tile_push`, two driver calls). At every step the W ranks send to W different ranks.
  The chunk GEMMs alternate between the main and a side stream, so the
  programs of the next one start on the SMs that this one's last, partial
  wave leaves idle (a chunk has 1/W of the tiles: its last wave is often
  far from full). The final GEMM waits for both.
- `gemm_rs_kernel`, the final GEMM, computes my own chunk with gemm.matmul's
  tile loop. After the K loop of its first tile, a program waits once for
  all W tiles of the map (`tile_wait_tiles`: one wait polling the W flags in
  parallel, my own included); every epilogue then sums,
  in rank order q = 0 .. W - 1 in fp32, its own tile rounded to the dtype
  (q = me: each rank's partial is rounded once, as with matmul +
  reduce_scatter) and the received tiles of the other ranks, and stores the
  sum into `out`.
- The main stream waits for the copy stream at the end of the call (join).
  Measured on 4 H200s (bf16, 2026-11-21, CUDA graphs): alternating streams
  took 8192x4608x36864 from 1234 to 1144 us per call (torch's fused op 1135);
  the other RS shapes moved by less than the run-to-run noise (2 %).

Why waiting inside the final GEMM cannot deadlock, although the GEMM fills
every SM: every flag it waits for is set by a peer's push, and a push depends
only on the peer's start kernel and chunk GEMMs, kernels that finish before the
peer's own final GEMM starts (it waits for both streams), and they wait for
nothing but the start barrier (itself
waiting only for every rank's previous call). Nothing a push depends on waits
for any final GEMM of this call, so there is no cycle; the pushes are
copy-engine transfers and need no SM. On the cpu backend there are no
streams: the chunk GEMMs and pushes run on the host, before the final kernel.

Buffer reuse. `recv` is written by the copy engines, whose destinations are
fixed by the host: a CUDA-graph replay reuses them exactly, so the half of a
double buffer cannot follow a device-side epoch parity. Hence one buffer and
the start barrier: a peer writes my `recv` in epoch e only after its start
kernel of epoch e, which waited for my start kernel of epoch e, which comes
after (stream order) my final GEMM of epoch e - 1, the buffer's last reader.
The flags hold 0 or 1: my start kernel of epoch e lowers them before it joins
the barrier, and q's push of epoch e raises ready[q] after the barrier, so
while my final GEMM of epoch e runs "ready[q] = 1" means exactly "epoch e's
data is here" (q's pushes of epoch e + 1 come after the barrier that waits
for this GEMM). The value a push writes is a constant, which a CUDA-graph
replay writes again. The send slots are read by my own copy engine only: a call's chunk
GEMMs rewrite them only after the previous call's main stream joined the copy
stream, that is after the previous pushes read them.

Memory ordering. A flag is written by the copy engine after the data copy
has completed (stream order). The final GEMM acquires the flags (ld.acquire.sys
in tile_wait_tiles) and reads the received tiles with ordinary loads carrying
a data dependency on the wait's token (wl.consume_token), so they cannot be
issued before the acquire.

One workspace for every shape, from the symmetric heap once: recv (viewed as
(W - 1, m, N): slot i holds rank me + 1 + i's partial of my chunk), ready (W
int32), bar (1 + W int32, the start barrier's words), and the W - 1 send
slots (m, N), which no peer reads: they come from the heap because nothing a
workspace keeps may come from torch's caching allocator, whose allocations go
to a CUDA-graph pool when the first call runs under CUDA-graph trees. The
epochs live on the device, so whole calls can be captured in a CUDA graph and
replayed.

"baseline" is torch.matmul then weft.ops.reduce_scatter: the fallback where
measurement shows the overlap loses.

Every call runs over a group (default the world): W is its size, ranks are
group ranks, and the workspace is the group's own. On a group of one there
is nothing to reduce: the call is torch.matmul alone, with no workspace and
no communication kernel. On a group that spans nodes the overlap is this op on
each node's members, once per node's rows, and the network between them
(`hierarchical.GemmRS`, docs/nodes.md), summed in two levels.
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
from .all_reduce import reduce_scatter
from .blocks import cast
from .common import (Launch, Plan, check_method, check_out, group_name, group_size, matmul_operands, plan,
                     resolve, rows_divisible, signature, signature_words, signatures, workspace,
                     zero_everywhere)
from .registry import declare_op, into, no_config

METHODS = ("auto", "overlap", "baseline")

# gemm_rs.medium_speed (weft.tuning): the speed of gemm's "medium" config (128x128 tiles) relative to the
# 128x256 configs when both fill the SMs equally.

# Chunk GEMMs whose best tiling fills the GPU less than gemm_rs.cublas_chunks_below_fill (see _tiling) go to
# cuBLAS (torch.matmul), whose kernels for such tile-starved shapes split the work differently; the final GEMM,
# with the reduction in its epilogue, is always weft's.


# -- device helpers -------------------------------------------------------------

@triton.jit
def _halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x[:, :COLS // 2], x[:, COLS // 2:] (as tutorial 09's epilogue sub-tiling does it)."""
    return x.reshape(ROWS, 2, COLS // 2).permute(0, 2, 1).split()


@triton.jit
def _reduce_part(own, recv, out, me, row0, col, m, N, FULL: tl.constexpr, OUT_TMA: tl.constexpr,
                 WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[row0:+ROWS, col:+COLS] = sum over ranks q in rank order, in fp32: `own` (my partial, already
    rounded to the dtype) for q == me, else q's partial from slot (q - me - 1) mod WORLD of recv.

    The loads are unrolled and unconditional (q == me is masked off, the same for the whole tile), so all
    WORLD - 1 are in flight before the adds need them. FULL: the part lies inside the chunk, so the rows
    are 16-byte vectors; else rows past m and columns past N are masked. `out` is a TMA descriptor
    (OUT_TMA, clips at the edges) or, for an out not 16-byte aligned, a pointer (masked stores).
    """
    rows = row0 + tl.arange(0, ROWS)
    cols = col + tl.arange(0, COLS)
    in_part = rows[:, None].to(tl.int64) * N + cols[None, :]
    edge = (rows < m)[:, None] & (cols < N)[None, :]
    slot_elems = tl.cast(m, tl.int64) * N
    total = tl.zeros([ROWS, COLS], tl.float32)
    for q in tl.static_range(WORLD):
        ptrs = recv + ((q - me - 1 + WORLD) % WORLD) * slot_elems + in_part  # q == me: never read
        if FULL:
            ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [16, 16]), [1, COLS])
            part = tl.load(ptrs, mask=q != me, other=0.0)
        else:
            part = tl.load(ptrs, mask=edge & (q != me), other=0.0)
        total += tl.where(q == me, own.to(tl.float32), part.to(tl.float32))
    if OUT_TMA:
        out.store([row0, col], cast(total, out.dtype))
    else:
        tl.store(out + in_part, cast(total, out.dtype.element_ty), mask=edge)


@triton.jit
def _reduce_tile(acc, recv, out, me, row0, col0, m, N, FULL: tl.constexpr, OUT_TMA: tl.constexpr,
                 WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The epilogue of a tile: my fp32 `acc` rounded to the dtype, plus the received partials, into out.
    Column quarter by quarter, so that the rounded tile, a quarter's fp32 sum and the received quarters
    fit in registers together."""
    QUARTER: tl.constexpr = BLOCK_N // 4
    own = cast(acc, recv.dtype.element_ty)
    left, right = _halves(own, BLOCK_M, BLOCK_N)
    q0, q1 = _halves(left, BLOCK_M, BLOCK_N // 2)
    q2, q3 = _halves(right, BLOCK_M, BLOCK_N // 2)
    _reduce_part(q0, recv, out, me, row0, col0, m, N, FULL, OUT_TMA, WORLD, BLOCK_M, QUARTER)
    _reduce_part(q1, recv, out, me, row0, col0 + QUARTER, m, N, FULL, OUT_TMA, WORLD, BLOCK_M, QUARTER)
    _reduce_part(q2, recv, out, me, row0, col0 + 2 * QUARTER, m, N, FULL, OUT_TMA, WORLD, BLOCK_M, QUARTER)
    _reduce_part(q3, recv, out, me, row0, col0 + 3 * QUARTER, m, N, FULL, OUT_TMA, WORLD, BLOCK_M, QUARTER)


# -- kernels --------------------------------------------------------------------

@triton.jit(do_not_specialize=["fp"])
def gemm_rs_start_kernel(bar, ready, heap, sig, err, fp):
    """Start of a call: the peers' flags down to 0 (their pushes of this call raise them), mine up to 1 (my own
    partial needs no transfer), then a barrier: every rank's previous final GEMM is done reading its `recv`
    and its flags. bar[0] = the epoch. The call is signed before the barrier and every member's signature
    checked after it: a mismatch trips the family, and the final GEMM then writes nothing."""
    me = wl.rank(heap)
    for q in range(wl.num_ranks(heap)):
        tl.store(ready + q, (q == me).to(tl.int32))
    epoch = tl.load(bar) + 1  # the epoch barrier_all takes
    wl.sign(sig, epoch, fp, heap)
    wl.barrier_all(bar, heap)
    wl.check_signed(sig, epoch, fp, heap, err, op="gemm_rs")


@triton.jit
def gemm_rs_kernel(a_desc, b_desc, recv, out, ready, heap, m, N, K, sig, OUT_TMA: tl.constexpr,
                   WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """out = my chunk of a (a_desc, m rows) @ b_shard + the partials of my chunk that the peers pushed.

    Program p computes tiles p, p + NUM_PROGRAMS, ... in grouped order, as gemm.matmul_kernel does.
    Before its first epilogue it waits, once, for the W partials (tiles of `partials`): its first K
    loop runs while the last pushes land. A family tripped by a signature mismatch (the start kernel's check)
    writes nothing.
    """
    if not wl.signature_live(sig, heap):
        return
    pid = tl.program_id(0)
    me = wl.rank(heap)
    partials = wl.ShardMapping(WORLD, m, N)  # of my chunk: tile q = rank q's, flag ready[q]
    num_m = tl.cdiv(m, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    arrived = 0  # becomes 0 with a data dependency on the wait: the received tiles' loads come after it
    for tile in range(pid, num_m * num_n, NUM_PROGRAMS):
        pid_m, pid_n = gemm.tile_of(tile, num_m, num_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = gemm.mma(a_desc, b_desc, row0, col0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
        if tile == pid:
            arrived = wl.consume_token(0, wl.tile_wait_tiles(partials, ready, 0, WORLD, 1))
        row0 += arrived
        if (row0 + BLOCK_M <= m) & (col0 + BLOCK_N <= N):
            _reduce_tile(acc, recv, out, me, row0, col0, m, N, True, OUT_TMA, WORLD, BLOCK_M, BLOCK_N)
        else:
            _reduce_tile(acc, recv, out, me, row0, col0, m, N, False, OUT_TMA, WORLD, BLOCK_M, BLOCK_N)


# -- host side ------------------------------------------------------------------

class GemmRSWorkspace:
    """The symmetric receive buffer (workspace_bytes, viewed as (W - 1, m, N) per call shape), ready flags
    and start-barrier words; the send slots (as many bytes, also from the heap: see the module doc); the
    copy stream and the side stream. One for every shape, one per group: the start barrier makes a change of
    shape between calls safe."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        self.bytes = group.workspace_bytes // 256 * 256
        self.recv = heap.empty((self.bytes,), torch.uint8)
        self.ready = heap.empty((w,), torch.int32)
        self.bar = heap.empty((1 + w,), torch.int32)
        self.send = heap.empty((self.bytes,), torch.uint8)
        cuda = group.device.type == "cuda"
        # sides[0]: the copy engine's pushes; sides[1]: every other chunk GEMM.
        self.streams = StreamSet(group.device, 2) if cuda else None
        # The signature words; no epoch counter to resynchronise after a mismatch: every call makes one start
        # launch on every member, whatever its shapes, so the barrier's epochs stay in step.
        self.sig = signature_words(group, w)
        self.errors = signatures(group)
        self.errors.register(self.sig)
        zero_everywhere(group, self.ready, self.bar, self.sig)


def overlap_refusal(group, a, b_shard, out) -> str | None:
    """Why the overlapped kernels cannot take this call (TMA and workspace constraints), or None."""
    m_total, k = a.shape
    n = b_shard.shape[1]
    for name, t in (("a", a), ("b_shard", b_shard)):
        if not t.is_contiguous():
            return f"{name} must be contiguous"
        if t.data_ptr() % 16:
            return f"{name} must start 16-byte aligned (TMA)"
    if out is not None and not out.is_contiguous():
        return "out must be contiguous"
    for name, cols in (("K_local", k), ("N", n)):
        if cols * a.element_size() % 16:
            return f"{name} = {cols} is not a multiple of 16 bytes ({16 // a.element_size()} elements; TMA)"
    if min(m_total, n, k) == 0:
        return "an empty dimension"
    need = (group.size - 1) * (m_total // group.size) * n * a.element_size()
    if need > group.workspace_bytes // 256 * 256:
        return (f"the received partials take {need} bytes, more than the workspace ({group.workspace_bytes} "
                "bytes: raise WEFT_WORKSPACE_BYTES)")
    return None


def _tiling(m: int, n: int, k: int, device: torch.device, group_size: int) -> tuple[gemm.GemmConfig, float]:
    """The tiling of a chunk GEMM (m, n, k), and how well it fills the GPU (the busy fraction of the
    programs' tile slots, scaled by gemm_rs.medium_speed for 128x128 tiles).

    gemm.config_for's tiling, unless 128x128 tiles fill the last wave enough better to make up for their
    lower speed. A chunk has a quarter (or less) of the full GEMM's tiles, so a half-empty last wave costs
    more: at 2048x4608 (8192x4608x36864 on 4 ranks) 128x256 tiles fill 73 % of 3 waves, 128x128 tiles
    87 % of 5; measured 1129 against 1188 us per call."""
    cfg = gemm.config_for(m, n, k, device)
    if device.type != "cuda":
        return cfg, 1.0
    sms = gemm.num_sms(device)
    medium = gemm.gpu_configs(device)["medium"]
    medium_speed = tuning.value("gemm_rs.medium_speed", device, group_size)

    def fill(c: gemm.GemmConfig) -> float:
        tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
        return tiles / (triton.cdiv(tiles, sms) * sms) * (medium_speed if c == medium else 1.0)

    if cfg.block_m == medium.block_m and fill(medium) > fill(cfg):
        cfg = medium
    return cfg, fill(cfg)


@declare_op(tensors=("a", "b_shard", "out"), collective=True)
def gemm_rs(a: torch.Tensor, b_shard: torch.Tensor, method: str = "auto",
            out: torch.Tensor | None = None, config: gemm.GemmConfig | None = None, group=None) -> torch.Tensor:
    """Member r of `group` (default: the world) gets rows [r * M / W, (r + 1) * M / W) of the sum over the
    members of a @ b_shard, W the group size.

    a: (M, K_local), b_shard: (K_local, N), same dtype (bf16, fp16, fp32), any layout; M divisible by the
    group size. Returns (M / W, N) in that dtype, accumulated in fp32 (each member's partial product is
    rounded to the dtype once, as with matmul + reduce_scatter).
    method: "overlap" (chunk GEMMs whose results the copy engines push to their owners while the next
    chunk computes; a final GEMM of the own chunk sums what arrived; needs contiguous, 16-byte aligned
    operands with K_local and N multiples of 16 bytes, and partials that fit the workspace), "baseline"
    (torch.matmul + weft.ops.reduce_scatter), "auto" (overlap where it can take the call). `out`: any
    (M / W, N) tensor of the dtype on this device. `config`: the tiling of every GEMM of the call
    (default: chosen for the chunk shape, and cuBLAS for the chunk GEMMs where no tiling fills the GPU
    well: gemm_rs.cublas_chunks_below_fill). On a group of one there is nothing to reduce: every method is
    torch.matmul alone (no workspace, no communication kernel); "overlap" still refuses what it refuses on
    more ranks. Collective: every member calls it with the same shapes, method and config.
    """
    g = resolve(group)
    # The key holds no out_kind: nothing here depends on whether out is symmetric, and asking would make a
    # group of one's heap.
    found = plan(g, lambda: ("gemm_rs", signature(a), signature(b_shard), method,
                             None if out is None else signature(out), config),
                 lambda: GemmRSPlan(g, a, b_shard, method, out, config))
    return found.run(a, b_shard, out)


class GemmRSPlan(Plan):
    """A gemm_rs of one signature: a plain GEMM (a group of one), torch.matmul + reduce_scatter, or the overlap's
    start kernel, chunk GEMMs, pushes and final GEMM with their workspace views."""

    def __init__(self, group, a, b_shard, method, out, config):
        super().__init__(group)
        check_method(method, METHODS)
        gemm.check_operands("a", a, "b_shard", b_shard, group.device, layout=False)
        w = group.size
        m_total, k = a.shape
        n = b_shard.shape[1]
        if m_total % w:
            raise ValueError(f"a has {m_total} rows, not divisible by the group size {w}")
        m = m_total // w
        self.shape = (m, n)
        if out is not None:
            check_out(out, self.shape, a.dtype, group)
        refusal = overlap_refusal(group, a, b_shard, out)
        if method == "overlap" and refusal:
            raise ValueError(f"method='overlap' cannot take this call: {refusal}")
        if method == "auto":
            # Measured on 4 H200s (bf16, 2026-11-21, `weft bench -n 4 gemm --ops rs`): overlap 1.02-1.46x faster
            # than cuBLAS + NCCL on every RS shape, so it is the default wherever it can take the call.
            # On 2 H200s eager (2026-11-22) 1.24x at 4096 rows but 0.37x at 128 (139 against 52 us: the chunk
            # launches and copies cost more host time than the GEMM takes): small calls take the baseline,
            # from the same row count as ag_gemm's.
            min_rows = tuning.value("ag_gemm.overlap_min_rows", group.device, w)
            method = "baseline" if refusal or m_total < min_rows else "overlap"
        self.dtype, self.device = a.dtype, a.device  # not a itself: a plan keeps no caller tensor
        if w == 1:
            self.run = self.run_matmul
        elif method == "baseline":
            self.run = self.run_baseline
        elif group.topology.spans_nodes:
            # Across nodes: the node's overlap for each node's rows and the rail's exchange of the node sums
            # (weft/kernels/hierarchical.py); nodes of unequal member counts have no rails: the baseline.
            h = hierarchical.hierarchy(group)
            self.run = self.run_baseline if h is None else hierarchical.GemmRS(group, h, a, b_shard, config).run
        else:
            self.prepare_overlap(group, a, b_shard, out, config)
            self.run = self.run_overlap

    def result(self, out):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device) if out is None else out

    def run_matmul(self, a, b_shard, out):
        # A group of one: my rows are all the rows, and the sum is my own partial.
        if out is None or out.is_contiguous():
            return torch.matmul(a, b_shard, out=self.result(out))
        return out.copy_(torch.matmul(a, b_shard))

    def run_baseline(self, a, b_shard, out):
        return reduce_scatter.eager(torch.matmul(a, b_shard), out=self.result(out), group=self.group)

    def prepare_overlap(self, group, a, b_shard, out, config):
        w, me = group.size, group.rank
        m, n = self.shape
        k = a.shape[1]
        if config is None:  # every GEMM of the call is one chunk of m rows
            cfg, fill = _tiling(m, n, k, a.device, w)
            self.cublas_chunks = fill < tuning.value("gemm_rs.cublas_chunks_below_fill", a.device, w)
        else:
            cfg, self.cublas_chunks = config, False
        self.ws = ws = workspace(group, "gemm_rs", GemmRSWorkspace)
        self.m, self.n, self.k = m, n, k
        # slot i: member me + 1 + i's partial of my chunk
        self.recv = recv = ws.recv[:(w - 1) * m * n * a.element_size()].view(a.dtype).view(w - 1, m, n)
        send = ws.send[:(w - 1) * m * n * a.element_size()].view(a.dtype).view(w - 1, m, n)
        # Step s: chunk c = me + s goes into slot (me - c - 1) mod W = W - 1 - s of member c's recv, then 1 into its
        # flag of tile me, ready[me].
        self.steps = steps = []
        for s in range(1, w):
            c = (me + s) % w
            steps.append((c, send[s - 1], CopyEnginePush(group.heap.peer(recv, c)[w - 1 - s],
                                                          group.heap.peer(ws.ready, c)[me:me + 1], 1)))
        self.heap = heap = group.heap.descriptor
        # How each member computes its chunks (tiling, cuBLAS) is its own business: not in the signature.
        self.fp = self.sign("gemm_rs", m=m, n=n, k=k, dtype=str(a.dtype).removeprefix("torch."))
        self.start_args = (ws.bar, ws.ready, heap, ws.sig, ws.errors.tensor, self.fp)
        self.start = Launch(gemm_rs_start_kernel, (1,), self.start_args, {}, num_warps=1)
        self.start_args = tuple(map(self.start.address, self.start_args[:5])) + (self.fp,)
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        programs = min(gemm.num_sms(a.device), tiles)
        quarter = cfg.block_n // 4  # the epilogue's column sub-tiles
        sample = self.result(out)
        self.out_tma = out_tma = sample.data_ptr() % 16 == 0  # else (an odd view) masked pointer stores
        self.a_desc = gemm.descriptor(a[me * m:(me + 1) * m], (cfg.block_m, cfg.block_k))
        self.b_desc = gemm.descriptor(b_shard, (cfg.block_k, cfg.block_n))
        self.out_desc = gemm.descriptor(sample, (cfg.block_m, quarter)) if out_tma else None
        self.final = Launch(gemm_rs_kernel, (programs,),
                            (self.a_desc, self.b_desc, recv, self.out_desc if out_tma else sample, ws.ready, heap,
                             m, n, k, ws.sig),
                            dict(OUT_TMA=out_tma, WORLD=w, **cfg.constexprs(), NUM_PROGRAMS=programs), cfg.num_warps)

        # The chunk GEMMs' launches, made once: a descriptor per send slot (fixed), one for a's rows (swapped
        # to this call's a chunk by chunk) and b's (shared with the final GEMM).
        self.chunk_a = gemm.descriptor(a[:m], (cfg.block_m, cfg.block_k))
        self.chunk_out = {c: gemm.descriptor(src, (cfg.block_m, cfg.block_n)) for c, src, _ in steps}
        self.swapped = (self.a_desc, self.b_desc, self.chunk_a) + ((self.out_desc,) if out_tma else ())
        self.chunk_launch = None if self.cublas_chunks else Launch(
            gemm.matmul_kernel, (programs,), (self.chunk_a, self.b_desc, self.chunk_out[steps[0][0]], m, n, k),
            dict(**cfg.constexprs(), NUM_PROGRAMS=programs, FLATTEN=cfg.flatten),
            cfg.num_warps)

    def chunk_gemm(self, a, b_shard, c, dst):
        m, n, k = self.m, self.n, self.k
        if self.cublas_chunks:
            torch.matmul(a[c * m:(c + 1) * m], b_shard, out=dst)
        else:
            self.chunk_launch(self.chunk_a.on(a[c * m:(c + 1) * m]), self.b_desc.on(b_shard), self.chunk_out[c],
                              m, n, k)

    def run_overlap(self, a, b_shard, out):
        m, n, k, me = self.m, self.n, self.k, self.group.rank
        ws, streams = self.ws, self.ws.streams
        res = self.result(out)
        self.start(*self.start_args)
        ws.errors.raise_recorded()  # on the cpu backend, before anything is pushed to a peer
        if streams is None:
            for c, src, push in self.steps:
                self.chunk_gemm(a, b_shard, c, src)
                push(src)
        else:
            # Chunk GEMMs alternate between two streams, so the next one's programs take the SMs that this
            # one's last, partial wave leaves idle.
            main = streams.current()
            pushes, side = streams.sides
            streams.wait(side, main)
            for i, (c, src, push) in enumerate(self.steps):
                compute = (main, side)[i % 2]
                if compute is main:
                    self.chunk_gemm(a, b_shard, c, src)
                else:
                    streams.run_on(compute, main, self.chunk_gemm, a, b_shard, c, src)
                streams.wait(pushes, compute)
                push(src, pushes[0])
            streams.wait(main, side)  # the final GEMM starts after every chunk GEMM (no deadlock: see above)
        self.final(self.a_desc.on(a[me * m:(me + 1) * m]), self.b_desc.on(b_shard), self.recv,
                   self.out_desc.on(res) if self.out_tma else res, ws.ready, self.heap, m, n, k, self.start_args[3])
        for desc in self.swapped:  # the plan keeps no caller tensor (gemm.Descriptor)
            desc.off()
        if streams is not None:
            streams.wait(main, pushes)
        return res


# -- the operator: torch.ops.weft.gemm_rs(a, b_shard, group_name, method) -> (M / W, N). Autograd (docs/design.md):
# grad_a = ag_gemm(grad_out, b_shardᵀ), grad_b_shard = aᵀ @ all_gather(grad_out), the gathered gradient coming back
# from that same ag_gemm, over the same group.

@gemm_rs.define
def gemm_rs_op(a: torch.Tensor, b_shard: torch.Tensor, group_name: str, method: str = "auto") -> torch.Tensor:
    return gemm_rs.eager(a, b_shard, method=method, group=group_name)


@gemm_rs_op.register_fake
def _(a, b_shard, group_name, method="auto"):
    matmul_operands("a", a, "b_shard", b_shard)
    w = group_size(group_name)
    rows_divisible(a, w)
    return a.new_empty((a.shape[0] // w, b_shard.shape[1]))


@gemm_rs.traced
def _(a, b_shard, method="auto", out=None, config=None, group=None):
    no_config(config)
    return into(out, torch.ops.weft.gemm_rs(a, b_shard, group_name(group), method))


def _save_operands(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.group_name = inputs[2]  # the backward's collectives run over the forward's group


def _gemm_rs_backward(ctx, grad):
    from .ag_gemm import ag_gemm
    from .all_gather import all_gather

    a, b_shard = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a = grad_b = None
    if need_a and need_b:  # one gather of the gradient serves both
        grad_a, gathered = ag_gemm(grad, b_shard.t().contiguous(), return_gathered=True, group=ctx.group_name)
    elif need_a:
        grad_a = ag_gemm(grad, b_shard.t().contiguous(), group=ctx.group_name)
    elif need_b:
        gathered = all_gather(grad, group=ctx.group_name)
    if need_b:
        grad_b = a.t() @ gathered
    return grad_a, grad_b, None, None


gemm_rs_op.register_autograd(_gemm_rs_backward, setup_context=_save_operands)


def _case(t: str, c: gemm.GemmConfig, world: int, out_tma: bool):
    quarter = c.block_n // 4
    sig = dict(a_desc=f"tensordesc<{t}[{c.block_m}, {c.block_k}]>", b_desc=f"tensordesc<{t}[{c.block_k}, {c.block_n}]>",
               recv=f"*{t}",
               out=f"tensordesc<{t}[{c.block_m}, {quarter}]>" if out_tma else f"*{t}",
               ready="*i32", heap="*i64", m="i32", N="i32", K="i32", sig="*i64")
    # The JIT's specialisation of a real call: N and K whole 16s (a TMA operand's rows), m too where aligned.
    return (gemm_rs_kernel, sig, dict(OUT_TMA=out_tma, WORLD=world, NUM_PROGRAMS=132, **c.constexprs()),
            dict(num_warps=c.num_warps, min_arch=90, divisible=("m", "N", "K") if out_tma else ("K",),
                 unaligned=() if out_tma else ("out",)))


# Signatures for the sm_90 compile check (weft.testing.compile): every GPU config, bf16/fp16, 8 ranks with a
# TMA-stored out, 2 ranks with an unaligned one.
COMPILE_CASES = [(gemm_rs_start_kernel, dict(bar="*i32", ready="*i32", heap="*i64", sig="*i64", err="*i64", fp="i32"),
                  {}, dict(num_warps=1))] + [
    _case(t, c, world, out_tma) for t in ("bf16", "fp16") for c in gemm.shipped_configs()
    for world, out_tma in ((8, True), (2, False))
]
