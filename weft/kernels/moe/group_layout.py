"""The grouped layout of (token, expert) pairs: GroupLayout, the counting sort that makes it on the device, and
the weighted top-k sum that brings each token's rows back together. The tensor-parallel MoE ops (tp) and their
one-rank forms (routed) share them.

The grouped layout (`GroupLayout`). A (token, expert) *pair* is one entry of topk_idx. The intermediate has
one row per pair of every rank's tokens, W m k rows, in rank chunks: chunk c (rows [c m k, (c + 1) m k))
holds rank c's pairs sorted by expert (stably: by token t, then slot j, pair index t k + j); the pairs
whose topk_idx is -1 come last in the chunk, as rows of zeros. A chunk depends only on its rank's topk_idx,
so each rank sorts its own pairs (`LayoutLaunches.chunk`: three launches, no host sync) and sends the result
along with its tokens: the consumer of a chunk needs nothing else.
An entry outside [0, E) (-1, or a bad value whose check has not raised yet: routing) is a pair without expert.

topk_sum_kernel: each token's k rows of the expert outputs (in layout order, found by row_of_pair) summed with
its routing weights in fp32, rounded once: group_gemm_rs's baseline and routed_gemm_sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..all_gather import all_gather
from ..blocks import cast
from ..common import Launch
from ..registry import export


@export
class GroupLayout:
    """Where ag_group_gemm put every rank's (token, expert) pairs, and what group_gemm_rs needs to bring them back.

    The grouped intermediate has W m k rows in rank chunks: chunk c (rows [c m k, (c + 1) m k)) holds the pairs
    of rank c's m tokens, sorted by expert, then by pair index t k + j; the pairs with topk_idx -1 come last.
    On the device:
    - meta (W, E + 2 + m k) int32: row c is rank c's chunk (LayoutLaunches.chunk): `starts[c]` (E + 2: rows
      [starts[c, e], starts[c, e + 1]) of the chunk are expert e's, rows from starts[c, E] on have no expert,
      starts[c, E + 1] = m k) and `pair_of_row[c]` (m k: the pair t k + j of rank c that row i of the chunk holds);
    - row_of_pair (W m, k) int32: the global row of the j-th pair of gathered token g (token t of rank c is
      g = c m + t), -1 where topk_idx is -1.
    Fields world_size, num_experts, top_k, tokens_per_rank (m). LayoutLaunches.gathered makes one from the
    gathered chunks.
    """

    def __init__(self, meta: torch.Tensor, num_experts: int, top_k: int, tokens_per_rank: int,
                 row_of_pair: torch.Tensor):
        self.meta, self.world_size, self.num_experts = meta, meta.shape[0], num_experts
        self.top_k, self.tokens_per_rank, self.row_of_pair = top_k, tokens_per_rank, row_of_pair

    @property
    def starts(self) -> torch.Tensor:
        return self.meta[:, :self.num_experts + 2]

    @property
    def pair_of_row(self) -> torch.Tensor:
        return self.meta[:, self.num_experts + 2:]


def _check_layout(layout, want: tuple, dev) -> None:
    """layout is None or a GroupLayout for (world size, experts, k, tokens per rank) = want on dev."""
    if layout is None:
        return
    if not isinstance(layout, GroupLayout):
        raise TypeError(f"layout must be a GroupLayout (what ag_group_gemm or routed_gemm returned) or None, got "
                        f"{type(layout).__name__}")
    have = (layout.world_size, layout.num_experts, layout.top_k, layout.tokens_per_rank)
    if have != want or layout.meta.device != dev:
        raise ValueError(f"layout is for (world size, experts, k, tokens per rank) = {have} on "
                         f"{layout.meta.device}, but this call has {want} on {dev}")


# A stable counting sort of one rank's pairs by expert, in BLOCK-pair blocks: pair_counts_kernel counts each
# block's pairs per expert; pair_scan_kernel turns the counts into each expert's pairs in earlier blocks (a scan
# down each expert's column, linear in the blocks); pair_place_kernel puts each pair of its block at its expert's
# start + the expert's pairs in earlier blocks + the expert's pairs before it in the block. Three launches, where
# torch takes ~10 small kernels (where, sort, searchsorted, copies) and as many ~5 us host calls.

@triton.jit
def _expert_of(topk, i, pairs, E: tl.constexpr):
    """The sort key of pairs i: the expert, E for none (-1, or a bad entry not raised yet), E + 1 past the end."""
    v = tl.load(topk + i, mask=i < pairs, other=-1)
    return tl.where(i < pairs, tl.where((v >= 0) & (v < E), v, E), E + 1).to(tl.int32)


@triton.jit
def _sort_distinct(x, N_DIMS: tl.constexpr):
    """x (2^N_DIMS distinct ints) in ascending order: tl.sort's bitonic network over x as a hypercube, with each
    compare-and-swap's partner found by a sum over its axis of 2 (a + b - a, exact in wrapping integers) where
    tl.sort takes an xor-sum, which the interpreter runs element by element in Python (~300x slower on cpu).
    No nested jit calls: each costs the interpreter ~1 ms."""
    h = tl.reshape(x, [2] * N_DIMS)
    two = tl.arange(0, 2)
    for stage in tl.static_range(1, N_DIMS + 1):
        if stage < N_DIMS:  # alternate directions in blocks of 2^stage; ascending at the last stage
            flip = tl.reshape(two, [1] * (N_DIMS - stage - 1) + [2] + [1] * stage)
        else:
            flip = 0
        for i in tl.static_range(stage):  # the pairs differ in the (stage - 1 - i)-th innermost axis
            right = tl.reshape(two, [1] * (N_DIMS - stage + i) + [2] + [1] * (stage - 1 - i))
            partner = tl.sum(h, N_DIMS - stage + i, keep_dims=True) - h
            h = tl.where((h > partner) != (flip ^ right), partner, h)
    return tl.reshape(h, [2 ** N_DIMS])


@triton.jit
def pair_counts_kernel(topk, counts, pairs, E: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[p, e] = the pairs of block p (pairs [p BLOCK, (p + 1) BLOCK)) with key e, for e <= E (0 beyond)."""
    p = tl.program_id(0)
    bins = tl.arange(0, BLOCK_E)
    hist = tl.histogram(_expert_of(topk, p * BLOCK + tl.arange(0, BLOCK), pairs, E), BLOCK_E)
    tl.store(counts + p * BLOCK_E + bins, tl.where(bins <= E, hist, 0))


@triton.jit
def pair_scan_kernel(counts, blocks, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
    """counts (blocks + 1, BLOCK_E), in place: row p < blocks becomes, per key, the pairs of the blocks before p,
    and row `blocks` the pairs in all; program s scans keys [s BLOCK_S, (s + 1) BLOCK_S), BLOCK_P blocks a step."""
    keys = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    carry = tl.zeros([BLOCK_S], tl.int32)
    for q0 in range(0, blocks, BLOCK_P):
        q = q0 + tl.arange(0, BLOCK_P)
        at = counts + q[:, None] * BLOCK_E + keys[None, :]
        live = (q < blocks)[:, None]
        c = tl.load(at, mask=live, other=0)
        tl.store(at, tl.cumsum(c, axis=0) - c + carry[None, :], mask=live)
        carry += tl.sum(c, axis=0)
    tl.store(counts + blocks * BLOCK_E + keys, carry)


@triton.jit
def pair_place_kernel(topk, counts, meta, pairs, blocks, E: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_E: tl.constexpr, LOG_BLOCK: tl.constexpr):
    """meta = [starts (E + 2) | pair_of_row (pairs)] (GroupLayout) from the scanned counts: block p places its
    pairs; program 0 writes starts."""
    p = tl.program_id(0)
    bins = tl.arange(0, BLOCK_E)
    before = tl.load(counts + p * BLOCK_E + bins)  # each expert's pairs in the blocks before p
    total = tl.load(counts + blocks * BLOCK_E + bins)
    starts = tl.cumsum(total, axis=0) - total  # starts[E + 1] = pairs: keys above E are never counted
    if p == 0:
        tl.store(meta + bins, starts, mask=bins < E + 2)
    i = tl.arange(0, BLOCK)
    key = _expert_of(topk, p * BLOCK + i, pairs, E)
    # The block's pairs stably sorted by key (sorting key BLOCK + index, in registers): the r-th of that order
    # is the (r - first[key])-th of its key in the block. (Comparing each pair with the block's earlier ones, a
    # loop that reloaded the keys, took ~9 us a program on an H200 whatever the block count.)
    order = _sort_distinct(key * BLOCK + i, LOG_BLOCK)
    sorted_key = order // BLOCK
    hist = tl.histogram(key, BLOCK_E)
    first = tl.cumsum(hist, axis=0) - hist
    row = tl.gather(starts + before - first, sorted_key, 0) + i
    tl.store(meta + E + 2 + row, p * BLOCK + order % BLOCK, mask=sorted_key <= E)


@triton.jit
def row_of_pair_kernel(metas, meta_copy, row_of_pair, pairs, width, E: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_E: tl.constexpr, COPY: tl.constexpr):
    """row_of_pair (W m k,) of every rank's chunk in metas (W, width): the inverse of pair_of_row, -1 for the
    rows from starts[E] on; COPY: metas copied into meta_copy as well (metas is the workspace, which the next
    call overwrites). A pair index outside [0, pairs) (a chunk a peer sent that does not match: the GEMM
    records it) is not stored."""
    c = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < pairs
    chunk = metas + c * width
    pair = tl.load(chunk + E + 2 + i, mask=live)
    tl.store(row_of_pair + c * pairs + pair, tl.where(i < tl.load(chunk + E), c * pairs + i, -1),
             mask=live & (pair >= 0) & (pair < pairs))
    if COPY:
        tl.store(meta_copy + c * width + E + 2 + i, pair, mask=live)
        if tl.program_id(1) == 0:
            s = tl.arange(0, BLOCK_E)
            tl.store(meta_copy + c * width + s, tl.load(chunk + s, mask=s < E + 2), mask=s < E + 2)


class LayoutLaunches:
    """The launches that make GroupLayouts for one topk_idx signature (a plan's): `chunk` sorts this rank's pairs
    by expert, `gathered` makes the GroupLayout of every rank's chunks. `block`: pairs per program of the sort
    (the tests make it small, to run several blocks). copy: `gathered` copies the chunks out of its argument
    (the workspace) into the layout's own meta."""

    def __init__(self, topk_idx: torch.Tensor, num_experts: int, world_size: int, copy: bool, block: int = 256):
        m, k = topk_idx.shape
        e, dev = num_experts, topk_idx.device
        self.e, self.k, self.m, self.world_size, self.copy = e, k, m, world_size, copy
        self.pairs = pairs = m * k
        self.width = width = e + 2 + pairs
        block = min(block, max(32, triton.next_power_of_2(pairs)))
        self.blocks = blocks = triton.cdiv(pairs, block)
        block_e = triton.next_power_of_2(e + 2)
        # The sort's scratch: per block and key, its pairs, then (scanned) those before it; a last row of totals
        # (zeros when there are no pairs: no launch writes it then).
        self.counts = torch.zeros((blocks + 1, block_e), dtype=torch.int32, device=dev)
        self.meta = meta = torch.empty(width, dtype=torch.int32, device=dev)  # `all_gathered`'s chunk
        sort = dict(E=e, BLOCK=block, BLOCK_E=block_e)
        self.count = Launch(pair_counts_kernel, (blocks,), (topk_idx, self.counts, pairs), sort) if blocks else None
        block_s = min(block_e, 32)
        self.scan = Launch(pair_scan_kernel, (block_e // block_s,), (self.counts, blocks),
                           dict(BLOCK_E=block_e, BLOCK_P=max(1, min(triton.next_power_of_2(blocks), 64)),
                                BLOCK_S=block_s)) if blocks else None
        self.place = Launch(pair_place_kernel, (max(blocks, 1),), (topk_idx, self.counts, meta, pairs, blocks),
                            dict(**sort, LOG_BLOCK=block.bit_length() - 1))
        metas = torch.empty((world_size, width), dtype=torch.int32, device=dev)
        rows = torch.empty(world_size * pairs, dtype=torch.int32, device=dev)
        self.invert = Launch(row_of_pair_kernel, (world_size, blocks), (metas, metas, rows, pairs, width),
                             dict(E=e, BLOCK=block, BLOCK_E=block_e, COPY=copy)) if blocks else None
        self.address = self.place.address

    def chunk(self, topk_idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (E + 2 + m k,) int32 = this rank's chunk of a GroupLayout, from its topk_idx (m, k): starts and
        pair_of_row. An entry outside [0, E) (-1, or a bad value not raised yet: module doc) is a pair without
        expert."""
        a = self.address
        if self.count is not None:
            self.count(a(topk_idx), a(self.counts), self.pairs)
            self.scan(a(self.counts), self.blocks)
        self.place(a(topk_idx), a(self.counts), a(out), self.pairs, self.blocks)
        return out

    def gathered(self, metas: torch.Tensor) -> GroupLayout:
        """The GroupLayout of every rank's chunk, metas (W, E + 2 + m k)."""
        meta = torch.empty_like(metas) if self.copy else metas
        rows = torch.empty((self.world_size * self.m, self.k), dtype=torch.int32, device=metas.device)
        if self.invert is not None:
            a = self.address
            self.invert(a(metas), a(meta), a(rows), self.pairs, self.width)
        elif self.copy:
            meta.copy_(metas)
        return GroupLayout(meta, self.e, self.k, self.m, rows)

    def all_gathered(self, topk_idx: torch.Tensor, group=None) -> GroupLayout:
        """The GroupLayout of every member's topk_idx: each member's chunk, all-gathered over `group` (weft
        all_gather); of one rank's (world_size 1), the chunk in a new tensor (the layout outlives the call)."""
        if self.world_size == 1:
            return self.gathered(self.chunk(topk_idx, torch.empty_like(self.meta))[None])
        return self.gathered(all_gather.eager(self.chunk(topk_idx, self.meta)[None], group=group))


# -- the weighted top-k sum of each token's rows ---------------------------------------------

@triton.jit
def _weighted_sum(y, row_of_pair, weights, g, live, cols, cols_live, N, rows, TOP_K: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp32 (BLOCK_T, BLOCK_H): for gathered tokens g, sum over j in order of weights[g, j] * y[row_of_pair[g, j],
    cols] (rows -1, or past y's `rows`, skipped: row_of_pair comes from the chunks the ranks sent)."""
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        r = tl.load(row_of_pair + g * TOP_K + j, mask=live, other=-1)
        wt = tl.load(weights + g * TOP_K + j, mask=live, other=0.0)
        v = tl.load(y + r.to(tl.int64)[:, None] * N + cols[None, :],
                    mask=((r >= 0) & (r < rows))[:, None] & cols_live[None, :], other=0.0)
        acc += wt[:, None] * v.to(tl.float32)
    return acc


@triton.jit
def topk_sum_kernel(y, row_of_pair, weights, out, tokens, N, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """out[t] = sum over j in order of weights[t, j] * y[row_of_pair[t, j]] (fp32, rounded once), for a block of
    BLOCK_T tokens and BLOCK_H columns: group_gemm_rs's baseline, the weighted sum of group_gemm_rs_kernel's
    RS items without the push (torch's loop over j took ~1 ms of Qwen3-30B-A3B's 8192 tokens on an H200)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = t < tokens
    acc = _weighted_sum(y, row_of_pair, weights, t, live, cols, cols < N, N, tokens * TOP_K, TOP_K, BLOCK_T,
                        BLOCK_H)
    tl.store(out + t.to(tl.int64)[:, None] * N + cols[None, :], cast(acc, out.dtype.element_ty),
             mask=live[:, None] & (cols < N)[None, :])


def _topk_sum_launch(group, y, row_of_pair, weights, out, tokens: int) -> Launch:
    """topk_sum_kernel over `tokens` rows of out (·, N) from y's rows (routed_gemm_sum, group_gemm_rs's
    baseline)."""
    n = out.shape[1]
    block_t, block_h = (16, 256) if group.device.type == "cuda" else (16, 32)
    return Launch(topk_sum_kernel, (triton.cdiv(tokens, block_t), triton.cdiv(n, block_h)),
                  (y, row_of_pair, weights, out, tokens, n),
                  dict(TOP_K=row_of_pair.shape[1], BLOCK_T=block_t, BLOCK_H=block_h), 4)


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    case for t in ("*i64", "*i32") for experts in (128, 8) for case in (
        (pair_counts_kernel, dict(topk=t, counts="*i32", pairs="i32"),
         dict(E=experts, BLOCK=256, BLOCK_E=triton.next_power_of_2(experts + 2)), dict(num_warps=4)),
        (pair_place_kernel, dict(topk=t, counts="*i32", meta="*i32", pairs="i32", blocks="i32"),
         dict(E=experts, BLOCK=256, BLOCK_E=triton.next_power_of_2(experts + 2), LOG_BLOCK=8),
         dict(num_warps=4)))
] + [
    (pair_scan_kernel, dict(counts="*i32", blocks="i32"), dict(BLOCK_E=block_e, BLOCK_P=64, BLOCK_S=min(block_e, 32)),
     dict(num_warps=4)) for block_e in (16, 512)
] + [
    (row_of_pair_kernel, dict(metas="*i32", meta_copy="*i32", row_of_pair="*i32", pairs="i32", width="i32"),
     dict(E=128, BLOCK=256, BLOCK_E=256, COPY=copy), dict(num_warps=4)) for copy in (True, False)
] + [
    (topk_sum_kernel, dict(y=t, row_of_pair="*i32", weights="*fp32", out=t, tokens="i32", N="i32"),
     dict(TOP_K=k, BLOCK_T=16, BLOCK_H=256), dict(num_warps=4, divisible=("N",))) for t in ("*bf16", "*fp16")
    for k in (8, 2)
]
