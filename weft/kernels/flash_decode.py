"""Decode-time attention: flash_decode on one GPU, sp_flash_decode with the KV cache sharded over ranks.

flash_decode(q, k_cache, v_cache, seqlens): one query token per sequence against its cached keys and
values, out[b, h] = softmax(scale * q[b, h] . K[b, :seqlens[b], h // G]) @ V[...], with G = q_heads /
kv_heads query heads per KV head (grouped-query attention; G = 1 is multi-head, kv_heads = 1
multi-query). Layouts as FlashAttention's flash_attn_with_kvcache: q (batch, q_heads, head_dim); KV
contiguous (batch, max_len, kv_heads, head_dim), or paged (num_pages, page_size, kv_heads, head_dim) with
block_table (batch, pages_per_seq) naming the page that holds each sequence's positions
[j * page_size, (j + 1) * page_size).

Split-KV. One query token is too little work for a GPU: batch x kv_heads programs would leave most SMs
idle while each walks a long sequence. So every sequence is cut into up to `splits` ranges, and one program handles
one (sequence, KV head, range). The ranges follow the sequence's own length, read on the device: a sequence of L
positions has ranges of _split_len(L) positions, a whole number of `split_unit`s (min_blocks_per_split key blocks),
as few as cover L in `splits` ranges; programs past the last range exit. So a short sequence in a long cache is
spread over the programs as a full one is (planning by the cache's length would give its first range all of it):

1. flash_decode_split_kernel loads BLOCK_N keys x head_dim per step and scores all G query heads of its
   KV head in one tl.dot (every KV byte is read once), keeping an online softmax in fp32 (running max
   m, running sum l, rescaled accumulator; exp2 with log2(e) folded into the scale). It writes its
   partial result: out_s = acc / l and lse_s = m + log2(l) (base 2), fp32.
   Where the splits come to one (the (sequence, KV head) programs alone fill a wave, e.g. 64 sequences of 8
   KV heads), it writes out and lse itself and there is no merge: the merge of one partial is that partial, so
   the bits are the merge's (Qwen3-8B decode step b64 on 1x H200, layers path: 6611 -> 6278 us at ctx 512, 15030
   -> 14662 at ctx 4096, with the one-wave split rule below).
2. flash_decode_merge_kernel combines the partials of a (sequence, query head) by log-sum-exp:
   lse = log2(sum_s 2^lse_s), out = sum_s 2^(lse_s - lse) out_s. That is exact: softmax over a union of
   key sets is the weighted mean of the softmaxes over the parts, weighted by their share of the
   normaliser. Ranges past a sequence's length are skipped; a sequence of length 0 gives out 0 and
   lse -inf.

sp_flash_decode: sequence parallelism over a group (default the world; ranks below are group ranks).
Rank r holds the r-th contiguous slice of every sequence's KV.
Each rank computes the partial (out, lse) of its slice with the split kernel and merges its splits;
since the merge is the same log-sum-exp whether the parts are splits or ranks, the ranks then only
exchange their per-rank partials (head_dim + 1 fp32 words per (sequence, head)) and merge them, in as
many launches as flash_decode: the split kernel, then

3. sp_flash_decode_merge_kernel, a persistent grid of min(rows, SM count) programs, program p owning
   rows p, p + P, ... Phase 1: for each of its rows, merge the local splits as in 2 and push the result,
   as LL words (wl.pack_ll: 4 data bytes and the epoch in one 8-byte store), into slot [me] of every
   rank's exchange buffer. Phase 2: for each of its rows, wait for the W slots' words at once
   (wl.wait_ll) and merge them as one vector over ranks, lane q holding rank q's partial on every rank,
   so every rank computes the same bits.
   Deadlock-free: a program pushes all its rows before its first wait, so whatever it waits for was
   pushed by a peer program that is running or has run; with at most one program per SM, all are
   resident (work of other streams only delays them).

Why not merge (and push) in the split kernel's last program per KV head (a counter of finished splits, the
last one merges)? For sp_flash_decode the exchange would still need a second kernel to wait in: the split
programs cannot wait for peers (they are many more than the SMs, so a waiting one could block the ones it
waits for). For flash_decode it was built and measured (1x H200, Qwen3-8B decode step, fused path, graph
replay, 2026-11-26): the merge kernel's launch went (~2 us and the ~0.75 us gap between kernels), but the last
split's tail grew by ~2.4 us (the release of its partials, the counter's round trip, the partials' loads, in a
kernel already at 255 registers): the step took 4347 us at b1 ctx 512 against 4343 with two launches, 4761
against 4800 at b8, 4574 against 4557 at b1 ctx 4096, and loading more partials at once (16 splits, not 8) made
b1 slower still (4375, 4637). Not kept: one merge kernel after the split kernel keeps the split kernel as it
is.

Memory ordering of the exchange. An LL word is written with one 8-byte store, single-copy atomic: a
reader that sees the current epoch in a word's high half sees the payload stored with it, so there is
no separate flag, no fence and no release/acquire pair; the reader polls the words themselves with
volatile loads. The epoch counts the merge kernel's launches on the device (wl.next_epoch: every
program takes a ticket, the last one publishes the next epoch), so it holds whatever the grid size of
each launch: calls of different batch sizes, and passes, may follow each other in any order. The
buffer has two halves, used by epoch parity. Rank s writes half e % 2 of rank q in launch e only after
its launch e - 1 completed, which had received q's words of launch e - 1, pushed by q's launch e - 1,
which started after q's launch e - 2 (the last reader of half e % 2) had completed. Old words in a
half carry epoch e - 2, never e. So calls follow each other, and replay in CUDA graphs, with no reset
and no host synchronisation. All kernels of one call run in order on the caller's stream.

The partials' workspace of the split kernel is a plain per-call torch.empty (the caching allocator makes
it cheap, and its size follows the call). sp_flash_decode's exchange buffer is symmetric and bounded:
one per group (the op family's workspace), sized for SP_MAX_ENTRIES = batch * q_heads *
(head_dim + 1) words per rank whatever the call's shape; a larger batch goes through in passes of
sequences (split kernel and merge kernel per pass). sp_flash_decode_merge_only runs the merge kernel
alone on ready partials, to measure the cross-rank part (`weft bench attention --ops sp`).

On a group that spans nodes the merge kernel cannot reach the other nodes' buffers: there each member merges its
splits with flash_decode's merge kernel (fp32 out and lse), the partials go through the hierarchical all_gather
and every member merges them in group-rank order (hierarchical.SpFlashDecode).

Lengths and pages are data on the device: checking them on the host would cost a sync per call. The split
kernel checks them as it reads them: a length outside [0, max_len] is clamped, a page outside [0, num_pages)
is never dereferenced (its loads are masked), and either is recorded in the family's error word on this
rank (common.ErrorWord, the mechanism of the MoE routing checks): op, sequence, bad value and the call's
limits. The family's next call on this rank raises it as a ValueError (flash_decode before it launches
anything, sp_flash_decode after its launches, since its peers wait for them), and so does
weft.check_errors().
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import torch
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning
from . import hierarchical
from .blocks import cast
from ..runtime.world import is_initialized
from .common import (ErrorWord, Launch, Plan, group_name, plan, resolve, signature, signature_words, signatures,
                     workspace, world_or_raise, zero_everywhere)
from .registry import declare_op

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (64, 128, 256)
MAX_PAGE_SIZE = 256

# Split-KV on GPUs (weft.tuning, family flash_decode): the most splits whose programs fit split_programs_per_sm
# per SM (one wave: the split kernel holds 2 programs an SM by its shared memory; a second, part-filled wave of
# programs as long as the first costs more than the longer splits do: Qwen3-8B decode b8 ctx 4096 on 1x H100,
# 5 splits in 320 programs 7690-7698 us a step, 4 in 256 7625-7628), but give every split at least
# min_blocks_per_split blocks of keys (so the partials' write and merge stay a few per cent of the KV read) and at
# most max_splits splits (the merge walks them). A grid past one wave (more (sequence, KV head) programs than that)
# runs flash_decode.stages_past_one_wave pipeline stages, not 3 (_stages).
# On the cpu backend (interpreter): few splits of small blocks, enough to exercise the split logic.
CPU_MAX_SPLITS = 3
CPU_BLOCK_N = 16
# Partials merged per step of flash_decode's merge kernel.
SPLIT_BLOCK = 16
# sp_flash_decode's merge kernel (8 warps) merges up to SP_SPLIT_WORDS // head_dim partials per step: all
# of a row's splits (at most flash_decode.max_splits) in one step at head_dim 128, so that the local merge, on the
# latency path of the exchange, is one round of loads rather than one per 16 splits.
SP_SPLIT_WORDS = 8192
SP_NUM_WARPS = 8
# Query heads per split program at most: a larger G (multi-query with many heads) is cut into chunks,
# each of which reads the KV once; fewer than 16 rows are padded (tl.dot needs 16).
MAX_HEADS_PER_PROGRAM = 64

# sp_flash_decode: words per rank in the exchange buffer (batch * q_heads * (head_dim + 1)): 1 MiB of LL
# words per slot, 2 * W slots per rank. Larger batches go through in passes of sequences.
SP_MAX_ENTRIES = 128 << 10
# Programs of the merge kernel on the cpu backend at most (on GPUs: one per SM at most).
CPU_SP_PROGRAMS = 3

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)

# The split kernel's error record (an ErrorWord of two int64 words): word 1 = op << 62 | num_pages << 31 |
# max_len (the call's limits, the same from every program of a launch), stored first; word 0 = ERROR_SET |
# kind << 61 | row << 32 | the bad value (32 bits), kind 0 a block_table page, 1 a sequence length.
ERROR_SET = tl.constexpr(1 << 62)
OPS = ("flash_decode", "sp_flash_decode")
LIMIT = (1 << 31) - 1  # each limit's field


# -- device helpers -------------------------------------------------------------

@triton.jit
def _dot(a, b, acc):
    """acc + a @ b in fp32. Triton 3.6's interpreter gets bf16 dots wrong: multiply in fp32 there. fp32
    inputs are multiplied in full precision (not tf32): fp32 KV is for checking."""
    if wl.INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _seqlen(seqlens, b, max_len):
    """Sequence b's length, clamped to [0, max_len] so that a bad length cannot read outside the cache."""
    return tl.minimum(tl.maximum(tl.load(seqlens + b), 0), max_len)


@triton.jit
def _split_len(seqlen, splits, split_unit):
    """Positions a range of a sequence of seqlen positions covers: the fewest whole split_units that cover it in
    `splits` ranges (one unit for an empty sequence: no live range). Its ranges [i L, (i + 1) L) for i <
    cdiv(seqlen, L) are live; the split kernel and the merges compute it alike."""
    return tl.maximum(tl.cdiv(tl.cdiv(seqlen, split_unit), splits), 1) * split_unit


@triton.jit
def _record(err, limits, row, value, KIND: tl.constexpr):
    """Record a bad value of sequence `row` (one program's word: any program may record over another)."""
    tl.store(err + 1, limits)
    tl.store(err, ERROR_SET | (KIND << 61) | (row.to(tl.int64) << 32) | (value.to(tl.int64) & 0xFFFFFFFF))


@triton.jit
def _merge_splits(part_out, part_lse, row, splits, live, D: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """The log-sum-exp merge of the first `live` partials of `row` (read past L1): (out [D] fp32, lse base 2)."""
    offs_s = tl.arange(0, SPLIT_BLOCK)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    for s0 in range(0, live, SPLIT_BLOCK):
        s = s0 + offs_s
        mask = s < live
        idx = tl.cast(row, tl.int64) * splits + s  # row may be a loop counter: a plain int under the interpreter
        lse_s = tl.load(part_lse + idx, mask=mask, other=float("-inf"), cache_modifier=".cg")
        out_s = tl.load(part_out + idx[:, None] * D + offs_d[None, :], mask=mask[:, None], other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse_s, axis=0))  # finite: partial s0 is live
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse_s - m_new)
        acc = acc * alpha + tl.sum(weight[:, None] * out_s, axis=0)
        l = l * alpha + tl.sum(weight, axis=0)
        m = m_new
    return acc / tl.where(l > 0, l, 1.0), m + tl.log2(l)


# -- kernels --------------------------------------------------------------------

@triton.jit(do_not_specialize=["max_len", "split_unit", "splits", "num_pages", "first_row", "limits"])
def flash_decode_split_kernel(q, k, v, seqlens, block_table, part_out, part_lse, out, lse, err, scale_log2, max_len,
                              split_unit, splits, kv_heads, q_heads, q_sb, q_sh, k_s0, k_s1, k_sh, v_s0, v_s1, v_sh,
                              bt_sb, bt_sp, num_pages, first_row, limits, GROUP: tl.constexpr, HEADS: tl.constexpr,
                              CHUNKS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                              PAGED: tl.constexpr, DIRECT: tl.constexpr, RETURN_LSE: tl.constexpr):
    """Program (pid, split) of the split step (_split_program); DIRECT (one split): the result itself into out
    (and lse), no partials."""
    _split_program(tl.program_id(0), tl.program_id(1), q, k, v, seqlens, block_table, part_out, part_lse, err,
                   scale_log2, max_len, split_unit, splits, kv_heads, q_heads, q_sb, q_sh, k_s0, k_s1, k_sh, v_s0,
                   v_s1, v_sh, bt_sb, bt_sp, num_pages, first_row, limits, GROUP, HEADS, CHUNKS, D, BLOCK_N,
                   PAGE_SIZE, PAGED, out, lse, DIRECT, RETURN_LSE)


@triton.jit
def _split_program(pid, split, q, k, v, seqlens, block_table, part_out, part_lse, err, scale_log2, max_len,
                   split_unit, splits, kv_heads, q_heads, q_sb, q_sh, k_s0, k_s1, k_sh, v_s0, v_s1, v_sh, bt_sb, bt_sp,
                   num_pages, first_row, limits, GROUP: tl.constexpr, HEADS: tl.constexpr, CHUNKS: tl.constexpr,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, out=None,
                   lse=None, DIRECT: tl.constexpr = False, RETURN_LSE: tl.constexpr = False):
    """Partial attention of query heads [c * HEADS, (c + 1) * HEADS) of KV head kvh's group, sequence b,
    over positions [split * L, (split + 1) * L) of the sequence, L = _split_len(its length).

    Program (((b * kv_heads + kvh) * CHUNKS + c), split). KV row of position n: contiguous: k + b * k_s0 +
    n * k_s1; paged: k + page * k_s0 + (n % PAGE_SIZE) * k_s1, page = block_table[b, n // PAGE_SIZE].
    Writes part_out[row, split, :] = acc / l and part_lse[row, split] = m + log2(l), row = b * q_heads +
    head, for a split that holds at least one position. DIRECT (the only split: the merge would copy it): out[row]
    = acc / l in out's dtype (0 for an empty sequence) and, with RETURN_LSE, lse[row] in natural log (-inf for an
    empty sequence), the merge's bits.

    Lengths and pages are data: a length outside [0, max_len] is clamped and a page outside [0, num_pages)
    is never read (its positions count as zero keys and values); either is recorded in the error word `err`
    (_record: sequence first_row + b, the call's `limits`) for the host to raise.

    q, keys and values are read past L1 (.cg): in decode_step's persistent kernel another program of the same
    launch has just written them.
    """
    c = pid % CHUNKS
    kvh = (pid // CHUNKS) % kv_heads
    b = pid // (CHUNKS * kv_heads)
    raw_len = tl.load(seqlens + b)
    seqlen = tl.minimum(tl.maximum(raw_len, 0), max_len)
    if (split == 0) & (pid % (CHUNKS * kv_heads) == 0):  # one program per sequence checks its length
        if (raw_len < 0) | (raw_len > max_len):
            _record(err, limits, first_row + b, raw_len, 1)
    split_len = _split_len(seqlen, splits, split_unit)
    start = split * split_len
    end = tl.minimum(start + split_len, seqlen)

    g = c * HEADS + tl.arange(0, HEADS)  # query heads within the group; padded rows are masked
    live_rows = g < GROUP
    heads = kvh * GROUP + g
    offs_d = tl.arange(0, D)
    qv = tl.load(q + b.to(tl.int64) * q_sb + heads[:, None] * q_sh + offs_d[None, :], mask=live_rows[:, None],
                 other=0.0, cache_modifier=".cg")

    m = tl.full([HEADS], float("-inf"), tl.float32)
    l = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        in_seq = pos < end
        readable = in_seq
        if PAGED:
            page = tl.load(block_table + b * bt_sb + (pos // PAGE_SIZE) * bt_sp, mask=in_seq, other=0)
            bad = in_seq & ((page < 0) | (page >= num_pages))
            if tl.max(bad.to(tl.int32), axis=0) > 0:
                first = tl.min(tl.where(bad, pos, end), axis=0)
                _record(err, limits, first_row + b, tl.sum(tl.where(pos == first, page, 0), axis=0), 0)
            readable = in_seq & ~bad
            k_rows = page.to(tl.int64) * k_s0 + (pos % PAGE_SIZE) * k_s1 + kvh * k_sh
            v_rows = page.to(tl.int64) * v_s0 + (pos % PAGE_SIZE) * v_s1 + kvh * v_sh
        else:
            k_rows = b.to(tl.int64) * k_s0 + pos.to(tl.int64) * k_s1 + kvh * k_sh
            v_rows = b.to(tl.int64) * v_s0 + pos.to(tl.int64) * v_s1 + kvh * v_sh
        kb = tl.load(k + k_rows[:, None] + offs_d[None, :], mask=readable[:, None], other=0.0, cache_modifier=".cg")
        vb = tl.load(v + v_rows[:, None] + offs_d[None, :], mask=readable[:, None], other=0.0, cache_modifier=".cg")
        s = _dot(qv, tl.trans(kb), tl.zeros([HEADS, BLOCK_N], tl.float32)) * scale_log2
        s = tl.where(in_seq[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every block holds at least one position
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(vb.dtype), vb, acc * alpha[:, None])
        m = m_new

    rows = b * q_heads + heads
    if DIRECT:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]  # the merge of one live partial is that partial
        tl.store(out + rows.to(tl.int64)[:, None] * D + offs_d[None, :], cast(o, out.dtype.element_ty),
                 mask=live_rows[:, None])
        if RETURN_LSE:
            tl.store(lse + rows, (m + tl.log2(l)) * LN2, mask=live_rows)
    else:
        live = live_rows & (start < end)
        idx = rows.to(tl.int64) * splits + split
        tl.store(part_out + idx[:, None] * D + offs_d[None, :], acc / l[:, None], mask=live[:, None])
        tl.store(part_lse + idx, m + tl.log2(l), mask=live)


@triton.jit(do_not_specialize=["max_len", "split_unit", "splits"])
def flash_decode_merge_kernel(part_out, part_lse, seqlens, out, lse, max_len, split_unit, splits, q_heads,
                              D: tl.constexpr, SPLIT_BLOCK: tl.constexpr, RETURN_LSE: tl.constexpr):
    """out[row] (q's dtype) and, with RETURN_LSE, lse[row] (natural log) from the live partials of row =
    b * q_heads + head: program `row` (_merge_program)."""
    _merge_program(tl.program_id(0), part_out, part_lse, seqlens, out, lse, max_len, split_unit, splits, q_heads, D,
                   SPLIT_BLOCK, RETURN_LSE)


@triton.jit
def _merge_program(row, part_out, part_lse, seqlens, out, lse, max_len, split_unit, splits, q_heads, D: tl.constexpr,
                   SPLIT_BLOCK: tl.constexpr, RETURN_LSE: tl.constexpr):
    """Row `row` of the merge step: its live partials (read past L1, _merge_splits) merged into out[row] and, with
    RETURN_LSE, lse[row]."""
    seqlen = _seqlen(seqlens, row // q_heads, max_len)
    live_splits = tl.cdiv(seqlen, _split_len(seqlen, splits, split_unit))
    o, lse2 = _merge_splits(part_out, part_lse, row, splits, live_splits, D, SPLIT_BLOCK)
    offs_d = tl.arange(0, D)
    tl.store(out + row.to(tl.int64) * D + offs_d, cast(o, out.dtype.element_ty))
    if RETURN_LSE:
        tl.store(lse + row, lse2 * LN2)  # log(x) = log2(x) * ln(2)


@triton.jit(do_not_specialize=["max_len", "split_unit", "splits", "rows", "slot_len", "fp"])
def sp_flash_decode_merge_kernel(part_out, part_lse, seqlens, ll, counter, heap, out, max_len, split_unit, splits,
                                 q_heads, rows, slot_len, sig, sig_err, fp, D: tl.constexpr,
                                 SPLIT_BLOCK: tl.constexpr, WORLD: tl.constexpr, RANKS: tl.constexpr):
    """out[row] = attention over all ranks' slices, for rows p, p + P, ... (program p of P).

    Phase 1 merges my splits of each of my rows and pushes the result as LL words into slot [me] of half
    epoch % 2 of every rank's `ll`: words [row * D, (row + 1) * D) the output (fp32 bits), word rows * D +
    row the lse (base 2). Phase 2 waits for the W slots' words of each of my rows and merges them. All of a
    program's pushes come before its first wait, so no rank waits for words that a waiting program of a
    peer still has to push (and with P <= SM count every program is resident). RANKS: WORLD rounded up to a
    power of two (at least 2), the lanes of the cross-rank merge. The call is signed first and every member's
    signature checked (wl.check_signed) before phase 2: on a mismatch nothing is written.
    """
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = wl.next_epoch(counter)
    ok = wl.signature_live(sig, heap)
    if ok:
        wl.sign(sig, epoch, fp, heap)
    else:
        rows = rows * 0  # a tripped family: nothing pushed, nothing awaited
    half = ll + (epoch % 2) * WORLD * slot_len
    offs_d = tl.arange(0, D)
    lanes = tl.arange(0, RANKS)  # lane q: rank q
    live = lanes < WORLD
    # Phase 1. My slot on every rank, translated once: lane q points into rank q's buffer.
    dst = wl.symm_at(half + wl.rank(heap) * slot_len, tl.minimum(lanes, WORLD - 1), heap)
    for row in range(p, rows, programs):
        seqlen = _seqlen(seqlens, row // q_heads, max_len)
        live_splits = tl.cdiv(seqlen, _split_len(seqlen, splits, split_unit))
        o, lse2 = _merge_splits(part_out, part_lse, row, splits, live_splits, D, SPLIT_BLOCK)
        o_words = wl.pack_ll(o.to(tl.int32, bitcast=True), epoch)
        lse_word = wl.pack_ll(lse2.to(tl.int32, bitcast=True), epoch)
        tl.store(dst[:, None] + row * D + offs_d[None, :], tl.broadcast_to(o_words[None, :], [RANKS, D]),
                 mask=live[:, None])
        tl.store(dst + rows * D + row, lse_word, mask=live)

    if ok:
        ok = wl.check_signed(sig, epoch, fp, heap, sig_err, op="sp_flash_decode")
    if ok == 0:
        rows = rows * 0  # another call on a peer: nothing received
    # Phase 2: all W ranks' words of a row are waited for at once (one spin, not W after each other) and
    # merged as one vector over ranks: every rank runs the same code on the same words in the same lanes
    # (lane q holds rank q's partial everywhere), so every rank gets the same bits.
    offs_w = tl.arange(0, RANKS * D)  # lane q's output words: [q * D, (q + 1) * D)
    live_w = offs_w < WORLD * D
    slot_w = (offs_w // D) * slot_len + offs_w % D
    for row in range(p, rows, programs):
        out_w = wl.wait_ll(half + slot_w + row * D, live_w, epoch, heap, op="sp_flash_decode")
        lse_w = wl.wait_ll(half + lanes * slot_len + rows * D + row, live, epoch, heap, op="sp_flash_decode")
        lse_q = tl.where(live, lse_w.to(tl.float32, bitcast=True), float("-inf"))
        out_q = tl.reshape(out_w.to(tl.float32, bitcast=True), [RANKS, D])
        m = tl.max(lse_q, axis=0)
        weight = tl.exp2(lse_q - tl.where(m == float("-inf"), 0.0, m))  # an empty slice weighs nothing
        l = tl.sum(weight, axis=0)
        o = tl.sum(weight[:, None] * out_q, axis=0) / tl.where(l > 0, l, 1.0)
        tl.store(out + tl.cast(row, tl.int64) * D + offs_d, cast(o, out.dtype.element_ty))


# -- host side ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_n(head_dim: int, device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_BLOCK_N
    return 32 if head_dim == 256 else 64  # K and V tiles of 16 KiB (bf16) per step


def _splits(groups: int, max_len: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(splits, split_unit) for `groups` (sequence, KV head, head chunk) programs over up to max_len positions:
    the grid's ranges per sequence and the positions a range is a whole number of (_split_len). The count is
    planned for max_len (the lengths are on the device: reading them would need a host sync), as the ranges of
    a max_len sequence come out; a shorter sequence fills fewer."""
    blocks = max(1, triton.cdiv(max_len, block_n))
    unit = block_n
    if device.type != "cuda":
        splits = min(CPU_MAX_SPLITS, blocks)
    else:
        per_sm = tuning.value("flash_decode.split_programs_per_sm", device)
        want = max(1, per_sm * _sm_count(device.index) // groups)  # one wave of programs at most
        min_blocks = tuning.value("flash_decode.min_blocks_per_split", device)
        splits = max(1, min(want, tuning.value("flash_decode.max_splits", device), blocks // min_blocks))
        unit = min_blocks * block_n
    per = triton.cdiv(triton.cdiv(max(max_len, 1), unit), splits) * unit  # _split_len(max_len)
    return triton.cdiv(max(max_len, 1), per), unit


def _check_tensor(name: str, t, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (where q is)")


def _check(q, k_cache, v_cache, seqlens, block_table, scale, device=None) -> tuple[int, int, float]:
    """Validate the arguments (TypeError/ValueError naming the argument); returns (max_len, page_size, scale).
    page_size is 0 for a contiguous cache."""
    _check_tensor("q", q, device)
    device = q.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("seqlens", seqlens)):
        _check_tensor(name, t, device)
    if q.dtype not in DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: {', '.join(str(d) for d in DTYPES)}")
    if q.dim() != 3:
        raise ValueError(f"q must be (batch, q_heads, head_dim), got shape {tuple(q.shape)}")
    batch, q_heads, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q has head_dim {head_dim}; supported: {', '.join(map(str, HEAD_DIMS))}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, expected q's dtype {q.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-dimensional (batch or pages, positions, kv_heads, head_dim), "
                             f"got shape {tuple(t.shape)}")
        if t.shape[3] != head_dim:
            raise ValueError(f"{name} has head_dim {t.shape[3]}, q has {head_dim}")
        if t.stride(3) != 1:
            raise ValueError(f"{name}'s last dimension (head_dim) must be contiguous")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, k_cache {tuple(k_cache.shape)}")
    kv_heads = k_cache.shape[2]
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"q has {q_heads} heads, not a multiple of k_cache's {kv_heads} KV heads")
    if seqlens.dtype != torch.int32:
        raise TypeError(f"seqlens has dtype {seqlens.dtype}, expected torch.int32")
    if tuple(seqlens.shape) != (batch,):
        raise ValueError(f"seqlens has shape {tuple(seqlens.shape)}, expected ({batch},)")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q {batch} (contiguous cache; "
                             "pass block_table for a paged one)")
        max_len, page_size = k_cache.shape[1], 0
    else:
        _check_tensor("block_table", block_table, device)
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table has dtype {block_table.dtype}, expected torch.int32")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be (batch={batch}, pages_per_seq), got {tuple(block_table.shape)}")
        page_size = k_cache.shape[1]
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"k_cache has page size {page_size}; supported: 1 to {MAX_PAGE_SIZE}")
        max_len = block_table.shape[1] * page_size
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return max_len, page_size, float(scale)


def _split_launch(q, k_cache, v_cache, seqlens, block_table, scale, max_len, page_size, errors, op, first_row=0,
                  direct=False, return_lse=False):
    """The split kernel's launch for this signature; returns (launch, args(q, k, v, seqlens, table, part_out,
    part_lse, out=None, lse=None) -> its runtime arguments, splits, split_unit). The strides go in as plan
    constants (the key holds every stride: Triton specialises integer arguments on their value). Bad lengths and
    pages are recorded in `errors` (an ErrorWord of 2 words) as op OPS[op]'s, of sequence first_row + b. direct:
    where the splits come to one, the kernel writes out (and, with return_lse, lse) itself (DIRECT) and no merge
    is needed; the launch's arguments then name out and lse (the partials' are not read)."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    heads = min(max(16, triton.next_power_of_2(group)), MAX_HEADS_PER_PROGRAM)
    chunks = triton.cdiv(group, heads)
    block_n = _block_n(head_dim, q.device)
    splits, split_unit = _splits(batch * kv_heads * chunks, max_len, block_n, q.device)
    paged = block_table is not None
    table = block_table if paged else seqlens  # not read when contiguous
    num_pages = k_cache.shape[0] if paged else 0
    limits = op << 62 | min(num_pages, LIMIT) << 31 | min(max_len, LIMIT)
    err = errors.tensor
    consts = (scale * LOG2E, max_len, split_unit, splits, kv_heads, q_heads, q.stride(0), q.stride(1),
              *k_cache.stride()[:3], *v_cache.stride()[:3], table.stride(0), table.stride(-1), num_pages, first_row,
              limits)

    direct = direct and splits == 1

    def args(q, k, v, lens, table, part_out, part_lse, out=None, lse=None):
        # Unread pointers of the right type where a launch has no use for them: the partials (DIRECT), or out
        # and lse (not DIRECT).
        out = part_out if out is None else out
        lse = part_lse if lse is None else lse
        return (q, k, v, lens, table, part_out, part_lse, out, lse, err, *consts)
    part_out, part_lse = _partial_buffers(batch * q_heads, splits, head_dim, q.device)
    sample = torch.empty_like(q, memory_format=torch.contiguous_format) if direct else None
    launch = Launch(flash_decode_split_kernel, (batch * kv_heads * chunks, splits),
                    args(q, k_cache, v_cache, seqlens, table, part_out, part_lse, sample,
                         part_lse if sample is None else part_lse.view(batch, q_heads)),
                    dict(GROUP=group, HEADS=heads, CHUNKS=chunks, D=head_dim, BLOCK_N=block_n, PAGE_SIZE=page_size,
                         PAGED=paged, DIRECT=direct, RETURN_LSE=direct and return_lse),
                    num_warps=4 if heads <= 32 else 8, num_stages=_stages(q, batch * kv_heads * chunks * splits))
    return launch, args, splits, split_unit


def _stages(q: torch.Tensor, programs: int) -> int:
    """The split kernel's pipeline stages: 3 for 16-bit KV, 2 for fp32 (3 would not fit an A100's shared memory);
    on GPUs flash_decode.stages_past_one_wave where the grid holds more than split_programs_per_sm programs a SM
    (fewer stages: more programs resident; the tuning note has the measurements)."""
    if q.element_size() > 2:
        return 2
    if q.device.type == "cuda":
        per_sm = tuning.value("flash_decode.split_programs_per_sm", q.device)
        if programs > per_sm * _sm_count(q.device.index):
            return tuning.value("flash_decode.stages_past_one_wave", q.device)
    return 3


def _partial_buffers(rows: int, splits: int, head_dim: int, device):
    """The split kernel's per-call partials (fp32 out and lse per split): plain torch.empty, cheap from the
    caching allocator, never kept past the call."""
    return (torch.empty((rows, splits, head_dim), dtype=torch.float32, device=device),
            torch.empty((rows, splits), dtype=torch.float32, device=device))


def _prepare_q(q: torch.Tensor) -> torch.Tensor:
    return q if q.stride(2) == 1 else q.contiguous()


def _key(name, q, k_cache, v_cache, seqlens, block_table, scale, *rest):
    """A plan key: the signature of every tensor argument with its strides (they are launch constants)."""
    return (name, signature(q), q.stride(), signature(k_cache), k_cache.stride(), signature(v_cache),
            v_cache.stride(), signature(seqlens), None if block_table is None else
            (signature(block_table), block_table.stride()), scale, *rest)


@declare_op(tensors=("q", "k_cache", "v_cache"))
def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                 block_table: torch.Tensor | None = None, scale: float | None = None,
                 return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token per sequence over its KV cache (split-KV, merged in the same op).

    q (batch, q_heads, head_dim), head_dim 64, 128 or 256, bf16/fp16/fp32; k_cache, v_cache of q's dtype,
    contiguous (batch, max_len, kv_heads, head_dim) or paged (num_pages, page_size, kv_heads, head_dim) with
    block_table (batch, pages_per_seq) int32; q_heads a multiple of kv_heads; seqlens (batch,) int32 on the
    device, each in [0, max_len] (or pages_per_seq * page_size), and the block_table entries of a sequence's
    positions in [0, num_pages): checked on the device with no host sync (a bad value is never read past the
    cache, and raises at the family's next call and at weft.check_errors(): see the module doc). scale
    defaults to head_dim ** -0.5.
    Returns out (batch, q_heads, head_dim) in q's dtype, and with return_lse also lse (batch, q_heads) fp32,
    natural log of the softmax normaliser (scale included). An empty sequence gives out 0, lse -inf.
    Not collective. Without weft.init() it works too, but plans nothing: each call is checked and
    compiled-kernel-looked-up in full (the plans live in the initialised world).
    """
    if not is_initialized():
        return FlashDecodePlan(None, q, k_cache, v_cache, seqlens, block_table, scale, bool(return_lse)).run(
            q, k_cache, v_cache, seqlens, block_table)
    world = world_or_raise()
    found = plan(world, lambda: _key("flash_decode", q, k_cache, v_cache, seqlens, block_table, scale,
                                     bool(return_lse)),
                 lambda: FlashDecodePlan(world, q, k_cache, v_cache, seqlens, block_table, scale, bool(return_lse)))
    return found.run(q, k_cache, v_cache, seqlens, block_table)


class FlashDecodePlan(Plan):
    """flash_decode of one signature (local: `group` is the world, or None without weft.init()): the split
    launch and the merge launch, or no launch for an empty batch."""

    def __init__(self, group, q, k_cache, v_cache, seqlens, block_table, scale, return_lse):
        super().__init__(group)
        max_len, page_size, scale = _check(q, k_cache, v_cache, seqlens, block_table, scale)
        self.batch, self.q_heads, self.head_dim = batch, q_heads, head_dim = q.shape
        self.rows = batch * q_heads
        self.return_lse = return_lse
        if self.rows == 0:
            self.run = self.run_empty
            return
        self.errors = _errors(group)
        qc = _prepare_q(q)
        self.split, self.split_args, self.splits, self.split_unit = _split_launch(
            qc, k_cache, v_cache, seqlens, block_table, scale, max_len, page_size, self.errors, 0, direct=True,
            return_lse=return_lse)
        self.max_len = max_len
        if self.splits == 1:  # the split kernel writes the result: no merge
            self.run = self.run_direct
            return
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((batch, q_heads), dtype=torch.float32, device=q.device)
        part_out, part_lse = _partial_buffers(self.rows, self.splits, head_dim, q.device)
        self.merge = Launch(flash_decode_merge_kernel, (self.rows,),
                            (part_out, part_lse, seqlens, out, lse, max_len, self.split_unit, self.splits, q_heads),
                            dict(D=head_dim, SPLIT_BLOCK=SPLIT_BLOCK, RETURN_LSE=return_lse), num_warps=4)

    def result(self, out, lse):
        return (out, lse) if self.return_lse else out

    def run_empty(self, q, k_cache, v_cache, seqlens, block_table):
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        return self.result(out, torch.empty((self.batch, self.q_heads), dtype=torch.float32, device=q.device))

    def run_direct(self, q, k_cache, v_cache, seqlens, block_table):
        """One split: the split kernel writes out and lse itself."""
        self.errors.raise_recorded()
        q = _prepare_q(q)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((self.batch, self.q_heads), dtype=torch.float32, device=q.device)
        self.split(*self.split_args(q, k_cache, v_cache, seqlens, seqlens if block_table is None else block_table,
                                    lse, lse, out, lse))
        return self.result(out, lse)

    def run(self, q, k_cache, v_cache, seqlens, block_table):
        # A bad length or page an earlier call recorded raises before anything is launched (no peers wait).
        self.errors.raise_recorded()
        q = _prepare_q(q)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((self.batch, self.q_heads), dtype=torch.float32, device=q.device)
        part_out, part_lse = _partial_buffers(self.rows, self.splits, self.head_dim, q.device)
        self.split(*self.split_args(q, k_cache, v_cache, seqlens, seqlens if block_table is None else block_table,
                                    part_out, part_lse))
        self.merge(part_out, part_lse, seqlens, out, lse, self.max_len, self.split_unit, self.splits, self.q_heads)
        return self.result(out, lse)


# Without weft.init(), flash_decode's error word is this process's own (weft.check_errors needs the world).
_uninitialized_errors = None


def _errors(group):
    """The family's error word on this rank (the world's, whichever group the call runs over): bad lengths
    and pages are recorded in it by the split kernel, and raised at the family's next call and by
    weft.check_errors()."""
    global _uninitialized_errors
    if group is None:
        if _uninitialized_errors is None:
            _uninitialized_errors = ErrorWord(None, _bad_value, 2)
        return _uninitialized_errors
    return workspace(group.world, "flash_decode_errors", lambda world: ErrorWord(world, _bad_value, 2))


def _bad_value(words) -> ValueError:
    """The ValueError of a recorded bad length or page (the words of _record)."""
    record, limits = words
    kind, row, value = (record >> 61) & 1, (record >> 32) & ((1 << 29) - 1), record & 0xFFFFFFFF
    value -= (value >> 31) << 32
    op, num_pages, max_len = OPS[(limits >> 62) & 1], (limits >> 31) & LIMIT, limits & LIMIT
    if kind == 0:
        return ValueError(f"{op}: block_table row {row} names page {value}, outside [0, num_pages = {num_pages}) "
                          "(it was not read: that call's output is wrong)")
    return ValueError(f"{op}: seqlens[{row}] = {value} is outside [0, {max_len}] (the cache's positions; it was "
                      "clamped: that call's output is wrong)")


class _SpContext:
    """The symmetric LL exchange buffer of a group (2 halves x W slots x SP_MAX_ENTRIES int64 words, epoch 0
    in every word), the merge kernel's epoch counter (wl.next_epoch), its signature words and the group's
    SignatureWord."""

    def __init__(self, group):
        self.ll = group.heap.empty((2 * group.size * SP_MAX_ENTRIES,), torch.int64)
        self.counter = group.heap.empty((1,), torch.int64)
        self.sig = signature_words(group, group.size)
        self.signatures = signatures(group)
        self.signatures.register(self.sig, self.counter)
        zero_everywhere(group, self.ll, self.counter, self.sig)


def _sp_split_block(splits: int, head_dim: int) -> int:
    return max(SPLIT_BLOCK, min(triton.next_power_of_2(splits), SP_SPLIT_WORDS // head_dim))


def _sp_lanes(size: int) -> int:
    """The merge kernel's lanes over ranks: the group size rounded up to a power of two, at least 2."""
    return max(2, triton.next_power_of_2(size))


def _sp_max_programs(device: torch.device) -> int:
    return _sm_count(device.index) if device.type == "cuda" else CPU_SP_PROGRAMS


@declare_op(tensors=("q", "k_cache_shard", "v_cache_shard"), collective=True)
def sp_flash_decode(q: torch.Tensor, k_cache_shard: torch.Tensor, v_cache_shard: torch.Tensor,
                    seqlens_shard: torch.Tensor, block_table: torch.Tensor | None = None,
                    scale: float | None = None, group=None) -> torch.Tensor:
    """flash_decode over a KV cache sharded by sequence position over the members of `group` (default: the
    world): member r holds the r-th contiguous slice of every sequence (its length seqlens_shard[b], 0
    allowed), in flash_decode's layouts. q is the same on every member. Returns out (batch, q_heads,
    head_dim) in q's dtype, the same bits on every member: attention over the concatenation of the slices.

    Collective over the group; no host synchronisation, so it can be captured in a CUDA graph (after a first
    call outside capture, which creates the exchange buffer). Any batch: the exchange carries at most
    SP_MAX_ENTRIES words per rank (batch * q_heads * (head_dim + 1)), so a larger batch goes through in
    passes of sequences. A bad length or page is recorded on the device as flash_decode's are, and raised
    at the family's next call on this rank (after its launches, so that no peer is left waiting) and by
    weft.check_errors(). On a group that spans nodes the members' partials are gathered by the hierarchical
    all_gather and merged by every member in group-rank order (hierarchical.SpFlashDecode; docs/nodes.md): the
    same bits on every member, within the dtype's tolerance of the single-node op.
    """
    g = resolve(group)
    found = plan(g, lambda: _key("sp_flash_decode", q, k_cache_shard, v_cache_shard, seqlens_shard,
                                 block_table, scale),
                 lambda: SpFlashDecodePlan(g, q, k_cache_shard, v_cache_shard, seqlens_shard, block_table, scale))
    return found.run(q, k_cache_shard, v_cache_shard, seqlens_shard, block_table)


def sp_flash_decode_merge_only(q: torch.Tensor, k_cache_shard: torch.Tensor, v_cache_shard: torch.Tensor,
                               seqlens_shard: torch.Tensor, block_table: torch.Tensor | None = None,
                               scale: float | None = None, group=None):
    """sp_flash_decode's cross-rank part alone, for measuring it: computes this rank's split partials of the
    call once (sp_flash_decode's arguments) and returns (merge, out), where each merge() launches the call's
    merge kernel (per pass) on those ready partials into out, exactly as sp_flash_decode's second launch
    does. Collective over the group, like sp_flash_decode (each merge() too), and capturable in a CUDA
    graph."""
    sp = SpFlashDecodePlan(resolve(group), q, k_cache_shard, v_cache_shard, seqlens_shard, block_table, scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    parts = [sp.split(step, _prepare_q(q), k_cache_shard, v_cache_shard, seqlens_shard, block_table)
             for step in sp.passes]

    def merge():
        for step, (lens, part_out, part_lse) in zip(sp.passes, parts):
            sp.merge(step, lens, part_out, part_lse, out)
    return merge, out


class _SpPass:
    """One pass of sp_flash_decode: sequences [b0, b1) (`whole`: all of the batch), their split launch and
    their merge launch."""

    def __init__(self, b0, b1, batch, rows, split_launch, split_args, splits, split_unit, merge_launch):
        self.b0, self.b1, self.rows, self.splits, self.split_unit = b0, b1, rows, splits, split_unit
        self.whole = b1 - b0 == batch
        self.split_launch, self.split_args, self.merge_launch = split_launch, split_args, merge_launch


class SpFlashDecodePlan(Plan):
    """sp_flash_decode's plan: per pass of sequences, the split kernel into this call's partials, then the
    merge kernel (a persistent grid of min(rows, SM count) programs)."""

    def __init__(self, group, q, k_cache, v_cache, seqlens, block_table, scale):
        super().__init__(group)
        _check_tensor("q", q, group.device)
        max_len, page_size, scale = _check(q, k_cache, v_cache, seqlens, block_table, scale)
        batch, q_heads, head_dim = q.shape
        self.q_heads, self.head_dim, self.max_len = q_heads, head_dim, max_len
        self.paged, self.passes = block_table is not None, []
        if batch * q_heads == 0:
            return
        if group.topology.spans_nodes:  # the partials gathered, then merged: hierarchical.SpFlashDecode
            self.run = hierarchical.SpFlashDecode(group, q, k_cache, v_cache, seqlens, block_table, scale, max_len,
                                                  page_size, _errors(group)).run
            return
        self.ctx = ctx = workspace(group, "sp_flash_decode", _SpContext)
        self.errors = _errors(group)
        self.heap = group.heap.descriptor
        per_pass = max(1, SP_MAX_ENTRIES // (q_heads * (head_dim + 1)))  # sequences per pass
        # What the members must agree on: the rows and their width (each member's cache and splits are its own).
        self.fp = self.sign("sp_flash_decode", batch=batch, q_heads=q_heads, head_dim=head_dim,
                            dtype=str(q.dtype).removeprefix("torch."))
        self.sig_args = (ctx.sig, ctx.signatures.tensor, self.fp)
        qc = _prepare_q(q)
        sample = torch.empty_like(q, memory_format=torch.contiguous_format)
        for b0 in range(0, batch, per_pass):
            b1 = min(batch, b0 + per_pass)
            rows = (b1 - b0) * q_heads
            # A pass's sequences: rows b0..b1 of q, seqlens, block_table (paged) or the cache (contiguous).
            k, v = (k_cache, v_cache) if self.paged else (k_cache[b0:b1], v_cache[b0:b1])
            split, split_args, splits, split_unit = _split_launch(
                qc[b0:b1], k, v, seqlens[b0:b1], block_table[b0:b1] if self.paged else None, scale, max_len,
                page_size, self.errors, 1, b0)
            part_out, part_lse = _partial_buffers(rows, splits, head_dim, q.device)
            merge = Launch(sp_flash_decode_merge_kernel, (min(rows, _sp_max_programs(q.device)),),
                           (part_out, part_lse, seqlens[b0:b1], ctx.ll, ctx.counter, self.heap, sample[b0:b1],
                            max_len, split_unit, splits, q_heads, rows, SP_MAX_ENTRIES, *self.sig_args),
                           dict(D=head_dim, SPLIT_BLOCK=_sp_split_block(splits, head_dim), WORLD=group.size,
                                RANKS=_sp_lanes(group.size)), num_warps=SP_NUM_WARPS)
            self.passes.append(_SpPass(b0, b1, batch, rows, split, split_args, splits, split_unit, merge))

    def split(self, step, q, k_cache, v_cache, seqlens, block_table):
        """The pass's split kernel into new partials; returns (the pass's seqlens, part_out, part_lse)."""
        part_out, part_lse = _partial_buffers(step.rows, step.splits, self.head_dim, q.device)
        if not step.whole:
            b0, b1 = step.b0, step.b1
            q, seqlens = q[b0:b1], seqlens[b0:b1]
            if self.paged:
                block_table = block_table[b0:b1]
            else:
                k_cache, v_cache = k_cache[b0:b1], v_cache[b0:b1]
        # A contiguous cache passes seqlens for the block table (not read).
        step.split_launch(*step.split_args(q, k_cache, v_cache, seqlens, block_table if self.paged else seqlens,
                                           part_out, part_lse))
        return seqlens, part_out, part_lse

    def merge(self, step, seqlens, part_out, part_lse, out):
        """The pass's merge kernel: its rows of `out` from every rank's partials."""
        step.merge_launch(part_out, part_lse, seqlens, self.ctx.ll, self.ctx.counter, self.heap,
                          out if step.whole else out[step.b0:step.b1], self.max_len, step.split_unit, step.splits,
                          self.q_heads, step.rows, SP_MAX_ENTRIES, *self.sig_args)

    def run(self, q, k_cache, v_cache, seqlens, block_table):
        q = _prepare_q(q)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if not self.passes:
            return out
        # A bad length or page recorded by an earlier call raises after this call's launches: the peers
        # are waiting for this rank's partials.
        recorded = self.errors.take()
        for step in self.passes:
            self.merge(step, *self.split(step, q, k_cache, v_cache, seqlens, block_table), out)
            self.ctx.signatures.raise_recorded()
        if recorded is not None:
            raise recorded
        return out


# Signatures for the sm_90 compile check (weft.testing.compile).
# -- the operators (not differentiable) ----------------------------------------------------------------------
#   torch.ops.weft.flash_decode(q, k_cache, v_cache, seqlens, block_table, scale) -> (out, lse)
#   torch.ops.weft.sp_flash_decode(q, k_cache_shard, v_cache_shard, seqlens_shard, group_name, block_table, scale)
#                                                                                 -> out

# What a caller may ask of flash_decode before calling it (the layers choose their decode attention by it).
flash_decode.dtypes, flash_decode.head_dims = DTYPES, HEAD_DIMS


@flash_decode.define
def flash_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                    block_table: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_decode.eager(q, k_cache, v_cache, seqlens, block_table, scale, return_lse=True)


@flash_decode_op.register_fake
def _(q, k_cache, v_cache, seqlens, block_table=None, scale=None):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@flash_decode.traced
def _(q, k_cache, v_cache, seqlens, block_table=None, scale=None, return_lse=False):
    out, lse = torch.ops.weft.flash_decode(q, k_cache, v_cache, seqlens, block_table, scale)
    return (out, lse) if return_lse else out


@sp_flash_decode.define
def sp_flash_decode_op(q: torch.Tensor, k_cache_shard: torch.Tensor, v_cache_shard: torch.Tensor,
                       seqlens_shard: torch.Tensor, group_name: str, block_table: Optional[torch.Tensor] = None,
                       scale: Optional[float] = None) -> torch.Tensor:
    return sp_flash_decode.eager(q, k_cache_shard, v_cache_shard, seqlens_shard, block_table, scale, group=group_name)


@sp_flash_decode_op.register_fake
def _(q, k_cache_shard, v_cache_shard, seqlens_shard, group_name, block_table=None, scale=None):
    return q.new_empty(q.shape)


@sp_flash_decode.traced
def _(q, k_cache_shard, v_cache_shard, seqlens_shard, block_table=None, scale=None, group=None):
    return torch.ops.weft.sp_flash_decode(q, k_cache_shard, v_cache_shard, seqlens_shard, group_name(group),
                                          block_table, scale)


_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
_SPLIT_SIG = dict(q=None, k=None, v=None, seqlens="*i32", block_table="*i32", part_out="*fp32", part_lse="*fp32",
                  out=None, lse="*fp32", err="*i64", scale_log2="fp32", max_len="i32", split_unit="i32", splits="i32",
                  kv_heads="i32", q_heads="i32",
                  q_sb="i32", q_sh="i32", k_s0="i32", k_s1="i32", k_sh="i32", v_s0="i32", v_s1="i32", v_sh="i32",
                  bt_sb="i32", bt_sp="i32", num_pages="i32", first_row="i32", limits="i64")
COMPILE_CASES = [
    (flash_decode_split_kernel, {**_SPLIT_SIG, "q": t, "k": t, "v": t, "out": t if direct else "*fp32"},
     dict(GROUP=g, HEADS=h, CHUNKS=c, D=d, BLOCK_N=32 if d == 256 else 64, PAGE_SIZE=ps, PAGED=ps > 0, DIRECT=direct,
          RETURN_LSE=direct and d == 128),
     dict(num_warps=4 if h <= 32 else 8))
    for t, d, g, h, c, ps in [(t, d, 4, 16, 1, ps) for t in ("*bf16",) for d in HEAD_DIMS for ps in (0, 16)]
    + [("*fp16", 128, 8, 16, 1, 0), ("*fp32", 128, 4, 16, 1, 0), ("*fp32", 128, 4, 16, 1, 16),
       ("*bf16", 128, 1, 16, 1, 1), ("*bf16", 128, 32, 32, 1, 256), ("*bf16", 128, 128, 64, 2, 16)]
    for direct in (False, True)
] + [
    (flash_decode_merge_kernel, dict(part_out="*fp32", part_lse="*fp32", seqlens="*i32", out=t, lse="*fp32",
                                     max_len="i32", split_unit="i32", splits="i32", q_heads="i32"),
     dict(D=d, SPLIT_BLOCK=SPLIT_BLOCK, RETURN_LSE=r), dict(num_warps=4))
    for t, d, r in [(t, 128, True) for t in _PTR.values()] + [("*bf16", 64, False), ("*bf16", 256, False)]
] + [
    (sp_flash_decode_merge_kernel, dict(part_out="*fp32", part_lse="*fp32", seqlens="*i32", ll="*i64", counter="*i64",
                                        heap="*i64", out=t, max_len="i32", split_unit="i32", splits="i32",
                                        q_heads="i32", rows="i32", slot_len="i32", sig="*i64", sig_err="*i64",
                                        fp="i32"),
     dict(D=d, SPLIT_BLOCK=_sp_split_block(64, d), WORLD=wd, RANKS=_sp_lanes(wd)),
     dict(num_warps=SP_NUM_WARPS))
    for t, d, wd in [("*bf16", d, 8) for d in HEAD_DIMS] + [("*bf16", 128, 2), ("*fp32", 128, 1), ("*fp16", 128, 3)]
]
