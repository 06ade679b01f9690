"""High-throughput expert-parallel dispatch and combine (prefill): ep_dispatch / ep_combine.

High-throughput EP (prefill), ep_dispatch / ep_combine: each token goes once to every rank that holds one of
its experts, pushed straight into that rank's receive region, in five launches and no torch op between:
  1. ep_count_kernel (a program per block of tokens): the block's tokens to each rank, its rows checked;
     ep_route_kernel (one program): where each block's tokens start among my tokens to each rank (a scan of
     the blocks' counts); then every rank writes its row of tokens-per-destination (and whether it saw a bad
     row) to every rank as LL words, so each holds the whole W x W table: a sender knows where its rows go on
     rank r (after the rows of ranks s' < me) and a receiver how many rows it gets, with no host round trip.
     Without max_recv_tokens the host reads [most rows received, my rows, bad rows anywhere] here: the op's
     one sync; ep_position_kernel (a program per block): each token's position among my tokens to each rank;
  2. ep_push_kernel: the rows ([x | the receiver's local topk_idx | topk_weights] as int32 words, read from
     the caller's tensors as they are) into the destinations' regions (half epoch % 2), then a flag per
     program to every rank; the rows of my own tokens straight into recv_x, recv_topk_idx, recv_topk_weights;
  3. ep_receive_kernel: wait for every rank's flags, copy the region out into recv_x, recv_topk_idx and
     recv_topk_weights, and count the rows per local expert.
Push and receive are separate launches: the receiver needs every program of every sender, and the
interpreter runs a grid's programs one after another. Combine: ep_push_back_kernel pushes each received row
of another rank's token back to its source, into the slot the source numbers it by (from the table), and
ep_combine_reduce_kernel sums each token's rows in rank order, reading the row of its own rank from y.

The dispatch checks topk_idx's rows on the device as it counts them (routing.check_rows): a bad row is recorded
in the workspace's error word (ep_workspace.MoeWorkspace) and raised as a ValueError by the next EP op on that
rank; without max_recv_tokens every rank raises in the call itself, the sync having seen every rank's check.
The cross-rank signature check (common.Plan.sign, wl.sign / wl.check_signed): both ops sign one set of signature
words (the workspace's sig_ht) with epochs of one counter, ep_dispatch in the count exchange (before any row
count goes out) and ep_combine in every program of the push back (before any row goes back), so that members that
differ in the call (experts, hidden, dtype, k, max_recv_tokens; not the token count, each rank's own), or of which
one dispatches and another combines, get weft.SignatureMismatch: without max_recv_tokens at the host sync, before
anything is pushed; else after the launches (on GPUs at the next EP op). A tripped family's push, receive and
reduction do nothing; the epoch counters are resynchronised before the raise (common.SignatureWord).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

import weft.language as wl

from ... import tuning
from ..blocks import copy, halves_of, word_of
from ..common import Launch, Plan, check_tensor, group_name, group_size, handle_group, plan, resolve, signature
from ..registry import declare_op
from . import ep_nodes
from .ep_workspace import (HT_MAX_PROGRAMS, _ELEM, _rows, _rows_ready, _too_big, _word_columns,
                           _workspace)
from .routing import _check_routing, check_rows, peer_error, valid_experts


# The high-throughput launch settings on GPUs are tuning data (weft.tuning: moe.ht_programs, the push's programs,
# a fixed number since the receivers wait on the flags of each; moe.ht_block, each push program's words and warps;
# moe.ht_copy_programs, the receiving kernels' programs; moe.ht_route_tokens, the tokens of a count / position
# program), swept by scripts/probe_ep_ht.py. Under the interpreter, small fixed ones:
HT_CPU = dict(programs=2, block=(256, 4), copy_programs=2, route_tokens=16)


# -- high-throughput kernels --------------------------------------------------------

@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _ranks_of(e, LOCAL: tl.constexpr, BLOCK_W: tl.constexpr):
    """(T, BLOCK_W) int32: whether each token of a tile of experts `e` (T, BLOCK_K; -1: none) goes to rank r
    (a token naming two experts of a rank goes there once)."""
    ww = tl.arange(0, BLOCK_W)
    ranks = tl.reduce(tl.where(e >= 0, tl.full([1, 1], 1, tl.int64) << (e // LOCAL).to(tl.int64), 0), 1, _or)
    return ((ranks[:, None] >> ww[None, :].to(tl.int64)) & 1).to(tl.int32)


@triton.jit(do_not_specialize=["tokens"])
def ep_count_kernel(topk, block_counts, err, tokens, K: tl.constexpr, LOCAL: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    """Token block b (BLOCK_T tokens), its rows checked (check_rows): block_counts[b] = [its tokens to each
    rank | its bad entries]."""
    b = tl.program_id(0)
    tt = b * BLOCK_T + tl.arange(0, BLOCK_T)
    jj = tl.arange(0, BLOCK_K)
    ww = tl.arange(0, BLOCK_W)
    live = (tt[:, None] < tokens) & (jj[None, :] < K)
    raw = tl.load(topk + tt[:, None] * K + jj[None, :], mask=live, other=-1)
    e, bad = check_rows(raw, tt, err, live, LOCAL * WORLD, BLOCK_K)
    sent = tl.sum(_ranks_of(e, LOCAL, BLOCK_W), axis=0)
    tl.store(block_counts + b * (WORLD + 1) + ww, tl.where(ww < WORLD, sent, bad), mask=ww <= WORLD)


@triton.jit(do_not_specialize=["fp"])
def ep_route_kernel(block_counts, block_start, table, counts, info, buf, counter, heap, sig, sig_counter, sig_err, fp,
                    blocks, LOCAL: tl.constexpr, WORLD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
                    BLOCK_L: tl.constexpr):
    """In one program, from the token blocks' counts (ep_count_kernel): block_start[b, r] = the position of
    block b's first token to rank r among my tokens to r; then every rank's [tokens to each rank | bad rows]
    to every rank as LL words, so each holds table[s, r] = tokens rank s sends to rank r with no host round
    trip, and info = [most rows any rank receives, rows I receive, bad rows anywhere]. Zeroes counts
    (ep_receive_kernel counts into them). Signs the call first (an epoch of `sig_counter`, which ep_combine's
    push back shares) and checks every member's signature before the exchange: on a mismatch nothing is sent
    and the table and info are zeros (the family is tripped: the push and the receive do nothing)."""
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    signed = wl.next_epoch(sig_counter)
    ok = wl.signature_live(sig, heap)
    if ok:
        wl.sign(sig, signed, fp, heap)
        ok = wl.check_signed(sig, signed, fp, heap, sig_err, op="ep_dispatch")
    half = buf + (epoch % 2) * (WORLD * (WORLD + 1))
    ww = tl.arange(0, BLOCK_W)
    ll = tl.arange(0, BLOCK_L)
    tl.store(counts + ll, tl.zeros([BLOCK_L], tl.int32), mask=ll < LOCAL)
    sent = tl.zeros([BLOCK_W], tl.int32)  # [tokens to each rank so far | bad entries]
    for b0 in range(0, blocks, BLOCK_B):
        bb = b0 + tl.arange(0, BLOCK_B)
        c = tl.load(block_counts + bb[:, None] * (WORLD + 1) + ww[None, :],
                    mask=(bb[:, None] < blocks) & (ww[None, :] <= WORLD), other=0)
        tl.store(block_start + bb[:, None] * WORLD + ww[None, :], sent[None, :] + tl.cumsum(c, axis=0) - c,
                 mask=(bb[:, None] < blocks) & (ww[None, :] < WORLD))
        sent += tl.sum(c, axis=0)
    row = wl.pack_ll(tl.where(ww < WORLD, sent, (sent > 0).to(tl.int32)), epoch)
    for q in range(tl.where(ok, WORLD, 0)):
        tl.store(wl.symm_at(half + me * (WORLD + 1), q, heap) + ww, row, mask=ww <= WORLD)
    total = tl.zeros([BLOCK_W], tl.int32)
    for s in range(WORLD):
        got = tl.zeros([BLOCK_W], tl.int32)  # a mismatch: nothing sent or received (the later launches read it)
        if ok:
            got = wl.wait_ll(half + s * (WORLD + 1) + ww, ww <= WORLD, epoch, heap=heap, peer=s,
                             op="ep_dispatch count exchange")
        tl.store(table + s * WORLD + ww, got, mask=ww < WORLD)
        total += got
    most = tl.max(tl.where(ww < WORLD, total, 0), axis=0)
    mine = tl.sum(tl.where(ww == me, total, 0), axis=0)
    anywhere = tl.sum(tl.where(ww == WORLD, total, 0), axis=0)
    tl.store(info + ww, tl.where(ww == 0, most, tl.where(ww == 1, mine, anywhere)), mask=ww < 3)


@triton.jit(do_not_specialize=["tokens"])
def ep_position_kernel(topk, block_start, rank_pos, tokens, K: tl.constexpr, LOCAL: tl.constexpr,
                       WORLD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    """Token block b: rank_pos[t, r] = token t's position among my tokens to rank r (-1: not there), from
    where the block starts (ep_route_kernel) and a scan of the block."""
    b = tl.program_id(0)
    tt = b * BLOCK_T + tl.arange(0, BLOCK_T)
    jj = tl.arange(0, BLOCK_K)
    ww = tl.arange(0, BLOCK_W)
    live = (tt[:, None] < tokens) & (jj[None, :] < K)
    e = valid_experts(tl.load(topk + tt[:, None] * K + jj[None, :], mask=live, other=-1), live, LOCAL * WORLD)
    to_rank = _ranks_of(e, LOCAL, BLOCK_W)
    start = tl.load(block_start + b * WORLD + ww, mask=ww < WORLD, other=0)
    pos = start[None, :] + tl.cumsum(to_rank, axis=0) - to_rank
    tl.store(rank_pos + tt[:, None] * WORLD + ww[None, :], tl.where(to_rank > 0, pos, -1),
             mask=(tt[:, None] < tokens) & (ww[None, :] < WORLD))


@triton.jit
def _rows_before_mine(table, me, WORLD: tl.constexpr, BLOCK_W: tl.constexpr):
    """For each rank r: the rows that ranks s < me send to r (where my rows start on r)."""
    s = tl.arange(0, BLOCK_W)[:, None]
    r = tl.arange(0, BLOCK_W)[None, :]
    return tl.sum(tl.load(table + s * WORLD + r, mask=(s < me) & (r < WORLD), other=0), axis=0)


@triton.jit(do_not_specialize=["tokens", "limit", "half_words"])
def ep_push_kernel(x, topk, weights, rank_pos, table, region, x_out, idx_out, w_out, flags, counter, heap, sig,
                   tokens, limit, half_words,
                   HW: tl.constexpr, K: tl.constexpr, ROW: tl.constexpr, LOCAL: tl.constexpr, WORLD: tl.constexpr,
                   PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    """Token i of x (HW int32 words a row) to every rank r it goes to, at row rank_pos[i, r] + (rows of ranks
    s < me) of r's region (half epoch % 2), rows from `limit` on dropped: [x | its experts as r's local
    indices (-1: not r's) | topk weights' bits], ROW words; then flag [p][me] on every rank. Program p pushes
    tokens p, p + PROGRAMS, ... A token to myself goes straight to its row of x_out, idx_out and w_out (what
    ep_receive_kernel makes of the region's rows), not through my region. A family tripped by a signature
    mismatch (the count exchange's check) pushes and flags nothing."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    live = wl.signature_live(sig, heap)
    half = region + (epoch % 2) * half_words
    ww = tl.arange(0, BLOCK_W)
    jj = tl.arange(0, BLOCK_K)
    start = _rows_before_mine(table, me, WORLD, BLOCK_W)
    for i in range(p, tl.where(live, tokens, 0), PROGRAMS):
        pos = tl.load(rank_pos + i * WORLD + ww, mask=ww < WORLD, other=-1)
        slots = tl.where((pos >= 0) & (pos + start < limit), pos + start, -1)
        e = valid_experts(tl.load(topk + i * K + jj, mask=jj < K, other=-1), jj < K, LOCAL * WORLD)
        wbits = tl.load(weights + i * K + jj, mask=jj < K, other=0.0).to(tl.int32, bitcast=True)
        for r in range(WORLD):
            slot = tl.sum(tl.where(ww == r, slots, 0), axis=0).to(tl.int64)
            local = tl.where((e >= 0) & (e // LOCAL == r), e - r * LOCAL, -1)
            if slot >= 0:
                if r == me:
                    copy(x_out + slot * HW, x + i * HW, 0, HW, BLOCK, VEC)
                    tl.store(idx_out + slot * K + jj, local.to(idx_out.dtype.element_ty), mask=jj < K)
                    tl.store(w_out + slot * K + jj, wbits.to(tl.float32, bitcast=True), mask=jj < K)
                else:
                    dst = wl.symm_at(half + slot * ROW, r, heap)
                    copy(dst, x + i * HW, 0, HW, BLOCK, VEC)
                    tl.store(dst + HW + jj, local, mask=jj < K)
                    tl.store(dst + HW + K + jj, wbits, mask=jj < K)
    if live:
        wl.notify_all(flags + p * WORLD + me, heap, epoch)


@triton.jit(do_not_specialize=["fp", "rows", "half_words"])
def ep_push_back_kernel(y, table, region, flags, counter, heap, err, sig, sig_counter, sig_err, fp, rows, half_words,
                        HW: tl.constexpr,
                        WORLD: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    """Received row i of y (HW int32 words) back to its source s, at the row s numbered it by (its rows for
    ranks r < me, then its position among those it sent me), in s's region; then flag [p][me] on every rank.
    Rows of my own tokens stay in y, where ep_combine_reduce_kernel reads them. A row number past s's region
    (the table's counts are what the ranks sent: a member whose call did not match) is not pushed but recorded
    in `err` (peer_error). Every program signs the call (an epoch of `sig_counter`, which ep_dispatch's count
    exchange shares) and checks every member's signature before it pushes: on a mismatch nothing is pushed or
    flagged (the family is tripped: the reduction does nothing)."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    signed = wl.next_epoch(sig_counter)
    ok = wl.signature_live(sig, heap)
    if ok:
        wl.sign(sig, signed, fp, heap)
        ok = wl.check_signed(sig, signed, fp, heap, sig_err, op="ep_combine")
    half = region + (epoch % 2) * half_words
    s = tl.arange(0, BLOCK_W)
    got = tl.load(table + s * WORLD + me, mask=s < WORLD, other=0)  # rows from each source, in source order
    ends = tl.cumsum(got, axis=0)
    r = tl.arange(0, BLOCK_W)[None, :]
    sent_before = tl.sum(tl.load(table + s[:, None] * WORLD + r, mask=(s[:, None] < WORLD) & (r < me), other=0),
                         axis=1)  # for each source: its rows for ranks r < me
    n = tl.where(ok, tl.minimum(tl.sum(got, axis=0), rows), 0)
    for i in range(p, n, PROGRAMS):
        src = tl.sum((ends <= i).to(tl.int32), axis=0)
        if src != me:
            slot = tl.sum(tl.where(s == src, sent_before + i - (ends - got), 0), axis=0).to(tl.int64)
            if (slot >= 0) & ((slot + 1) * HW <= half_words):
                copy(wl.symm_at(half + slot * HW, src, heap), y + i * HW, 0, HW, BLOCK, VEC)
            else:
                peer_error(err, src, 2)
    if ok:
        wl.notify_all(flags + p * WORLD + me, heap, epoch)


@triton.jit
def _wait_pushes(region, flags, counter, heap, half_words, live, WORLD: tl.constexpr, PROGRAMS: tl.constexpr):
    """The half of `region` this call's push wrote, once every program of every rank has flagged me (unless the
    family is not `live`: tripped by a signature mismatch, when no push came)."""
    epoch = wl.next_epoch(counter)
    half = region + (epoch % 2) * half_words
    if live:
        # All PROGRAMS x WORLD flags in one wait: 32 a round trip, where a wait per program took one each.
        token = wl.wait(flags, PROGRAMS * WORLD, epoch, wl.CMP_GE, heap=heap, op="ep_dispatch/ep_combine push",
                        ranks=WORLD)
        half = wl.consume_token(half, token)
    return half


@triton.jit(do_not_specialize=["half_words", "rows"])
def ep_receive_kernel(region, flags, counter, heap, sig, table, x_out, idx_out, w_out, counts, half_words, rows,
                      HW: tl.constexpr, K: tl.constexpr, ROW: tl.constexpr, LOCAL: tl.constexpr, WORLD: tl.constexpr,
                      PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr):
    """After the pushes: rows [0, n) of the region (n: what the table says I receive, at most `rows`) split
    into x_out (HW words a row), idx_out and w_out (K a row), but for the rows of my own tokens, which the
    push wrote there itself; rows [n, rows) zero, -1 and 0. counts[e] += the rows naming my expert e (each
    program adds its own). A family tripped by a signature mismatch waits for and writes nothing."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    live = wl.signature_live(sig, heap)
    half = _wait_pushes(region, flags, counter, heap, half_words, live, WORLD, PROGRAMS)
    s = tl.arange(0, BLOCK_W)
    got = tl.load(table + s * WORLD + me, mask=s < WORLD, other=0)  # rows from each source, in source order
    n = tl.minimum(tl.sum(got, axis=0), rows)
    own_lo = tl.sum(tl.where(s < me, got, 0), axis=0)
    own_hi = own_lo + tl.sum(tl.where(s == me, got, 0), axis=0)
    jj = tl.arange(0, BLOCK_K)
    ll = tl.arange(0, BLOCK_L)
    named = tl.zeros([BLOCK_L], tl.int32)
    for i in range(p, tl.where(live, rows, 0), tl.num_programs(0)):
        src = half + i * ROW
        if (i >= own_lo) & (i < tl.minimum(own_hi, n)):
            idx = tl.load(idx_out + i * K + jj, mask=jj < K, other=-1).to(tl.int32)
            named += tl.sum((idx[:, None] == ll[None, :]).to(tl.int32), axis=0)
        elif i < n:
            copy(x_out + i * HW, src, 0, HW, BLOCK, VEC)
            idx = tl.load(src + HW + jj, mask=jj < K, other=-1)
            tl.store(idx_out + i * K + jj, idx, mask=jj < K)
            tl.store(w_out + i * K + jj, tl.load(src + HW + K + jj, mask=jj < K).to(tl.float32, bitcast=True),
                     mask=jj < K)
            named += tl.sum((idx[:, None] == ll[None, :]).to(tl.int32), axis=0)
        else:
            for start in range(0, HW, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(x_out + i * HW + offs, tl.zeros([BLOCK], tl.int32), mask=offs < HW)
            tl.store(idx_out + i * K + jj, tl.full([BLOCK_K], -1, tl.int32), mask=jj < K)
            tl.store(w_out + i * K + jj, tl.zeros([BLOCK_K], tl.float32), mask=jj < K)
    tl.atomic_add(counts + ll, named, mask=(ll < LOCAL) & live)


@triton.jit(do_not_specialize=["half_words", "tokens", "limit"])
def ep_combine_reduce_kernel(region, flags, counter, heap, sig, rank_pos, table, y, out, half_words, tokens, limit,
                             HW: tl.constexpr, ELEM: tl.constexpr, WORLD: tl.constexpr, PROGRAMS: tl.constexpr,
                             BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    """After the pushes back: out[t] = sum in rank order r of the row token t came back on from r (fp32): my
    rows for ranks r' < r, then its position among them; none where the dispatch did not send or dropped it.
    The row from me is read from y (my received rows: those of ranks s < me, then mine), never pushed. A family
    tripped by a signature mismatch (the push back's check) waits for and writes nothing."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    live = wl.signature_live(sig, heap)
    half = _wait_pushes(region, flags, counter, heap, half_words, live, WORLD, PROGRAMS)
    ww = tl.arange(0, BLOCK_W)
    start = _rows_before_mine(table, me, WORLD, BLOCK_W)
    mine = tl.load(table + me * WORLD + ww, mask=ww < WORLD, other=0)
    back_start = tl.cumsum(mine, axis=0) - mine
    for t in range(p, tl.where(live, tokens, 0), tl.num_programs(0)):
        pos = tl.load(rank_pos + t * WORLD + ww, mask=ww < WORLD, other=-1)
        back = tl.where((pos >= 0) & (pos + start < limit), pos + back_start, -1)
        own = tl.sum(tl.where(ww == me, pos + start, 0), axis=0).to(tl.int64)  # its row in y
        for c in range(0, HW, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            m = offs < HW
            acc_lo = tl.zeros([BLOCK], tl.float32)
            acc_hi = tl.zeros([BLOCK], tl.float32)
            for r in range(WORLD):
                slot = tl.sum(tl.where(ww == r, back, 0), axis=0).to(tl.int64)
                row = half + slot * HW
                if r == me:
                    row = y + own * HW
                a, b = halves_of(tl.load(row + offs, mask=m & (slot >= 0), other=0), ELEM)
                acc_lo += a
                acc_hi += b
            tl.store(out + t * HW + offs, word_of(acc_lo, acc_hi, ELEM), mask=m)


# -- high-throughput host side ------------------------------------------------------

def _vec(words: int, *tensors) -> int:
    """4 (16-byte vectors) where rows of `words` int32 words and every tensor's address allow it, else 1."""
    return 4 if words % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors) else 1


class HTHandle:
    """What ep_combine needs of an ep_dispatch: its plan, and on the device rank_pos (T, W) and table (W, W)
    (ep_position_kernel's and ep_route_kernel's), from which each row's way back is computed; rows received (R)
    and the row limit. `dispatch`: the dispatch's arguments but x's data (x, topk_idx, topk_weights, num_experts,
    max_recv_tokens, its group's name), from which a traced ep_combine finds the plan again (a traced dispatch has
    none)."""

    def __init__(self, plan, rank_pos, table, rows, limit, dispatch):
        self.plan, self.rank_pos, self.table, self.rows, self.limit = plan, rank_pos, table, rows, limit
        self.dispatch = dispatch


class HTPlan(Plan):
    """ep_dispatch / ep_combine of one call signature on one group: the launches, the region's rows, the checks
    done; `dispatch` and `combine` are its entry points.

    A dispatch is five launches: count, route (with the count exchange), position, push, receive; without
    max_recv_tokens, one host sync between route and push reads info (the exact row count, and whether any rank's
    topk_idx was bad: then every rank raises before anything is pushed)."""

    def __init__(self, group, x, topk_idx, topk_weights, num_experts, max_recv_tokens):
        super().__init__(group)
        _check_routing(group, x, topk_idx, num_experts, topk_weights)
        if max_recv_tokens is not None and (not isinstance(max_recv_tokens, int) or isinstance(max_recv_tokens, bool)
                                            or max_recv_tokens < 0):
            raise ValueError(f"max_recv_tokens must be None or an int >= 0, got {max_recv_tokens!r}")
        w = group.size
        if w > 63:
            raise ValueError(f"ep_dispatch serves at most 63 ranks (a token's ranks are bits of a word), not {w}")
        t, k = topk_idx.shape
        self.tokens, self.k, self.hidden, self.dtype, self.idx_dtype = t, k, x.shape[1], x.dtype, topk_idx.dtype
        self.num_experts, self.local = num_experts, num_experts // w
        self.max_recv = max_recv_tokens
        # What the kernels cannot take as it is gets copied per call (_rows): x, the routing if not contiguous.
        self.cols = _word_columns(x)
        self.ready = (_rows_ready(signature(x), self.cols) and topk_idx.is_contiguous()
                      and topk_weights.is_contiguous())
        x, topk_idx, topk_weights = self._prepared(x, topk_idx, topk_weights)
        self.hw = self.cols * x.element_size() // 4
        self.row = triton.cdiv(self.hw + 2 * k, 4) * 4  # [x | local topk_idx | topk_weights], 16-byte rows
        self.ws = ws = _workspace(group)
        self.cap = ws.ht_half_words // self.row  # dispatched rows a half holds
        have = 2 * ws.ht_half_words * 4
        if max_recv_tokens is not None and max_recv_tokens > self.cap:
            raise _too_big(f"ep_dispatch with max_recv_tokens={max_recv_tokens}", 2 * max_recv_tokens * self.row * 4,
                           have)
        if t * min(w, k) * self.hw > ws.ht_half_words:  # the rows that come back to me in ep_combine
            raise _too_big(f"ep_combine of {t} tokens", 2 * t * min(w, k) * self.hw * 4, have)
        self.heap = heap = group.heap.descriptor
        dev = group.device
        gpu = dev.type == "cuda"
        if gpu:
            ht_block = tuning.value("moe.ht_block", dev, w)
            block, warps = ht_block["words"], ht_block["warps"]
            programs = tuning.value("moe.ht_programs", dev, w)  # push programs: the receivers wait on each's flag
            self.grid = tuning.value("moe.ht_copy_programs", dev, w)  # programs that copy out / sum what arrived
            blk_t = tuning.value("moe.ht_route_tokens", dev, w)
        else:
            (block, warps), programs = HT_CPU["block"], HT_CPU["programs"]
            self.grid, blk_t = HT_CPU["copy_programs"], HT_CPU["route_tokens"]
        if programs > HT_MAX_PROGRAMS:
            raise ValueError(f"moe.ht_programs = {programs} is more than the workspace's flags ({HT_MAX_PROGRAMS})")
        i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=dev)  # noqa: E731
        blk_w, blk_k = triton.next_power_of_2(w), triton.next_power_of_2(k)
        self.blocks = max(1, triton.cdiv(t, blk_t))  # token blocks of the count and position kernels
        blk_b = min(1024, triton.next_power_of_2(self.blocks))
        blk_wide = max(4, triton.next_power_of_2(w + 1))  # [ranks | bad entries]
        self.count = Launch(ep_count_kernel, (self.blocks,), (topk_idx, i32(self.blocks, w + 1), ws.error, t),
                            dict(K=k, LOCAL=self.local, WORLD=w, BLOCK_T=blk_t, BLOCK_K=blk_k, BLOCK_W=blk_wide), 4)
        # What the members must agree on (the token count of each is its own), for the signature check: ep_dispatch
        # checks it in the count exchange, ep_combine in the push back (module doc).
        agreed = dict(experts=num_experts, hidden=self.hidden, dtype=str(x.dtype).removeprefix("torch."), k=k,
                      max_recv_tokens=max_recv_tokens)
        self.combine_fp = self.sign("ep_combine", **agreed)
        self.dispatch_fp = self.sign("ep_dispatch", **agreed)
        signed = (ws.sig_ht, ws.counter(5), ws.signatures.tensor)
        self.route = Launch(ep_route_kernel, (1,),
                            (i32(self.blocks, w + 1), i32(self.blocks, w), i32(w, w), i32(self.local), i32(3),
                             ws.table, ws.counter(2), heap, *signed, self.dispatch_fp, self.blocks),
                            dict(LOCAL=self.local, WORLD=w, BLOCK_B=blk_b, BLOCK_W=blk_wide,
                                 BLOCK_L=triton.next_power_of_2(self.local)), 4)
        self.position = Launch(ep_position_kernel, (self.blocks,),
                               (topk_idx, i32(self.blocks, w), i32(max(t, 1), w), t),
                               dict(K=k, LOCAL=self.local, WORLD=w, BLOCK_T=blk_t, BLOCK_K=blk_k, BLOCK_W=blk_wide),
                               4)
        self.push = Launch(ep_push_kernel, (programs,),
                           (x.view(torch.int32), topk_idx, topk_weights, i32(max(t, 1), w), i32(w, w), ws.ht,
                            i32(1, self.hw), torch.zeros((1, k), dtype=topk_idx.dtype, device=dev),
                            torch.zeros((1, k), device=dev), ws.flags, ws.counter(3), heap, ws.sig_ht, t, 1,
                            ws.ht_half_words),
                           dict(HW=self.hw, K=k, ROW=self.row, LOCAL=self.local, WORLD=w, PROGRAMS=programs,
                                BLOCK=block, VEC=_vec(self.hw, x), BLOCK_K=blk_k, BLOCK_W=blk_w), warps)
        self.receive = Launch(ep_receive_kernel, (self.grid,),
                              (ws.ht, ws.flags, ws.counter(4), heap, ws.sig_ht, i32(w, w), i32(1, self.hw),
                               torch.zeros((1, k), dtype=topk_idx.dtype, device=dev),
                               torch.zeros((1, k), device=dev), i32(self.local), ws.ht_half_words, 1),
                              dict(HW=self.hw, K=k, ROW=self.row, LOCAL=self.local, WORLD=w, PROGRAMS=programs,
                                   BLOCK=block, VEC=_vec(self.hw), BLOCK_K=blk_k,
                                   BLOCK_L=triton.next_power_of_2(self.local), BLOCK_W=blk_w), warps)
        # y's rows go back 16-byte vectors at a time: the combine takes y at that alignment (else a copy).
        self.push_back = Launch(ep_push_back_kernel, (programs,),
                                (i32(1, self.hw), i32(w, w), ws.ht, ws.flags, ws.counter(3), heap, ws.error,
                                 *signed, self.combine_fp, 1, ws.ht_half_words),
                                dict(HW=self.hw, WORLD=w, PROGRAMS=programs, BLOCK=block, VEC=_vec(self.hw),
                                     BLOCK_W=blk_w), warps)
        self.reduce = Launch(ep_combine_reduce_kernel, (self.grid,),
                             (ws.ht, ws.flags, ws.counter(4), heap, ws.sig_ht, i32(max(t, 1), w), i32(w, w),
                              i32(1, self.hw), i32(1, self.hw), ws.ht_half_words, t, 1),
                             dict(HW=self.hw, ELEM=_ELEM[x.dtype], WORLD=w, PROGRAMS=programs, BLOCK=block,
                                  BLOCK_W=blk_w), warps)
        # Pointer arguments as the launches take them (Launch.address): on GPUs addresses (the workspace's
        # taken once here, no view made per call), under the interpreter tensors of the kernels' types.
        a = self.address = self.route.address
        self.words = (lambda t: t.view(torch.int32)) if self.route.kernel is None else a
        self.route_fixed = tuple(map(a, (ws.table, ws.counter(2), heap)))
        self.error_at = a(ws.error)
        self.push_fixed = tuple(map(a, (ws.ht, ws.flags, ws.counter(3), heap)))
        self.region_at, self.signal_fixed = self.push_fixed[0], (*self.push_fixed[1:], a(ws.sig_ht))
        self.signed_fixed = tuple(map(a, signed))
        self.wait_fixed = tuple(map(a, (ws.ht, ws.flags, ws.counter(4), heap, ws.sig_ht)))

    def _prepared(self, x, topk_idx, topk_weights):
        """The call's tensors as the kernels take them (contiguous; x in whole words, aligned to them)."""
        if self.ready:
            return x, topk_idx, topk_weights
        return (x if _rows_ready(signature(x), self.cols) else _rows(x, self.cols), topk_idx.contiguous(),
                topk_weights.contiguous())

    def dispatch(self, x, topk_idx, topk_weights):
        dispatch = (x, topk_idx, topk_weights, self.num_experts, self.max_recv, self.group.name)
        ws, w, dev, a = self.ws, self.group.size, x.device, self.address
        ws.raise_routing_error()
        x, topk_idx, topk_weights = self._prepared(x, topk_idx, topk_weights)
        rank_pos = torch.empty((self.tokens, w), dtype=torch.int32, device=dev)
        table = torch.empty((w, w), dtype=torch.int32, device=dev)
        counts = torch.empty(self.local, dtype=torch.int32, device=dev)
        info = torch.empty(3, dtype=torch.int32, device=dev)
        block_counts = torch.empty((self.blocks, w + 1), dtype=torch.int32, device=dev)
        block_start = torch.empty((self.blocks, w), dtype=torch.int32, device=dev)
        self.count(a(topk_idx), a(block_counts), self.error_at, self.tokens)
        self.route(a(block_counts), a(block_start), a(table), a(counts), a(info), *self.route_fixed,
                   *self.signed_fixed, self.dispatch_fp, self.blocks)
        self.position(a(topk_idx), a(block_start), a(rank_pos), self.tokens)
        if self.max_recv is None:
            most, rows, bad = info.tolist()  # the one host sync: the same table on every rank, so all raise or none
            ws.signatures.raise_recorded()  # a mismatch: every member raises here, before anything is pushed
            if bad:
                ws.raise_routing_error()
                raise ValueError("topk_idx on another rank names an expert twice or one outside [0, num_experts): "
                                 "nothing was sent")
            if most > self.cap:
                raise _too_big(f"ep_dispatch receiving {most} rows on one rank", 2 * most * self.row * 4,
                               2 * ws.ht_half_words * 4)
            limit = self.cap
        else:
            rows = limit = self.max_recv  # rows past it are dropped
        recv_x = torch.empty((rows, self.cols), dtype=self.dtype, device=dev)
        recv_idx = torch.empty((rows, self.k), dtype=self.idx_dtype, device=dev)
        recv_w = torch.empty((rows, self.k), dtype=torch.float32, device=dev)
        self.push(self.words(x), a(topk_idx), a(topk_weights), a(rank_pos), a(table), self.region_at,
                  self.words(recv_x), a(recv_idx), a(recv_w), *self.signal_fixed, self.tokens, limit, ws.ht_half_words)
        self.receive(*self.wait_fixed, a(table), self.words(recv_x), a(recv_idx), a(recv_w), a(counts),
                     ws.ht_half_words, rows)
        ws.raise_routing_error()  # with max_recv_tokens, under the interpreter: this call's row
        ws.signatures.raise_recorded()  # with max_recv_tokens: under the interpreter this call's, on GPUs an earlier
        return recv_x[:, :self.hidden], recv_idx, recv_w, counts, HTHandle(self, rank_pos, table, rows, limit,
                                                                           dispatch)

    def combine(self, y, handle):
        ws, a = self.ws, self.address
        ws.raise_routing_error()
        if y.data_ptr() % 16 or not _rows_ready(signature(y), self.cols):
            y = _rows(y, self.cols)  # the push back was compiled for 16-byte aligned rows of whole words
        self.push_back(self.words(y), a(handle.table), *self.push_fixed, self.error_at, *self.signed_fixed,
                       self.combine_fp, handle.rows, ws.ht_half_words)
        out = torch.empty((self.tokens, self.cols), dtype=self.dtype, device=y.device)
        self.reduce(*self.wait_fixed, a(handle.rank_pos), a(handle.table), self.words(y), self.words(out),
                    ws.ht_half_words, self.tokens, handle.limit)
        ws.signatures.raise_recorded()  # under the interpreter this call's mismatch, on GPUs an earlier one's
        return out if self.cols == self.hidden else out[:, :self.hidden].contiguous()


@declare_op(collective=True)
def ep_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                max_recv_tokens: int | None = None, group=None) -> tuple:
    """Send each token once to every member of `group` (default: the world) that holds one of its experts (high
    throughput, prefill). The experts are split contiguously over the group's ranks: group rank r holds experts
    [r L, (r + 1) L), L = num_experts / group size.

    x (T, hidden) bf16/fp16/fp32; topk_idx (T, k) int64/int32 (-1: no expert); topk_weights (T, k) fp32; any
    layout and hidden size (a 16-bit row of odd length travels with a zero column more: recv_x is then a view).
    Returns (recv_x (R, hidden), recv_topk_idx (R, k): the row's experts as local indices on this rank, -1
    for experts elsewhere; recv_topk_weights (R, k); counts (L,) int32: received tokens per local expert;
    handle for ep_combine). Rows are ordered by source rank, then source token. Without max_recv_tokens R is
    exact (one host sync); with it (the same on every rank) R = max_recv_tokens (no sync, capturable): rows
    past the received ones have idx -1, weights 0 and x 0, and tokens beyond it are dropped (their combine
    gets nothing from this rank). Collective over the group.

    topk_idx's values are checked on the device: a row naming an expert twice or one outside [0,
    num_experts) (and not -1) raises a ValueError naming topk_idx. Without max_recv_tokens every rank
    raises in this call, before anything is pushed (the sync sees every rank's check); with it, this rank
    raises at its next EP op's call once the kernel has run, and until then the row does no harm (entries
    outside the experts count as none, a repeated expert once). The token counts each rank sends are bounded by
    the receiver's region (a member whose call does not match raises on the receiver, what it sent ignored).
    """
    g = resolve(group)
    if g.topology.spans_nodes:  # the network to the target node, then NVLink: ep_nodes
        return ep_nodes.ep_dispatch(g, x, topk_idx, topk_weights, num_experts, max_recv_tokens)
    return _plan(g, x, topk_idx, topk_weights, num_experts, max_recv_tokens).dispatch(x, topk_idx, topk_weights)


def _plan(group, x, topk_idx, topk_weights, num_experts, max_recv_tokens) -> HTPlan:
    return plan(group, lambda: ("ep", signature(x), signature(topk_idx), signature(topk_weights), num_experts,
                                max_recv_tokens),
                lambda: HTPlan(group, x, topk_idx, topk_weights, num_experts, max_recv_tokens))


@declare_op(collective=True)
def ep_combine(y: torch.Tensor, handle: HTHandle, group=None) -> torch.Tensor:
    """Return each received row's result to its source: out (T, hidden) on the source rank = the sum over the
    ranks the token went to of their y row (y (R, hidden): each rank's weighted sum of its local experts'
    outputs per received row), in rank order, fp32. Collective over the dispatch's group (`group`: default that
    one; another raises)."""
    if isinstance(handle, ep_nodes.NodesHandle):  # a dispatch across nodes
        return ep_nodes.ep_combine(y, handle, group)
    g = handle_group(handle, group, HTHandle, "ep_dispatch")
    p = handle.plan
    check_tensor("y", y, g, dtypes=(p.dtype,), contiguous=False)
    if tuple(y.shape) != (handle.rows, p.hidden):
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {(handle.rows, p.hidden)} (recv_x's)")
    return p.combine(y, handle)


# -- the operators (inference) ---------------------------------------------------------------------------------
#   torch.ops.weft.ep_dispatch(x, topk_idx, topk_weights, num_experts, group_name, max_recv_tokens)
#       -> (recv_x, recv_topk_idx, recv_topk_weights, counts, rank_pos, table): R rows, data-dependent without
#          max_recv_tokens (an unbacked size under tracing)
#   torch.ops.weft.ep_combine(y, rank_pos, table, x, topk_idx, topk_weights, num_experts, group_name,
#                             max_recv_tokens) -> (T, hidden)
# A handle is a Python object, which an operator cannot take: the combine takes the handle's tensors and the
# dispatch's arguments, from whose signature it finds the dispatch's plan in the group it names (x and the
# routing are not read).

@ep_dispatch.define
def ep_dispatch_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   group_name: str, max_recv_tokens: Optional[int] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ep_nodes.eager_only(group_name, "ep_dispatch")
    recv_x, recv_idx, recv_w, counts, handle = ep_dispatch.eager(x, topk_idx, topk_weights, num_experts,
                                                                 max_recv_tokens, group=group_name)
    return recv_x.contiguous(), recv_idx, recv_w, counts, handle.rank_pos, handle.table


@ep_dispatch_op.register_fake
def _(x, topk_idx, topk_weights, num_experts, group_name, max_recv_tokens=None):
    size = group_size(group_name)
    rows = torch.library.get_ctx().new_dynamic_size() if max_recv_tokens is None else max_recv_tokens
    t, k = topk_idx.shape
    i32 = dict(dtype=torch.int32)
    return (x.new_empty((rows, x.shape[1])), topk_idx.new_empty((rows, k)),
            topk_weights.new_empty((rows, k)), x.new_empty((num_experts // size,), **i32),
            x.new_empty((t, size), **i32), x.new_empty((size, size), **i32))


@ep_dispatch.traced
def _(x, topk_idx, topk_weights, num_experts, max_recv_tokens=None, group=None):
    name = group_name(group)
    recv_x, recv_idx, recv_w, counts, rank_pos, table = torch.ops.weft.ep_dispatch(
        x, topk_idx, topk_weights, num_experts, name, max_recv_tokens)
    return recv_x, recv_idx, recv_w, counts, HTHandle(None, rank_pos, table, recv_x.shape[0], None,
                                                      (x, topk_idx, topk_weights, num_experts, max_recv_tokens, name))


@ep_combine.define
def ep_combine_op(y: torch.Tensor, rank_pos: torch.Tensor, table: torch.Tensor, x: torch.Tensor,
                  topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group_name: str,
                  max_recv_tokens: Optional[int] = None) -> torch.Tensor:
    ep_nodes.eager_only(group_name, "ep_combine")
    found = _plan(resolve(group_name), x, topk_idx, topk_weights, num_experts, max_recv_tokens)
    rows = y.shape[0]
    limit = found.cap if max_recv_tokens is None else rows
    dispatch = (x, topk_idx, topk_weights, num_experts, max_recv_tokens, group_name)
    return ep_combine.eager(y, HTHandle(found, rank_pos, table, rows, limit, dispatch))


@ep_combine_op.register_fake
def _(y, rank_pos, table, x, topk_idx, topk_weights, num_experts, group_name, max_recv_tokens=None):
    return y.new_empty((rank_pos.shape[0], y.shape[1]))


@ep_combine.traced
def _(y, handle, group=None):
    if not isinstance(handle, HTHandle):
        raise TypeError(f"handle must be what ep_dispatch returned, got {type(handle).__name__}")
    x, topk_idx, topk_weights, num_experts, max_recv_tokens, name = handle.dispatch
    if group is not None and group_name(group) != name:
        raise ValueError(f"group is {group_name(group)!r}, but the handle's dispatch ran over group {name!r}")
    return torch.ops.weft.ep_combine(y, handle.rank_pos, handle.table, x, topk_idx, topk_weights, num_experts,
                                     name, max_recv_tokens)


# Signatures for the sm_90 compile check (weft.testing.compile), at the shipped tables' push block.
_SHIPPED_BLOCK = tuning.shipped("moe.ht_block")[0]["words"]
COMPILE_CASES = [
    (ep_count_kernel, dict(topk=t, block_counts="*i32", err="*i64", tokens="i32"),
     dict(K=8, LOCAL=256 // wd, WORLD=wd, BLOCK_T=64, BLOCK_K=8, BLOCK_W=max(4, triton.next_power_of_2(wd + 1))),
     dict(num_warps=4))
    for t in ("*i64", "*i32") for wd in (2, 8)
] + [
    (ep_route_kernel, dict(block_counts="*i32", block_start="*i32", table="*i32", counts="*i32", info="*i32",
                           buf="*i64", counter="*i64", heap="*i64", sig="*i64", sig_counter="*i64",
                           sig_err="*i64", fp="i32", blocks="i32"),
     dict(LOCAL=256 // wd, WORLD=wd, BLOCK_B=64, BLOCK_W=max(4, triton.next_power_of_2(wd + 1)), BLOCK_L=256 // wd),
     dict(num_warps=4))
    for wd in (2, 8)
] + [
    (ep_position_kernel, dict(topk=t, block_start="*i32", rank_pos="*i32", tokens="i32"),
     dict(K=8, LOCAL=256 // wd, WORLD=wd, BLOCK_T=64, BLOCK_K=8, BLOCK_W=max(4, triton.next_power_of_2(wd + 1))),
     dict(num_warps=4))
    for t in ("*i64", "*i32") for wd in (2, 8)
] + [
    (ep_push_kernel, dict(x="*i32", topk=t, weights="*fp32", rank_pos="*i32", table="*i32", region="*i32",
                          x_out="*i32", idx_out=t, w_out="*fp32", flags="*i32", counter="*i64", heap="*i64",
                          sig="*i64", tokens="i32", limit="i32", half_words="i32"),
     dict(HW=hw, K=8, ROW=triton.cdiv(hw + 16, 4) * 4, LOCAL=32, WORLD=8, PROGRAMS=128, BLOCK=_SHIPPED_BLOCK,
          VEC=_vec(hw), BLOCK_K=8, BLOCK_W=8), dict(num_warps=8))
    for t in ("*i64", "*i32") for hw in (3584, 3585)
] + [
    (ep_push_back_kernel, dict(y="*i32", table="*i32", region="*i32", flags="*i32", counter="*i64", heap="*i64",
                               err="*i64", sig="*i64", sig_counter="*i64", sig_err="*i64", fp="i32", rows="i32",
                               half_words="i32"),
     dict(HW=3584, WORLD=8, PROGRAMS=128, BLOCK=_SHIPPED_BLOCK, VEC=4, BLOCK_W=8), dict(num_warps=8)),
] + [
    (ep_receive_kernel, dict(region="*i32", flags="*i32", counter="*i64", heap="*i64", sig="*i64", table="*i32",
                             x_out="*i32", idx_out=t, w_out="*fp32", counts="*i32", half_words="i32", rows="i32"),
     dict(HW=3584, K=8, ROW=3600, LOCAL=32, WORLD=8, PROGRAMS=128, BLOCK=_SHIPPED_BLOCK, VEC=4, BLOCK_K=8,
          BLOCK_L=32, BLOCK_W=8), dict(num_warps=8))
    for t in ("*i64", "*i32")
] + [
    (ep_combine_reduce_kernel, dict(region="*i32", flags="*i32", counter="*i64", heap="*i64", sig="*i64",
                                    rank_pos="*i32", table="*i32", y="*i32", out="*i32", half_words="i32",
                                    tokens="i32", limit="i32"),
     dict(HW=3584, ELEM=e, WORLD=8, PROGRAMS=128, BLOCK=_SHIPPED_BLOCK, BLOCK_W=8), dict(num_warps=8))
    for e in (tl.bfloat16, tl.float32)
]
