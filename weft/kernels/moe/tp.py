"""Tensor-parallel mixture-of-experts: AllGather-GroupGEMM and GroupGEMM-ReduceScatter.

TP-MoE (Triton-distributed's AllGather-GroupGEMM / GroupGEMM-ReduceScatter): the tokens are sharded by rank
(sequence parallel, m per rank), and every rank holds every expert's weights sliced along the intermediate
dimension. An MoE MLP is then

    inter, layout = ag_group_gemm(tokens_shard, w_experts_shard, topk_idx)   # (W m k, N): every rank's pairs
    h = activation(inter)                                                   # e.g. SiLU(gate) * up, row-wise
    out_shard = group_gemm_rs(h, w_down_shard, topk_idx, topk_weights, layout)  # (m, hidden)

with w_experts_shard (E, hidden, N) (N = inter / W, or 2 inter / W with gate and up side by side) and
w_down_shard (E, N', hidden). Both ops communicate once each and hide it under their grouped GEMM.

The grouped layout (`GroupLayout`, group_layout.py). A (token, expert) *pair* is one entry of topk_idx. The
intermediate has one row per pair of every rank's tokens, W m k rows, in rank chunks: chunk c holds rank c's
pairs sorted by expert, the pairs without expert last, as rows of zeros. A chunk depends only on its rank's
topk_idx, so each rank sorts its own pairs (no host sync) and sends the result along with its tokens: the
consumer of a chunk needs nothing else.

ag_group_gemm, method "overlap" (one call on rank `me`):

    main stream:  barrier ─ tokens, layout → G[me] ─ GEMM (chunks me, me+1, ..., me-1) ─ join ─ row_of_pair
    copy stream:                       └─ for s = 1 .. W-1: push tokens + layout → G[me] of rank me-s, flag ─┘

as in ag_gemm, but for the flags: the pushes are copy-engine transfers into the peers' gathered buffer G (the
workspace), each followed by a 4-byte copy of the call's epoch into the peer's ready[me] (stream order puts the
flag after the data). `group_gemm_chunks_kernel` is persistent: its tiles are numbered chunk after chunk in arrival
order, and a program waits for a chunk (`tile_wait` on the TileMap of the gathered tokens: one producer
tile per rank) once, before its first tile there. A tile is BLOCK_M rows of one expert's segment of a chunk
times BLOCK_N columns; its A rows are gathered by token index from G, its B is the expert's weight slice.

group_gemm_rs, method "overlap": one persistent kernel, `group_gemm_rs_kernel`, whose programs deal out
work items round-robin in this order:

    GEMM(me+1)  GEMM(me+2) RS(me+1)  GEMM(me+3) RS(me+2)  ...  GEMM(me) RS(me-1)  FINAL

- GEMM(c): the tiles of chunk c, y[pair rows of c] = h[rows] @ w_down_shard[expert]; a program adds the
  tiles it computed to done[c] (a local counter, zeroed by the call's start kernel) once it has stored them all;
- RS(c): per block of BLOCK_T tokens of rank c, once done[c] has every tile of chunk c and rank c's routing
  weights have arrived: the top-k weighted sum of each token's k rows of y (fp32, in j order, rounded once
  to the dtype: this rank's partial), stored straight into rank c's symmetric `recv` slot [me] through
  NVLink, then pushed[block][me] raised on rank c;
- FINAL: per token block of my own tokens: my own partial (as RS) and, once pushed[block][q] says so, the
  partials of ranks q, summed in rank order in fp32 into `out`.
An item waits only for items earlier in every program's order (or for peers' RS items, which wait for
nothing of mine), so with all programs resident (a persistent grid of one program per SM) it cannot
deadlock; under the interpreter, which runs programs one after another, the grid is one program. The
routing weights travel by the copy engine at the start (ready[me] on every peer).

Start barrier and buffer reuse (both ops): each call begins with a device barrier across the ranks
(`moe_tp_start_kernel`), which leaves the call's epoch in bar[0]; a rank writes into a peer's workspace only
after it, i.e. after the peer's previous kernels, the last readers of that workspace, have finished. The
flags count epochs and are never reset. The two ops share the workspace and the barrier: their calls
alternate, and each barrier orders the next writer after the last reader, whichever op they belong to.

method "baseline" (and the fallback of "auto" where the overlap cannot take the call: a message larger than
the workspace, or a world of one): ag_group_gemm is weft all_gather of the tokens and of the layouts, then
the same grouped GEMM kernel without waits; group_gemm_rs is the grouped GEMM of every chunk, the weighted
top-k sum (topk_sum_kernel), and weft reduce_scatter; on one rank neither op gathers nor scatters. Every rank
computes every chunk in both methods, with the same rounding: each expert output rounded to the dtype, each
rank's weighted sum in fp32 rounded once, the ranks' partials summed in fp32 in rank order. "auto" overlaps
where it can and where the overlap measured faster (weft.tuning moe_tp.auto_overlaps: both ops); the GEMM tiling
follows the experts' average rows per chunk (_gemm_config, moe_tp.tiles; scripts/probe_moe_tp.py sweeps it).

Routing checks, with no host sync (the host queues call after call ahead of the GPU): where an op reads
topk_idx's values (ag_group_gemm; group_gemm_rs without a layout), its first launch, `moe_tp_check_kernel`,
checks them on the device and records a bad row (an expert named twice, or one outside [0, E) and not -1)
in the family's error word (routing.RoutingErrorWord: pinned host memory on GPUs, as the EP ops' check
routing.check_rows records). Each call of either op raises a recorded row on entry, before launching anything:
a ValueError naming topk_idx, the row and the expert, on the rank whose row it was, at its next call of the
family (after a CUDA-graph replay, at the next eager call; the other ranks' calls go on: a program that goes
on must keep the ranks' calls in step); it looks again after its launches, which under
the interpreter have run by then, so there the call that passed the row raises, its collective part done on
every rank. Until raised, a bad row does no harm: the layout sorts an entry outside the experts with the
pairs without expert (a row of zeros, summed as nothing), and a repeated expert computes its pair twice.
check_routing_values (weft.ops) is the same check on the host, with a sync.

routed_gemm and routed_gemm_sum (routed.py) are the two ops' one-rank baseline as local ops.

The cross-rank signature check (method "overlap"; common.Plan.sign, wl.sign / wl.check_signed): the start
kernel signs the call's fingerprint (the op, m, k, E, hidden, dtype: what the members' protocol depends on; not
N, each rank's own) before its barrier and checks every member's after it, in the workspace's signature words,
which both ops share: members whose calls differ, or of which one runs ag_group_gemm and another group_gemm_rs,
get weft.SignatureMismatch (on the cpu backend from the call, before anything is pushed; on GPUs at the next
call), and a tripped family's GEMM kernels write nothing (`out` is left as it was). The baseline's gathers are
weft's all_gather, which checks its own calls; ag_group_gemm's baseline all-gathers the members' fingerprints
too, and its kernel computes no chunk of a member whose fingerprint is not its own (recorded in the error
word: routing.peer_error, a ValueError). A chunk whose starts are not a layout of m k pairs (_chunk_ok) is not
computed either, and the pair and row numbers the kernels read are clamped to the call's rows: never a write
outside a buffer.

Both ops take group=None (the world): W and the ranks are the group's, with its own workspace and error word.
ag_group_gemm and group_gemm_rs are PyTorch operators too (torch.ops.weft.*, weft/torch_ops.py; inference only);
the operators take the group's name.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

import weft.language as wl
from weft.runtime.tiles import TileMap

from ... import tuning
from ...runtime.streams import StreamSet, device_copy
from ..all_gather import all_gather
from ..all_reduce import reduce_scatter
from ..blocks import cast, first_item
from ..common import (Launch, Plan, check_method, check_tensor, group_name, group_size, plan, resolve, signature,
                      signature_words, signatures, workspace, zero_everywhere)
from ..gemm import descriptor, num_sms
from ..registry import declare_op, into
from .group_layout import GroupLayout, LayoutLaunches, _check_layout, _topk_sum_launch, _weighted_sum
from .grouped_gemm import group_tile
from .routing import INDEX_DTYPES, _checked, _RoutingCheck, peer_error

METHODS = ("auto", "overlap", "baseline")
DTYPES = (torch.bfloat16, torch.float16)
# pushed[] flags per sender in the workspace: group_gemm_rs's token blocks grow with the shard to stay under it.
MAX_TOKEN_BLOCKS = 4096


# -- device helpers -----------------------------------------------------------------

@triton.jit
def _chunk_ok(starts, pairs, trusted, E: tl.constexpr, BLOCK_E: tl.constexpr):
    """Whether a chunk's starts (E + 2) are a layout of `pairs` pairs: from 0, never falling, ending at pairs,
    and the chunk `trusted` (its sender's call matches mine). A chunk a peer sent may be neither: the kernels
    take one that is not as empty, so no row number it holds reaches memory."""
    s = tl.arange(0, BLOCK_E)
    live = s <= E
    lo = tl.load(starts + s, mask=live, other=0)
    hi = tl.load(starts + s + 1, mask=live, other=pairs)
    falls = tl.sum((live & ((lo < 0) | (hi < lo))).to(tl.int32), axis=0)
    return trusted & (falls == 0) & (tl.load(starts) == 0) & (tl.load(starts + E + 1) == pairs)


@triton.jit
def _segments(starts, ok, NUM_SEGMENTS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Segment s < NUM_SEGMENTS of a chunk (an expert, or the unrouted pairs) from its starts: first row,
    rows, row blocks, first row block; and the chunk's row blocks in all. None unless `ok` (_chunk_ok)."""
    s = tl.arange(0, BLOCK_E)
    live = (s < NUM_SEGMENTS) & ok
    first = tl.load(starts + s, mask=live, other=0)
    rows = tl.load(starts + s + 1, mask=live, other=0) - first
    blocks = (rows + BLOCK_M - 1) // BLOCK_M
    return first, rows, blocks, tl.cumsum(blocks, axis=0) - blocks, tl.sum(blocks, axis=0)


@triton.jit
def _chunk_tiles(a, meta_c, ok, w, out, done_c, heap, a_row0, a_rows, out_row0, base, N, K, E: tl.constexpr,
                 TOP_K: tl.constexpr, GATHER: tl.constexpr, COUNT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, NUM_STAGES: tl.constexpr,
                 NUM_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, A_TMA: tl.constexpr,
                 W_TMA: tl.constexpr, FLATTEN: tl.constexpr):
    """This program's tiles of one chunk, numbered from `base` (the work items before it); returns the next
    base. Tiles go expert after expert, row blocks fastest (consecutive programs share w[e]'s column
    block); with GATHER (ag_group_gemm) the unrouted pairs' rows (zeros) follow. COUNT adds the program's
    tiles to done_c once they are all stored (release). A_TMA / W_TMA: a / w are TMA descriptors
    (grouped_gemm.group_tile). FLATTEN: the tile loop and the K loop run as one pipelined loop (every tile has the
    same K blocks), so the next tile's loads start under this tile's last products and store; Triton fuses
    a loop nest only from its outermost loop, so the callers unroll their chunk loops (static_range), and
    the loop holds no flag update (which would keep it from being pipelined). A chunk that is not `ok`
    (_chunk_ok) has no tiles: its rows of out are not written; a GATHER pair's token is kept in [0, a_rows)."""
    first, rows, blocks, first_block, total = _segments(meta_c, ok, E, BLOCK_M, BLOCK_E)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_tile = first_block * tiles_n
    s = tl.arange(0, BLOCK_E)
    live = s < E
    mine = first_item(base, NUM_PROGRAMS)
    for tile in tl.range(mine, base + total * tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        local = tile - base
        e = tl.sum(((first_tile <= local) & live).to(tl.int32), axis=0) - 1  # empty experts share a start
        this = s == e
        nb = tl.sum(tl.where(this, blocks, 0), axis=0)
        within = local - tl.sum(tl.where(this, first_tile, 0), axis=0)
        group_tile(a, meta_c + E + 2, w, out, a_row0, a_rows, out_row0, tl.sum(tl.where(this, first, 0), axis=0),
                   tl.sum(tl.where(this, rows, 0), axis=0), e, within % nb, within // nb, N, K, GATHER, TOP_K,
                   BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, EVEN_N, A_TMA, W_TMA)
    if COUNT:
        wl.notify(done_c, wl.rank(heap), heap, tl.maximum(base + total * tiles_n - mine + NUM_PROGRAMS - 1, 0)
                  // NUM_PROGRAMS, wl.SIGNAL_ADD, wl.SCOPE_GPU)
    base += total * tiles_n
    if GATHER:  # rows [starts[E], starts[E + 1]) of the chunk: the pairs without expert, zeros
        lo = tl.where(ok, tl.load(meta_c + E), 0)
        hi = tl.where(ok, tl.load(meta_c + E + 1), 0)
        mine = first_item(base, NUM_PROGRAMS)
        for blk in range(mine, base + tl.cdiv(hi - lo, BLOCK_M), NUM_PROGRAMS):
            r = lo + (blk - base) * BLOCK_M + tl.arange(0, BLOCK_M)
            for n0 in range(0, N, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                tl.store(out + (out_row0 + r).to(tl.int64)[:, None] * N + cols[None, :],
                         tl.zeros([BLOCK_M, BLOCK_N], out.dtype.element_ty),
                         mask=(r < hi)[:, None] & (cols < N)[None, :])
        base += tl.cdiv(hi - lo, BLOCK_M)
    return base


@triton.jit
def _tile_count(meta_c, ok, N, E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_E: tl.constexpr):
    """The GEMM tiles of a chunk's experts (what done[c] reaches once they are all computed)."""
    _, _, _, _, total = _segments(meta_c, ok, E, BLOCK_M, BLOCK_E)
    return total * tl.cdiv(N, BLOCK_N)


# -- kernels --------------------------------------------------------------------------

@triton.jit(do_not_specialize=["fp"])
def moe_tp_start_kernel(bar, heap, done, sig, err, fp, DONE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Start of a call: every rank's previous kernels, the last readers of its workspace, are done.
    bar[0] = the call's epoch. group_gemm_rs's DONE per-chunk tile counters `done` are zeroed here too (local
    counters: one launch fewer than a zero_). Signs the call (the barrier's epoch) before the barrier and checks
    every member's signature after it: a mismatch trips the family, whose GEMM kernels then write nothing."""
    if DONE > 0:
        d = tl.arange(0, BLOCK_D)
        tl.store(done + d, tl.zeros([BLOCK_D], tl.int32), mask=d < DONE)
    epoch = tl.load(bar) + 1  # the epoch barrier_all takes
    wl.sign(sig, epoch, fp, heap)
    wl.barrier_all(bar, heap)
    wl.check_signed(sig, epoch, fp, heap, err, op="ag_group_gemm / group_gemm_rs")


@triton.jit
def group_gemm_chunks_kernel(a, meta, w, out, ready, bar, heap, mapping, shapes, err, m, N, K, meta_stride, fp,
                             sig, E: tl.constexpr,
                             TOP_K: tl.constexpr, WORLD: tl.constexpr, GATHER: tl.constexpr, WAIT: tl.constexpr,
                             BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                             NUM_STAGES: tl.constexpr, NUM_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr,
                             EVEN_N: tl.constexpr, A_TMA: tl.constexpr, W_TMA: tl.constexpr,
                             FLATTEN: tl.constexpr):
    """out = the grouped GEMM of every chunk, chunks in arrival order me, me + 1, ..., me - 1.

    GATHER (ag_group_gemm): a is the gathered tokens (W m, K) and row i of chunk c computes token
    pair_of_row[c, i] // TOP_K of rank c; else (group_gemm_rs's baseline) a has the W m k rows of `out`.
    WAIT: before its first tile of chunk c != me, a program waits for the chunk (and its layout) to arrive:
    ready[c] >= the epoch, as `tile_wait` on `mapping` (the gathered tokens, one tile per rank) says it.
    ready, bar and mapping are read only with WAIT. A_TMA (not with GATHER or WAIT) / W_TMA: a / w are TMA
    descriptors (grouped_gemm.group_tile); FLATTEN as in _chunk_tiles.

    GATHER: the chunks of other ranks are what they sent, so each is checked first: its starts must be a layout
    of m k pairs (_chunk_ok) and, without WAIT (the baseline), shapes[c] (rank c's fingerprint, all-gathered)
    must be mine (`fp`); with WAIT the start kernel's signature check vouched for every member's call, and a
    family it tripped (the signature words `sig`) writes nothing. A chunk that fails is skipped (its rows of
    out are not written) and recorded in `err` (routing.peer_error), which the host raises.
    """
    if WAIT:
        if not wl.signature_live(sig, heap):
            return
    me = wl.rank(heap)
    pairs = m * TOP_K
    base = tl.program_id(0) * 0
    for step in tl.static_range(WORLD):
        c = (me + step) % WORLD
        a_c = a
        meta_c = meta + c * meta_stride
        if WAIT:
            if step > 0:
                token = wl.tile_wait(mapping, ready, c * m, 0, m, K, tl.load(bar))
                a_c = wl.consume_token(a, token)
                meta_c = wl.consume_token(meta_c, token)
        if GATHER:
            if WAIT:
                trusted = True
            else:
                trusted = (c == me) | (tl.load(shapes + c) == fp)
            ok = _chunk_ok(meta_c, pairs, trusted, E, BLOCK_E)
            if ok == 0:
                peer_error(err, c, 1)
        else:
            ok = _chunk_ok(meta_c, pairs, True, E, BLOCK_E)
        base = _chunk_tiles(a_c, meta_c, ok, w, out, ready, heap, c * (m if GATHER else pairs), m, c * pairs, base,
                            N, K, E, TOP_K, GATHER, False, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, NUM_STAGES,
                            NUM_PROGRAMS, EVEN_K, EVEN_N, A_TMA, W_TMA, FLATTEN)


@triton.jit
def group_gemm_rs_kernel(h, meta, w, y, row_of_pair, weights, recv, out, done, ready, pushed, bar, heap, sig, m, N, K,
                         meta_stride, E: tl.constexpr, TOP_K: tl.constexpr, WORLD: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                         NUM_STAGES: tl.constexpr, NUM_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr,
                         EVEN_N: tl.constexpr, A_TMA: tl.constexpr, W_TMA: tl.constexpr, FLATTEN: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out (m, N) = rows of my tokens of sum over ranks of (top-k weighted sum of (h @ w_down[expert])), as
    GEMM(me+1) GEMM(me+2) RS(me+1) ... GEMM(me) RS(me-1) FINAL (module doc). y (W m k, N): the expert
    outputs; weights (W m, k): every rank's routing weights; recv (W, m, N): the partials rank q pushed
    into slot q; done (W,) local tile counters; pushed (MAX_TOKEN_BLOCKS, W) flags. A_TMA / W_TMA: h / w are
    TMA descriptors (grouped_gemm.group_tile); FLATTEN as in _chunk_tiles. A family tripped by the start
    kernel's signature check (the signature words `sig`) writes nothing."""
    if not wl.signature_live(sig, heap):
        return
    pid = tl.program_id(0)
    me = wl.rank(heap)
    epoch = tl.load(bar)
    pairs = m * TOP_K
    blocks_t = tl.cdiv(m, BLOCK_T)
    t_in = tl.arange(0, BLOCK_T)
    hh = tl.arange(0, BLOCK_H)
    base = pid * 0
    for step in tl.static_range(WORLD):
        c = (me + 1 + step) % WORLD
        meta_c = meta + c * meta_stride
        base = _chunk_tiles(h, meta_c, _chunk_ok(meta_c, pairs, True, E, BLOCK_E), w, y, done + c, heap, c * pairs,
                            pairs, c * pairs, base, N, K, E, TOP_K, False, True, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E,
                            NUM_STAGES, NUM_PROGRAMS, EVEN_K, EVEN_N, A_TMA, W_TMA, FLATTEN)
        if step > 0:  # RS of the chunk before: my partial of rank p's tokens into its recv slot [me]
            p = (me + step) % WORLD
            meta_p = meta + p * meta_stride
            tiles = _tile_count(meta_p, _chunk_ok(meta_p, pairs, True, E, BLOCK_E), N, E, BLOCK_M, BLOCK_N, BLOCK_E)
            mine = first_item(base, NUM_PROGRAMS)
            for item in range(mine, base + blocks_t, NUM_PROGRAMS):
                blk = item - base
                computed = wl.wait(done + p, 1, tiles, wl.CMP_GE, wl.SCOPE_GPU, heap=heap, peer=me,
                                   op="group_gemm_rs chunk GEMM")
                arrived = wl.wait(ready + p, 1, epoch, wl.CMP_GE, heap=heap, peer=p,
                                  op="group_gemm_rs routing weights")
                t = blk * BLOCK_T + t_in
                live = t < m
                dst = wl.symm_at(recv, p, heap) + (me * m).to(tl.int64) * N
                for h0 in range(0, N, BLOCK_H):
                    cols = h0 + hh
                    acc = _weighted_sum(wl.consume_token(y, computed), row_of_pair,
                                        wl.consume_token(weights, arrived), p * m + t, live, cols, cols < N, N,
                                        WORLD * pairs, TOP_K, BLOCK_T, BLOCK_H)
                    tl.store(dst + t.to(tl.int64)[:, None] * N + cols[None, :], cast(acc, y.dtype.element_ty),
                             mask=live[:, None] & (cols < N)[None, :])
                wl.notify(pushed + blk * WORLD + me, p, heap, epoch)
            base += blocks_t
    # FINAL: my tokens, my partial and the pushed ones summed in rank order.
    meta_me = meta + me * meta_stride
    tiles = _tile_count(meta_me, _chunk_ok(meta_me, pairs, True, E, BLOCK_E), N, E, BLOCK_M, BLOCK_N, BLOCK_E)
    mine = first_item(base, NUM_PROGRAMS)
    for item in range(mine, base + blocks_t, NUM_PROGRAMS):
        blk = item - base
        computed = wl.wait(done + me, 1, tiles, wl.CMP_GE, wl.SCOPE_GPU, heap=heap, peer=me,
                           op="group_gemm_rs chunk GEMM")
        for sender in range(WORLD):
            if sender != me:
                computed = wl.wait(pushed + blk * WORLD + sender, 1, epoch, wl.CMP_GE, heap=heap, peer=sender,
                                   op="group_gemm_rs partials")
        t = blk * BLOCK_T + t_in
        live = t < m
        for h0 in range(0, N, BLOCK_H):
            cols = h0 + hh
            mask = live[:, None] & (cols < N)[None, :]
            own = cast(_weighted_sum(wl.consume_token(y, computed), row_of_pair, weights, me * m + t, live, cols,
                                     cols < N, N, WORLD * pairs, TOP_K, BLOCK_T, BLOCK_H), y.dtype.element_ty)
            total = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
            for q in tl.static_range(WORLD):
                ptrs = wl.consume_token(recv, computed) + (q * m + t).to(tl.int64)[:, None] * N + cols[None, :]
                part = tl.load(ptrs, mask=mask & (q != me), other=0.0)
                total += tl.where(q == me, own.to(tl.float32), part.to(tl.float32))
            tl.store(out + t.to(tl.int64)[:, None] * N + cols[None, :], cast(total, out.dtype.element_ty), mask=mask)


# -- the family's workspace -----------------------------------------------------------

class MoeTPWorkspace:
    """One symmetric workspace for both ops and every shape: `data` (workspace_bytes), viewed by ag_group_gemm
    as the gathered tokens and layouts and by group_gemm_rs as the received partials and the gathered routing
    weights; the start barrier's words bar (1 + W); ready (W): rank r's chunk (or weights) arrived, raised by
    the copy engine with the call's epoch; pushed (MAX_TOKEN_BLOCKS, W): rank q's partials of token block b
    arrived; the signature words (common.signature_words) and the group's SignatureWord. The copy stream for the
    pushes."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        self.bytes = data_bytes(group)
        self.data = heap.empty((self.bytes,), torch.uint8)
        self.bar = heap.empty((1 + w,), torch.int32)
        self.ready = heap.empty((w,), torch.int32)
        self.pushed = heap.empty((MAX_TOKEN_BLOCKS * w,), torch.int32)
        self.streams = StreamSet(group.device, 1) if group.device.type == "cuda" else None  # the pushes' stream
        # The signature words, which both ops sign; no epoch counter to resynchronise after a mismatch: every
        # overlapped call makes one start launch on every member, so the barrier's epochs stay in step.
        self.sig = signature_words(group, w)
        self.signatures = signatures(group)
        self.signatures.register(self.sig)
        zero_everywhere(group, self.bar, self.ready, self.pushed, self.sig)

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A view of `data` from byte `offset` (a multiple of 256)."""
        n = 1
        for s in shape:
            n *= s
        return self.data[offset:offset + n * dtype.itemsize].view(dtype).view(shape)


def data_bytes(group) -> int:
    return group.workspace_bytes // 256 * 256


def _aligned(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


def _workspace(group) -> MoeTPWorkspace:
    return workspace(group, "moe_tp", MoeTPWorkspace)


# -- host side --------------------------------------------------------------------------

# The grouped GEMM's tiles on GPUs are tuning data (weft.tuning moe_tp.tiles, swept by scripts/probe_moe_tp.py):
# "large" where the experts' segments (m k / E rows on average per chunk) fill 128 rows, else "small"; each
# {block_m, block_n, block_k, num_stages, num_warps, flatten}. moe_tp.tma_operands: whether the grouped GEMM takes
# its weights (and group_gemm_rs its h) by TMA where they allow it (_Operand). Under the interpreter CPU_TILES.
CPU_TILES = dict(block_m=16, block_n=32, block_k=32, num_stages=1, num_warps=4, flatten=False)


def _tiles(kind: str, device: torch.device, world_size: int) -> dict:
    return CPU_TILES if kind == "cpu" else tuning.value("moe_tp.tiles", device, world_size)[kind]


def _gemm_config(group, m: int, k: int, experts: int, n: int, kdim: int):
    """(tiles, even, warps, flatten): the grouped GEMM's tiling constexprs (BLOCK_M/N/K, BLOCK_E, NUM_STAGES),
    whether K and N are whole blocks (EVEN_K, EVEN_N), its warps and whether its tile loop is flattened
    (FLATTEN), from the tuning data's moe_tp.tiles."""
    kind = "cpu" if group.device.type != "cuda" else "large" if m * k >= 128 * experts else "small"
    t = _tiles(kind, group.device, group.size)
    bm, bn, bk, stages, warps, flatten = (t["block_m"], t["block_n"], t["block_k"], t["num_stages"], t["num_warps"],
                                          t["flatten"])
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(experts + 2),
                 NUM_STAGES=stages)
    return tiles, dict(EVEN_K=kdim % bk == 0, EVEN_N=n % bn == 0), warps, flatten


class _Operand:
    """A grouped GEMM operand as the kernels take it: a TMA descriptor of the tensor viewed as `shape` (rows,
    cols), blocks `block` (gemm.Descriptor, its base swapped per call), where grouped_gemm.group_tile's TMA loads can
    take it (`tma`: 16-byte aligned, rows of whole 16 bytes, and the K dimension `k` whole `block_k`s, so a K
    block never reaches into the next expert); else the tensor itself (pointer loads)."""

    def __init__(self, group, t: torch.Tensor, shape, block, k: int, block_k: int):
        self.shape = tuple(shape)
        self.tma = (tuning.value("moe_tp.tma_operands", t.device, group.size)
                    and t.data_ptr() % 16 == 0 and shape[1] * t.element_size() % 16 == 0
                    and k % block_k == 0)
        self.desc = descriptor(t.view(self.shape), block) if self.tma else None
        self.off()

    def __call__(self, t: torch.Tensor):
        return self.desc.on(t.view(self.shape)) if self.tma else t

    def off(self) -> None:
        """After the launch: the plan keeps no caller tensor (gemm.Descriptor)."""
        if self.tma:
            self.desc.off()


def _programs(group) -> int:
    return num_sms(group.device) if group.device.type == "cuda" else 2


def _check_weights(name, w, group, dtype, rows: int, rows_name: str):
    check_tensor(name, w, group, dtypes=DTYPES)
    if w.dtype != dtype:
        raise TypeError(f"{name} has dtype {w.dtype}, expected {dtype} (that of the activations)")
    if w.dim() != 3 or w.shape[0] < 1 or w.shape[1] != rows:
        raise ValueError(f"{name} must be (experts, {rows_name} = {rows}, N), got shape {tuple(w.shape)}")


def _check_topk(group, topk_idx, m: int, num_experts: int, topk_weights=None):
    """k may pass the experts (routed_gemm: an EP rank's rows name its local experts, -1 for the others)."""
    check_tensor("topk_idx", topk_idx, group, dtypes=INDEX_DTYPES)
    if topk_idx.dim() != 2 or topk_idx.shape[0] != m or topk_idx.shape[1] < 1:
        raise ValueError(f"topk_idx must be (tokens, k) with tokens = {m} and k >= 1, got shape "
                         f"{tuple(topk_idx.shape)}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, group, dtypes=(torch.float32,))
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected {tuple(topk_idx.shape)} "
                             "(that of topk_idx)")


def _check_out(group, out, shape, dtype) -> None:
    if out is None:
        return
    check_tensor("out", out, group)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")


def _overlap_refusal(group, empty: bool, need: int, what: str) -> str | None:
    """Why the overlap cannot take a call whose workspace data (`what`) takes `need` bytes, or None."""
    if need > data_bytes(group):
        return (f"{what} take {need} bytes, more than the workspace ({data_bytes(group)} bytes: raise "
                "WEFT_WORKSPACE_BYTES)")
    return "an empty dimension" if empty else None


def _choose(op: str, method: str, refusal: str | None, world_size: int, device: torch.device) -> str:
    """The method a plan runs: explicit, or for "auto" the overlap where it can take the call and is measured
    faster (weft.tuning moe_tp.auto_overlaps, by op), never on one rank (nothing to hide)."""
    if method == "overlap" and refusal:
        raise ValueError(f"method='overlap' cannot take this call: {refusal}")
    if method == "auto":
        overlaps = tuning.value("moe_tp.auto_overlaps", device, world_size)[op]
        return "overlap" if overlaps and not refusal and world_size > 1 else "baseline"
    return method


def _over(group) -> dict:
    """The group argument of a weft collective this family calls that takes groups only where it runs off the
    world (reduce_scatter gains group= with the collectives' conversion)."""
    return {} if group is group.world else dict(group=group)


def _push(ws, copies) -> None:
    """copies [(dst, src), ...] in order on the copy stream, after the main stream's work so far (inline on cpu)."""
    if ws.streams is None:
        for dst, src in copies:
            dst.copy_(src)
        return
    main, side = ws.streams.current(), ws.streams.sides[0]
    ws.streams.wait(side, main)
    ws.streams.run_on(side, main, _copies, copies)


def _copies(copies) -> None:
    for dst, src in copies:
        device_copy(dst, src)


def _join(ws) -> None:
    """The main stream waits for the copy stream's pushes (their sources may be freed after the call)."""
    if ws.streams is not None:
        ws.streams.wait(ws.streams.current(), ws.streams.sides[0])


class AgGroupGemmPlan(Plan):
    """ag_group_gemm of one call signature on one group: checks, method, launches, workspace views; `run` runs a
    call. local: routed_gemm (this rank's tokens alone, as ag_group_gemm's baseline on one rank)."""

    def __init__(self, group, tokens, w, topk_idx, method, out, local: bool = False):
        super().__init__(group)
        check_method(method, METHODS)
        x_name, w_name = ("tokens", "w_experts") if local else ("tokens_shard", "w_experts_shard")
        check_tensor(x_name, tokens, group, dtypes=DTYPES)
        if tokens.dim() != 2:
            raise ValueError(f"{x_name} must be (tokens, hidden), got shape {tuple(tokens.shape)}")
        m, hidden = tokens.shape
        _check_weights(w_name, w, group, tokens.dtype, hidden, "hidden")
        e, _, n = w.shape
        _check_topk(group, topk_idx, m, e)
        ww, me, k = (1, 0, topk_idx.shape[1]) if local else (group.size, group.rank, topk_idx.shape[1])
        self.world_size, self.m, self.k, self.e, self.n = ww, m, k, e, n
        self.dtype, self.dev = tokens.dtype, tokens.device
        self.out_shape = (ww * m * k, n)
        _check_out(group, out, self.out_shape, tokens.dtype)
        self.width = width = e + 2 + m * k  # a chunk's layout, int32
        tokens_bytes = _aligned(ww * m * hidden * tokens.element_size())
        need = tokens_bytes + ww * width * 4
        self.empty = min(m, n, hidden) == 0
        refusal = _overlap_refusal(group, self.empty, need, "the gathered tokens and layouts")
        self.method = _choose("ag_group_gemm", method, refusal, ww, tokens.device)
        self.routing = _RoutingCheck(group, topk_idx, e)
        overlap = self.method == "overlap"
        self.layouts = LayoutLaunches(topk_idx, e, ww, copy=overlap)  # overlap: the chunks are in the workspace
        # What the members must agree on (N is each rank's own): the start kernel's signature check (overlap), and
        # the fingerprints the baseline all-gathers and checks each chunk by (the kernel's shapes, fp).
        self.fp = self.sign("ag_group_gemm", m=m, k=k, experts=e, hidden=hidden,
                            dtype=str(tokens.dtype).removeprefix("torch."))
        self.fp_word = torch.full((1,), self.fp, dtype=torch.int32, device=self.dev)
        if self.empty:
            return
        tiles, even, warps, flatten = _gemm_config(group, m, k, e, n, hidden)
        programs = _programs(group)
        self.heap = heap = group.heap.descriptor
        block = (triton.next_power_of_2(m), triton.next_power_of_2(hidden))
        self.mapping = TileMap((ww * m, hidden), ww, block, device=group.device).arg  # a tile per rank
        self.w_op = _Operand(group, w, (e * hidden, n), (tiles["BLOCK_K"], tiles["BLOCK_N"]), hidden,
                             tiles["BLOCK_K"])
        consts = dict(E=e, TOP_K=k, WORLD=ww, GATHER=True, WAIT=overlap, **tiles, NUM_PROGRAMS=programs, **even,
                      A_TMA=False, W_TMA=self.w_op.tma, FLATTEN=flatten)
        if out is None:  # the launch is compiled for the alignment of the caller's out, or a fresh one's
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.dev)
        if overlap:
            self.ws = ws = _workspace(group)
            gathered = ws.view(0, (ww * m, hidden), self.dtype)
            metas = ws.view(tokens_bytes, (ww, width), torch.int32)
            self.mine = (gathered[me * m:(me + 1) * m], metas[me])
            # Step s pushes my chunk to rank me - s, whose kernel takes chunk me at its step s.
            peer = group.heap.peer
            self.peers = [(peer(gathered, (me - s) % ww)[me * m:(me + 1) * m], peer(metas, (me - s) % ww)[me],
                           peer(ws.ready, (me - s) % ww)[me:me + 1]) for s in range(1, ww)]
            self.start = Launch(moe_tp_start_kernel, (1,), (ws.bar, heap, ws.bar, ws.sig, ws.signatures.tensor,
                                                            self.fp), dict(DONE=0, BLOCK_D=1), 1)
            ready, bar, shapes, sig = ws.ready, ws.bar, self.fp_word, ws.sig  # shapes: read only without WAIT
        else:
            gathered = torch.empty((ww * m, hidden), dtype=self.dtype, device=self.dev)
            metas = torch.empty((ww, width), dtype=torch.int32, device=self.dev)
            ready = bar = sig = metas  # read only with WAIT
            shapes = self.fp_word.expand(ww).contiguous()  # every call: the ranks' fingerprints, gathered
        self.gathered, self.metas, self.ready, self.bar, self.shapes, self.sig = gathered, metas, ready, bar, shapes, sig
        self.err = errors = self.routing.errors.tensor
        self.launch = Launch(group_gemm_chunks_kernel, (programs,), self._args(gathered, metas, w, out, shapes),
                             consts, warps)
        self.err = self.launch.address(errors)  # compiled for the word, called with its address (on GPUs, pinned)
        self.w_op.off()

    def _args(self, gathered, metas, w, out, shapes):
        return (gathered, metas, self.w_op(w), out, self.ready, self.bar, self.heap, self.mapping, shapes, self.err,
                self.m, self.n, gathered.shape[1], self.width, self.fp, self.sig)

    def run(self, tokens, w, topk_idx, out):
        self.routing.run(topk_idx)
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.dev)
        if self.empty:
            return out.zero_(), self.layouts.all_gathered(topk_idx)
        if self.method == "baseline":
            one = self.world_size == 1
            shapes = self.fp_word if one else all_gather.eager(self.fp_word, group=self.group)
            layout = self.layouts.all_gathered(topk_idx, self.group)
            gathered = tokens if one else all_gather.eager(tokens, group=self.group)
            self.launch(*self._args(gathered, layout.meta, w, out, shapes))
            self.w_op.off()
            return out, layout
        ws, chunk = self.ws, self.mine[1]
        self.start(ws.bar, self.heap, ws.bar, ws.sig, ws.signatures.tensor, self.fp)
        ws.signatures.raise_recorded()  # on the cpu backend, before anything is pushed to a peer
        self.mine[0].copy_(tokens)
        self.layouts.chunk(topk_idx, chunk)  # into the workspace, after the barrier: its last readers are done
        epoch = ws.bar[0:1]
        _push(ws, [pair for rows, layout, flag in self.peers
                   for pair in ((rows, tokens), (layout, chunk), (flag, epoch))])
        self.launch(*self._args(self.gathered, self.metas, w, out, self.shapes))
        self.w_op.off()
        _join(ws)
        return out, self.layouts.gathered(self.metas)  # after the GEMM, which waited for every chunk


@declare_op(collective=True)
def ag_group_gemm(tokens_shard: torch.Tensor, w_experts_shard: torch.Tensor, topk_idx: torch.Tensor,
                  method: str = "auto", out: torch.Tensor | None = None, group=None) -> tuple:
    """All-gather the tokens over `group` (default: the world; W its size, ranks its group ranks) and multiply
    every (token, expert) pair by its expert's weight slice, overlapped.

    tokens_shard (m, hidden) bf16/fp16: this rank's tokens; w_experts_shard (E, hidden, N) of that dtype: every
    expert's slice of the first MoE weights on this rank (N = inter / W; gate and up may be side by side,
    N = 2 inter / W); topk_idx (m, k) int64/int32: each token's experts (-1: none; a row must not name an
    expert twice). Contiguous. Returns (inter, layout): inter (W m k, N) has one row per pair of every rank's
    tokens, grouped by rank chunk, then by expert, in the order `layout` (a GroupLayout) describes:
    inter[row] = token @ w_experts_shard[expert] (fp32 accumulation, rounded to the dtype), zeros for the
    pairs without expert; pass `layout` on to group_gemm_rs. `out`: a contiguous (W m k, N) tensor to write
    inter into.
    method: "overlap" (copy-engine pushes of the tokens under a persistent grouped GEMM that takes each rank's
    chunk as it arrives; needs the gathered tokens and layouts to fit the workspace), "baseline" (weft
    all_gather, then the grouped GEMM), "auto" (the overlap where it can take the call, else the baseline;
    moe_tp.auto_overlaps). Collective over the group: every member passes the same shapes and method.

    Checks on the device, with no host sync, raised as a ValueError by this rank's next call of the family (under
    the interpreter, by this call once its launches have run; module doc):
    - topk_idx's values: a bad row (an expert named twice, or one outside [0, E) and not -1) names topk_idx,
      the row and the expert. The call has then written inter (`out` if given) with that row's bad entries as
      pairs without expert (rows of zeros) and a repeated expert computed twice, and nothing else of the
      caller's; the other members' calls complete as usual, with the same treatment of the row.
    - what the other members sent: a chunk whose layout is not one of m k pairs, or in the baseline one from a
      member whose call differs (another m, k, E, hidden or dtype: its fingerprint, all-gathered, is not this
      call's), names that member; its rows of inter (`out` if given) are then left as they were, never computed
      from what it sent, and no row number it sent is used.

    Members whose overlapped calls differ (or of which one calls group_gemm_rs) get weft.SignatureMismatch on
    every member, naming both calls (the cross-rank signature check; on GPUs at the next call of the family):
    inter (`out` if given) is not written.
    """
    g = resolve(group)
    found = plan(g, lambda: ("ag_group_gemm", signature(tokens_shard), signature(w_experts_shard),
                             signature(topk_idx), method, None if out is None else signature(out)),
                 lambda: AgGroupGemmPlan(g, tokens_shard, w_experts_shard, topk_idx, method, out))
    return _checked(found, tokens_shard, w_experts_shard, topk_idx, out)


class GroupGemmRsPlan(Plan):
    """group_gemm_rs of one call signature on one group: checks, method, launches, workspace views; `run` runs a
    call. local: routed_gemm_sum (this rank's pairs alone, as group_gemm_rs's baseline on one rank)."""

    def __init__(self, group, h, w_down, topk_idx, topk_weights, method, out, make_layout: bool,
                 local: bool = False):
        super().__init__(group)
        check_method(method, METHODS)
        check_tensor("h", h, group, dtypes=DTYPES)
        if h.dim() != 2:
            raise ValueError(f"h must be (pairs, N), got shape {tuple(h.shape)}")
        _check_weights("w_down" if local else "w_down_shard", w_down, group, h.dtype, h.shape[1], "h's columns")
        e, inter, hidden = w_down.shape
        check_tensor("topk_idx", topk_idx, group, dtypes=INDEX_DTYPES)
        if topk_idx.dim() != 2:
            raise ValueError(f"topk_idx must be (tokens, k), got shape {tuple(topk_idx.shape)}")
        m, k = topk_idx.shape
        _check_topk(group, topk_idx, m, e, topk_weights)
        ww, me = (1, 0) if local else (group.size, group.rank)
        if h.shape[0] != ww * m * k:
            raise ValueError(f"h has {h.shape[0]} rows, expected {'' if local else 'world size x '}tokens x k = "
                             f"{ww * m * k} (one per pair of {'the' if local else 'every rank'}'s tokens, as "
                             f"{'routed_gemm' if local else 'ag_group_gemm'} returns them)")
        self.world_size, self.m, self.k, self.e, self.hidden = ww, m, k, e, hidden
        self.dtype, self.dev = h.dtype, h.device
        _check_out(group, out, (m, hidden), h.dtype)
        recv_bytes = _aligned(ww * m * hidden * h.element_size())
        need = recv_bytes + ww * m * k * 4
        self.empty = min(m, inter, hidden) == 0
        refusal = _overlap_refusal(group, self.empty, need, "the partials and routing weights")
        self.method = _choose("group_gemm_rs", method, refusal, ww, h.device)
        self.routing = _RoutingCheck(group, topk_idx, e)
        self.layouts = LayoutLaunches(topk_idx, e, ww, copy=False) if make_layout else None  # calls without one
        if self.empty:
            return
        tiles, even, warps, flatten = _gemm_config(group, m, k, e, hidden, inter)
        bm, bn, bk = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
        self.h_op = _Operand(group, h, h.shape, (bm, bk), inter, bk)
        self.w_op = _Operand(group, w_down, (e * inter, hidden), (bk, bn), inter, bk)
        tma = dict(A_TMA=self.h_op.tma, W_TMA=self.w_op.tma, FLATTEN=flatten)
        self.heap = heap = group.heap.descriptor
        width = e + 2 + m * k
        y = torch.empty((ww * m * k, hidden), dtype=self.dtype, device=self.dev)
        metas = torch.empty((ww, width), dtype=torch.int32, device=self.dev)
        rows = torch.empty((ww * m, k), dtype=torch.int32, device=self.dev)
        if self.method == "baseline":
            mapping = TileMap((ww * m, inter), ww, (triton.next_power_of_2(m), triton.next_power_of_2(inter)),
                              device=group.device).arg
            # ready, bar, mapping and sig are read only with WAIT, shapes and err only with GATHER
            self.gemm_args = lambda h, metas, w_down, y: (self.h_op(h), metas, self.w_op(w_down), y, metas, metas,
                                                          heap, mapping, metas, metas, m, hidden, inter, width, 0,
                                                          metas)
            self.launch = Launch(group_gemm_chunks_kernel, (_programs(group),), self.gemm_args(h, metas, w_down, y),
                                 dict(E=e, TOP_K=k, WORLD=ww, GATHER=False, WAIT=False, **tiles,
                                      NUM_PROGRAMS=_programs(group), **even, **tma), warps)
            self._off()
            # Every rank's tokens summed here (into out itself on one rank), then weft's reduce_scatter.
            # Compiled for the alignment of what it takes: on one rank the caller's weights and out.
            weights, sums = ((topk_weights, y if out is None else out) if ww == 1 else
                             (torch.zeros((ww * m, k), device=self.dev), y))
            self.sums = _topk_sum_launch(group, y, rows, weights, sums, ww * m)
            return
        self.ws = ws = _workspace(group)
        self.recv = ws.view(0, (ww, m, hidden), self.dtype)
        self.weights = ws.view(recv_bytes, (ww * m, k), torch.float32)
        self.mine = self.weights[me * m:(me + 1) * m]
        # What the members must agree on (the columns of h are each rank's own), for the start kernel's check.
        self.fp = self.sign("group_gemm_rs", m=m, k=k, experts=e, hidden=hidden,
                            dtype=str(h.dtype).removeprefix("torch."))
        peer = group.heap.peer
        self.peers = [(peer(self.weights, q)[me * m:(me + 1) * m], peer(ws.ready, q)[me:me + 1])
                      for q in range(ww) if q != me]
        self.done = torch.zeros(ww, dtype=torch.int32, device=self.dev)  # zeroed by each call's start
        self.start = Launch(moe_tp_start_kernel, (1,), (ws.bar, heap, self.done, ws.sig, ws.signatures.tensor, self.fp),
                            dict(DONE=ww, BLOCK_D=triton.next_power_of_2(ww)), 1)
        gpu = group.device.type == "cuda"
        # One program under the interpreter, which runs programs one after another: a later program's GEMM
        # tile may be what an earlier one's reduction waits for (module doc).
        programs = num_sms(group.device) if gpu else 1
        block_t = max(16 if gpu else 4, triton.next_power_of_2(triton.cdiv(m, MAX_TOKEN_BLOCKS)))
        if out is None:  # the launch is compiled for the alignment of the caller's out, or a fresh one's
            out = torch.empty((m, hidden), dtype=self.dtype, device=self.dev)
        self.launch = Launch(group_gemm_rs_kernel, (programs,),
                             self._args(h, metas, w_down, y, rows, out),
                             dict(E=e, TOP_K=k, WORLD=ww, **tiles, NUM_PROGRAMS=programs, **even, **tma,
                                  BLOCK_T=block_t, BLOCK_H=256 if gpu else 32), warps)
        self._off()

    def _args(self, h, metas, w_down, y, row_of_pair, out):
        ws = self.ws
        return (self.h_op(h), metas, self.w_op(w_down), y, row_of_pair, self.weights, self.recv, out, self.done,
                ws.ready, ws.pushed, ws.bar, self.heap, ws.sig, self.m, self.hidden, h.shape[1], metas.shape[1])

    def _off(self) -> None:
        self.h_op.off()
        self.w_op.off()

    def check_layout(self, layout) -> None:
        _check_layout(layout, (self.world_size, self.e, self.k, self.m), self.dev)

    def run(self, h, w_down, topk_idx, topk_weights, layout, out):
        if layout is None:  # topk_idx's values are read only to make the layout again
            self.routing.run(topk_idx)
        if out is None:
            out = torch.empty((self.m, self.hidden), dtype=self.dtype, device=self.dev)
        if self.empty:
            return out.zero_()
        if layout is None:
            layout = self.layouts.all_gathered(topk_idx, self.group)
        if self.method == "baseline":
            y = torch.empty((h.shape[0], self.hidden), dtype=self.dtype, device=self.dev)
            self.launch(*self.gemm_args(h, layout.meta, w_down, y))
            self._off()
            one = self.world_size == 1
            weights = topk_weights if one else all_gather.eager(topk_weights, group=self.group)
            sums = out if one else torch.empty((weights.shape[0], self.hidden), dtype=self.dtype, device=self.dev)
            a = self.sums.address
            self.sums(a(y), a(layout.row_of_pair), a(weights), a(sums), weights.shape[0], self.hidden)
            return out if one else reduce_scatter.eager(sums, out=out, **_over(self.group))
        ws = self.ws
        y = torch.empty((h.shape[0], self.hidden), dtype=self.dtype, device=self.dev)
        self.start(ws.bar, self.heap, self.done, ws.sig, ws.signatures.tensor, self.fp)
        ws.signatures.raise_recorded()  # on the cpu backend, before anything is pushed to a peer
        self.mine.copy_(topk_weights)
        epoch = ws.bar[0:1]
        _push(ws, [pair for weights, flag in self.peers for pair in ((weights, topk_weights), (flag, epoch))])
        self.launch(*self._args(h, layout.meta, w_down, y, layout.row_of_pair, out))
        self._off()
        _join(ws)
        return out


@declare_op(collective=True)
def group_gemm_rs(h: torch.Tensor, w_down_shard: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  layout: GroupLayout | None = None, method: str = "auto",
                  out: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """Multiply every pair's row of h by its expert's down-projection slice, sum each token's k results with
    its routing weights, and reduce-scatter the sum back to the token's rank over `group` (default: the world;
    W its size), overlapped.

    h (W m k, N') bf16/fp16: the grouped intermediate in GroupLayout order (ag_group_gemm's output after the
    activation); w_down_shard (E, N', hidden) of that dtype: every expert's slice of the down projection on
    this rank; topk_idx (m, k) int64/int32 and topk_weights (m, k) fp32: this rank's routing, as given to
    ag_group_gemm; layout: what ag_group_gemm returned (None: made again from every rank's topk_idx, an
    all_gather, and topk_idx's values checked on the device as ag_group_gemm checks them). Contiguous.
    Returns (m, hidden): for each of my tokens, sum over ranks q in rank order of q's partial, sum over j of
    topk_weights[t, j] * (h[row of (t, j)] @ w_down_shard[expert] on rank q, rounded to the dtype), in fp32
    and rounded once per rank; pairs with topk_idx -1 add nothing. `out`: a contiguous (m, hidden) tensor to
    write the result into.
    method: "overlap" (one persistent kernel: each rank chunk's GEMM, then its weighted sums pushed into the
    owner's workspace while the next chunk computes; needs the partials and routing weights to fit the
    workspace), "baseline" (the grouped GEMM, the weighted sum by topk_sum_kernel, weft reduce_scatter), "auto"
    (overlap where it can take the call, baseline on one rank). Collective over the group: every member passes
    the same shapes and method.

    Checks on the device, with no host sync, raised as ag_group_gemm's are (a ValueError at this rank's next
    call of the family; under the interpreter, this call once its launches have run):
    - topk_idx's values, where this call reads them (layout None): a bad row names topk_idx, the row and the
      expert; the call has then written the result (`out` if given) with that row's bad entries adding nothing
      and a repeated expert's pair added twice, and nothing else of the caller's.
    - a layout's row numbers are used only within this call's rows.

    Members whose overlapped calls differ (m, k, E, hidden or dtype; or of which one calls ag_group_gemm) get
    weft.SignatureMismatch on every member, naming both calls (the cross-rank signature check; on GPUs at the
    next call of the family): the result (`out` if given) is not written and no partial is sent.
    """
    g = resolve(group)
    found = plan(g, lambda: ("group_gemm_rs", signature(h), signature(w_down_shard), signature(topk_idx),
                             signature(topk_weights), layout is None, method, None if out is None else signature(out)),
                 lambda: GroupGemmRsPlan(g, h, w_down_shard, topk_idx, topk_weights, method, out, layout is None))
    found.check_layout(layout)
    return _checked(found, h, w_down_shard, topk_idx, topk_weights, layout, out)


# -- the operators (inference) ---------------------------------------------------------------------------------
#   torch.ops.weft.ag_group_gemm(tokens_shard, w_experts_shard, topk_idx, group_name, method)
#                                                               -> (inter, the layout's meta, row_of_pair)
#   torch.ops.weft.group_gemm_rs(h, w_down_shard, topk_idx, topk_weights, meta, row_of_pair, group_name, method)
#                                                               -> (m, hidden)  (meta, row_of_pair: the layout, or
#                                                                  None both)

@ag_group_gemm.define
def ag_group_gemm_op(tokens_shard: torch.Tensor, w_experts_shard: torch.Tensor, topk_idx: torch.Tensor,
                     group_name: str, method: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inter, layout = ag_group_gemm.eager(tokens_shard, w_experts_shard, topk_idx, method=method, group=group_name)
    return inter, layout.meta, layout.row_of_pair


@ag_group_gemm_op.register_fake
def _(tokens_shard, w_experts_shard, topk_idx, group_name, method="auto"):
    world_size = group_size(group_name)
    m, k = topk_idx.shape
    experts, _, n = w_experts_shard.shape
    return (tokens_shard.new_empty((world_size * m * k, n)),
            topk_idx.new_empty((world_size, experts + 2 + m * k), dtype=torch.int32),
            topk_idx.new_empty((world_size * m, k), dtype=torch.int32))


@ag_group_gemm.traced
def _(tokens_shard, w_experts_shard, topk_idx, method="auto", out=None, group=None):
    inter, meta, row_of_pair = torch.ops.weft.ag_group_gemm(tokens_shard, w_experts_shard, topk_idx,
                                                            group_name(group), method)
    return into(out, inter), GroupLayout(meta, w_experts_shard.shape[0], topk_idx.shape[1], topk_idx.shape[0],
                                         row_of_pair)


@group_gemm_rs.define
def group_gemm_rs_op(h: torch.Tensor, w_down_shard: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     meta: Optional[torch.Tensor], row_of_pair: Optional[torch.Tensor], group_name: str,
                     method: str = "auto") -> torch.Tensor:
    layout = None if meta is None else GroupLayout(meta, w_down_shard.shape[0], topk_idx.shape[1], topk_idx.shape[0],
                                                   row_of_pair)
    return group_gemm_rs.eager(h, w_down_shard, topk_idx, topk_weights, layout, method=method, group=group_name)


@group_gemm_rs_op.register_fake
def _(h, w_down_shard, topk_idx, topk_weights, meta, row_of_pair, group_name, method="auto"):
    return h.new_empty((topk_idx.shape[0], w_down_shard.shape[2]))


@group_gemm_rs.traced
def _(h, w_down_shard, topk_idx, topk_weights, layout=None, method="auto", out=None, group=None):
    meta, row_of_pair = (None, None) if layout is None else (layout.meta, layout.row_of_pair)
    return into(out, torch.ops.weft.group_gemm_rs(h, w_down_shard, topk_idx, topk_weights, meta, row_of_pair,
                                                  group_name(group), method))


# Signatures for the sm_90 compile check (weft.testing.compile): both GPU tilings, bf16 and fp16, the
# ag_group_gemm (gather, wait) and group_gemm_rs baseline (no gather, no wait) forms; Qwen3-30B-A3B's 128
# experts top-8 at 4 ranks and Mixtral's 8 top-2 at 2; operands by TMA (both, or the weights alone with the
# gather) and by pointers.
def _compile_tiles(big: bool):
    t = tuning.shipped("moe_tp.tiles")[0]["large" if big else "small"]
    bm, bn, bk, stages, warps, flatten = (t["block_m"], t["block_n"], t["block_k"], t["num_stages"], t["num_warps"],
                                          t["flatten"])
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages), warps, flatten


def _operands(t: str, tiles: dict, a_tma: bool, w_tma: bool, a: str = "a") -> dict:
    bm, bn, bk = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
    return {a: f"tensordesc<{t}[{bm}, {bk}]>" if a_tma else f"*{t}",
            "w": f"tensordesc<{t}[{bk}, {bn}]>" if w_tma else f"*{t}"}


def _chunks_case(t: str, big: bool, gather: bool, experts: int, k: int, world: int, tma: bool):
    tiles, warps, flatten = _compile_tiles(big)
    sig = dict(**_operands(t, tiles, tma and not gather, tma), meta="*i32", out=f"*{t}", ready="*i32", bar="*i32",
               heap="*i64", mapping=wl.TileMapping("*i32", "constexpr", "constexpr", "constexpr", "constexpr"),
               shapes="*i32", err="*i64", m="i32", N="i32", K="i32", meta_stride="i32", fp="i32", sig="*i64")
    sig = {name: sig[name] for name in group_gemm_chunks_kernel.arg_names if name in sig}
    consts = {("mapping", 1): 1024, ("mapping", 2): 2048, ("mapping", 3): 0, ("mapping", 4): 8}
    consts |= dict(E=experts, TOP_K=k, WORLD=world, GATHER=gather, WAIT=gather, BLOCK_M=tiles["BLOCK_M"],
                   BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"], BLOCK_E=triton.next_power_of_2(experts + 2),
                   NUM_STAGES=tiles["NUM_STAGES"], NUM_PROGRAMS=132, EVEN_K=True, EVEN_N=big,
                   A_TMA=tma and not gather, W_TMA=tma, FLATTEN=flatten)
    return group_gemm_chunks_kernel, sig, consts, dict(num_warps=warps, min_arch=90 if tma else 0, divisible=("N", "K"))


def _rs_case(t: str, big: bool, experts: int, k: int, world: int, tma: bool):
    tiles, warps, flatten = _compile_tiles(big)
    sig = dict(**_operands(t, tiles, tma, tma, "h"), meta="*i32", y=f"*{t}", row_of_pair="*i32", weights="*fp32",
               recv=f"*{t}", out=f"*{t}", done="*i32", ready="*i32", pushed="*i32", bar="*i32", heap="*i64",
               sig="*i64", m="i32", N="i32", K="i32", meta_stride="i32")
    sig = {name: sig[name] for name in group_gemm_rs_kernel.arg_names if name in sig}
    consts = dict(E=experts, TOP_K=k, WORLD=world, **tiles, BLOCK_E=triton.next_power_of_2(experts + 2),
                  NUM_PROGRAMS=132, EVEN_K=big, EVEN_N=True, A_TMA=tma, W_TMA=tma, FLATTEN=flatten, BLOCK_T=16,
                  BLOCK_H=256)
    consts = {name: consts[name] for name in group_gemm_rs_kernel.arg_names if name in consts}
    return group_gemm_rs_kernel, sig, consts, dict(num_warps=warps, min_arch=90 if tma else 0, divisible=("N", "K"))


# (dtype, large tiles, experts, k, world): the kernels unroll their chunk loop, so a case at W ranks compiles W
# mainloops (~17 s at 8 ranks on a CI core): Qwen3-30B-A3B's experts at 4 ranks, fp16 and the small tiles at 2.
_COMPILE_SHAPES = [("bf16", True, 128, 8, 4), ("bf16", True, 8, 2, 2), ("bf16", False, 8, 2, 2),
                   ("fp16", True, 8, 2, 2)]

COMPILE_CASES = [(moe_tp_start_kernel, dict(bar="*i32", heap="*i64", done="*i32", sig="*i64", err="*i64", fp="i32"),
                  dict(DONE=d, BLOCK_D=b),
                  dict(num_warps=1)) for d, b in ((0, 1), (3, 4))] + [
    _chunks_case(t, big, gather, experts, k, world, tma) for t, big, experts, k, world in _COMPILE_SHAPES
    for gather in (True, False) for tma in (True, False)
] + [
    _rs_case(t, big, experts, k, world, tma) for t, big, experts, k, world in _COMPILE_SHAPES for tma in (True, False)
]
