"""Low-latency expert-parallel dispatch and combine (decode): ep_dispatch_ll / ep_combine_ll.

Low-latency EP (decode), ep_dispatch_ll / ep_combine_ll: one launch each, no host sync, data and signal in
the same LL words (`wl.pack_ll`: 4 bytes and the epoch per 8-byte store). Rank s writes token t into slot
[s][t] of every destination rank; the slot's first k words say which of the receiver's experts take it and
at which position among s's tokens for that expert; a header per sender (written by its program 0) carries
s's token count and its per-expert counts, from which the receiver places every token at its final row of
recv[expert] (rows ordered by source rank, then token): `counts[e]` rows of expert e are valid. Combine: each
rank first sends its tokens' weights to the ranks of their experts; a rank sums the weighted outputs of its
experts for each token it received and sends that one row back to slot [t][rank] of the token's rank, which
adds the rows of the ranks (one row per token and rank crosses the links, not one per expert).
Work is dealt out in units of (token, chunk of its row's words): program p handles chunk p % CHUNKS of tokens
t = p // CHUNKS (mod LANES), sending and then receiving those units, so one token's row moves on CHUNKS
programs at once; a program waits only on the same program of its peers (data, and in combine the acks) and
on lower ones (the header, a token's meta words from its chunk-0 program), and issues all its sends first.
The header's counts come from a histogram of each row's first namings (O(tokens x k), program 0); a token's
position among its sender's tokens for an expert from a scan of the tokens before it (its chunk-0 program).

With return_recv_hook=True a call launches its sends only (the same kernel, SEND without RECV) and returns a
RecvHook that launches the receive (RECV alone, the send's epoch read back with `wl.last_epoch`), so the
caller's work runs while the rows travel.

The buffers are the EP workspace's LL regions (ep_workspace: double-buffered by call parity). The dispatch
checks topk_idx's rows on the device (routing.check_rows), a bad row raising at the next EP op on that rank.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import weft.language as wl

from ... import tuning
from ..blocks import fp8_quantize, halves_of, word_of
from ..common import Launch, Plan, check_tensor, group_name, group_size, handle_group, plan, resolve, signature
from ..gemm import num_sms
from ..registry import declare_op
from . import ep_nodes
from .ep_workspace import _ELEM, _rows, _rows_ready, _too_big, _word_columns, _workspace
from .routing import INDEX_DTYPES, _check_routing, check_rows, peer_error, valid_experts


# -- low-latency kernels ------------------------------------------------------------
# Work is dealt out in units of (token, chunk of its row): a row of HW words is CHUNKS chunks of CHUNK words
# (a power of two, a multiple of 32 words, so fp8's 128-channel groups never straddle chunks; the last chunk
# ragged). Program p takes chunk c = p % CHUNKS of tokens t = p // CHUNKS (mod LANES): a token's chunks travel
# on CHUNKS programs at once, and chunk 0 of a token is on the lowest of them, which the interpreter needs (it
# runs a grid's programs one after another, so a program may only wait for words of lower programs of peers).

@triton.jit
def _experts_before(topk, t, e, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """For each j: how many tokens t' < t name expert e[j] (0 where e[j] < 0), a token naming it twice once."""
    jj = tl.arange(0, BLOCK_K)
    pos = tl.zeros([BLOCK_K], tl.int32)
    for t0 in range(0, t, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        prev = tl.load(topk + tt[:, None] * K + jj[None, :], mask=(tt[:, None] < t) & (jj[None, :] < K),
                       other=-1).to(tl.int32)
        hit = (prev[None, :, :] == e[:, None, None]) & (e[:, None, None] >= 0)
        pos += tl.sum(tl.max(hit.to(tl.int32), axis=2), axis=1)  # tokens, not entries: a repeat counts once
    return pos


@triton.jit
def _first_naming(e, BLOCK_K: tl.constexpr):
    """Entries of rows of experts e (R, BLOCK_K; -1: none) that are their row's first naming of the expert."""
    jj = tl.arange(0, BLOCK_K)
    earlier = (e[:, :, None] == e[:, None, :]) & (jj[None, None, :] < jj[None, :, None])
    return (e >= 0) & (tl.max(earlier.to(tl.int32), axis=2) == 0)


@triton.jit
def _tokens_per_expert(topk, tokens, K: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """For each expert e < BLOCK_E: how many of the tokens name it (a token naming it twice once), as a
    histogram of each row's first namings: O(tokens x k)."""
    jj = tl.arange(0, BLOCK_K)
    cnt = tl.zeros([BLOCK_E], tl.int32)
    for t0 in range(0, tokens, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        live = (tt[:, None] < tokens) & (jj[None, :] < K)
        e = valid_experts(tl.load(topk + tt[:, None] * K + jj[None, :], mask=live, other=-1), live, EXPERTS)
        first = _first_naming(e, BLOCK_K)
        cnt += tl.histogram(tl.reshape(e, [BLOCK_T * BLOCK_K]), BLOCK_E, mask=tl.reshape(first, [BLOCK_T * BLOCK_K]))
    return cnt


@triton.jit
def _fp8_words(x, t, g0, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """Channel groups [g0, g0 + BLOCK_G) of token t of x (128 channels each): e4m3 words (4 channels per int32,
    little-endian) and the groups' fp32 scales, the bits of fp8_rows (blocks.fp8_quantize)."""
    gg = g0 + tl.arange(0, BLOCK_G)
    c = tl.arange(0, 128)
    v = tl.load(x + (t * GROUPS + gg[:, None]) * 128 + c[None, :], mask=gg[:, None] < GROUPS, other=0.0)
    b, scale = fp8_quantize(v.to(tl.float32))
    b = tl.reshape(b, [BLOCK_G * 32, 4])
    return tl.sum(b << (tl.arange(0, 4) * 8)[None, :], axis=1), scale


@triton.jit(do_not_specialize=["tokens", "half_words", "fp"])
def ep_dispatch_ll_kernel(x, topk, recv, scales, counts, src_rows, src_tokens, buf, counter, heap, err, tokens,
                          half_words, sig, sig_err, fp, HW: tl.constexpr, K: tl.constexpr, LOCAL: tl.constexpr, MAX_T: tl.constexpr,
                          WORLD: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, LANES: tl.constexpr,
                          FP8: tl.constexpr, GROUPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, SEND: tl.constexpr, RECV: tl.constexpr):
    """Send chunk c of my tokens t = lane (mod LANES) to the ranks of their experts, then place chunk c of the
    tokens every rank sent me in that lane into recv[local expert, row] (x and recv as int32 words, HW a row).

    A half of `buf` (epoch parity) holds headers [W][E + 1] (a sender's tokens per expert, then its token
    count; program 0 of each rank writes its own to every rank, and every program of every rank awaits each)
    and slots [W][MAX_T][K + HW (+ GROUPS)] (token t of sender s: K meta words, local expert << 16 | position
    among s's tokens for that expert, or -1, written by the token's chunk-0 program; then the token's words,
    each chunk by its program; in fp8 then the scales, each with the chunk of its group), all LL words.
    src_rows[s, t, j] = the flat recv row of expert j of token t of rank s, or -1; src_tokens[s] = s's tokens.
    A bad row of topk is recorded in `err` (check_rows) and travels harmlessly: its entries outside the
    experts as none, an expert named twice to one row, which combine returns once per naming.
    SEND / RECV: which halves of the call this launch runs (both: one launch; else the receive is a second
    launch of the same grid, which takes the send's epoch). Every program signs the call as it sends; the
    receive checks every member's signature (wl.check_signed) before its first wait: on a mismatch it writes
    nothing (recv, counts, routes), and a tripped family sends nothing.
    """
    p = tl.program_id(0)
    lane = p // CHUNKS
    c = p % CHUNKS
    me = wl.rank(heap)
    if SEND:
        epoch = wl.next_epoch(counter)
    else:
        epoch = wl.last_epoch(counter)
    running = wl.signature_live(sig, heap)  # not tripped by a signature mismatch
    # half_words is a multiple of 32 (MoeWorkspace): said so, Triton keeps 16-byte vectors through the halves.
    half = buf + (epoch % 2) * (half_words // 32 * 32)
    EXPERTS: tl.constexpr = LOCAL * WORLD
    HEAD: tl.constexpr = EXPERTS + 1
    SLOT: tl.constexpr = K + HW + GROUPS * FP8
    G: tl.constexpr = CHUNK // 32  # fp8: 128-channel groups a chunk
    slots = half + (WORLD * HEAD + 1) // 2 * 2
    jj = tl.arange(0, BLOCK_K)
    ll = tl.arange(0, BLOCK_L)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < HW
    gg = c * G + tl.arange(0, G)
    if SEND:  # the header (program 0), then chunk c of my tokens in this lane
        if running:
            wl.sign(sig, epoch, fp, heap)
        else:
            tokens = tokens * 0
        ee = tl.arange(0, BLOCK_E)
        if (lane == 0) & (c == 0) & running:
            head = tl.where(ee < EXPERTS, _tokens_per_expert(topk, tokens, K, EXPERTS, BLOCK_K, BLOCK_E, BLOCK_T),
                            tokens)
            for r in range(WORLD):
                tl.store(wl.symm_at(half + me * HEAD, r, heap) + ee, wl.pack_ll(head, epoch), mask=ee < HEAD)
        for t in range(lane, tokens, LANES):
            live = (jj < K)[None, :]
            raw = tl.load(topk + t * K + jj[None, :], mask=live, other=-1)
            e = tl.reshape(valid_experts(raw, live, EXPERTS), [BLOCK_K])
            dest = tl.where(e >= 0, e // LOCAL, -1)
            mine = slots + (me * MAX_T + t) * SLOT
            if c == 0:  # the token's meta words, to every rank (the others' say -1)
                check_rows(raw, tl.zeros([1], tl.int32) + t, err, live, EXPERTS, BLOCK_K)
                pos = _experts_before(topk, t, e, K, BLOCK_K, BLOCK_T)
                for r in range(WORLD):
                    meta = tl.where(dest == r, ((e - r * LOCAL) << 16) | pos, -1)
                    tl.store(wl.symm_at(mine, r, heap) + jj, wl.pack_ll(meta, epoch), mask=jj < K)
            if FP8:
                words, scale = _fp8_words(x, t, c * G, GROUPS, G)
                packed = wl.pack_ll(words, epoch)
                packed_scale = wl.pack_ll(scale.to(tl.int32, bitcast=True), epoch)
            else:
                packed = wl.pack_ll(tl.load(x + t * HW + offs, mask=m, other=0), epoch)
            for r in range(WORLD):
                if tl.sum((dest == r).to(tl.int32), axis=0) > 0:
                    tl.store(wl.symm_at(mine, r, heap) + K + offs, packed, mask=m)
                    if FP8:
                        tl.store(wl.symm_at(mine, r, heap) + K + HW + gg, packed_scale, mask=gg < GROUPS)
    if RECV:  # chunk c of every rank's tokens in this lane into their recv rows
        ok = running
        if running:
            ok = wl.check_signed(sig, epoch, fp, heap, sig_err, op="ep_dispatch_ll")
        first = (lane == 0) & (c == 0) & ok
        base = tl.zeros([BLOCK_L], tl.int32)  # rows of each of my experts taken by senders before s
        for s in range(tl.where(ok, WORLD, 0)):
            head = wl.wait_ll(half + s * HEAD + tl.where(ll < LOCAL, me * LOCAL + ll, EXPERTS), ll <= LOCAL, epoch,
                              heap=heap, peer=s, op="ep_dispatch_ll header")
            sent = tl.sum(tl.where(ll == LOCAL, head, 0), axis=0)
            n_s = tl.minimum(tl.maximum(sent, 0), MAX_T)  # a count past the slots: a peer's call that differs
            if n_s != sent:
                peer_error(err, s, 3)
            for t in range(lane, n_s, LANES):
                slot = slots + (s * MAX_T + t) * SLOT
                meta = wl.wait_ll(slot + jj, jj < K, epoch, heap=heap, peer=s, op="ep_dispatch_ll token")
                named = (meta >= 0) & (jj < K)
                lexp = tl.where(named, meta >> 16, -1)
                row = tl.sum(tl.where(ll[None, :] == lexp[:, None], base[None, :], 0), axis=1) + (meta & 0xFFFF)
                # An expert or row past mine (a peer's header or meta that does not match this call) is dropped.
                taken = named & (lexp < LOCAL) & (row >= 0) & (row < WORLD * MAX_T)
                if tl.sum((named & ~taken).to(tl.int32), axis=0) > 0:
                    peer_error(err, s, 3)
                flat = tl.where(taken, lexp * (WORLD * MAX_T) + row, -1).to(tl.int64)
                if c == 0:
                    tl.store(src_rows + (s * MAX_T + t) * K + jj, flat.to(tl.int32), mask=jj < K)
                if tl.sum(taken.to(tl.int32), axis=0) > 0:
                    # The chunk to every row that takes it at once (a row named twice gets the same words twice).
                    words = wl.wait_ll(slot + K + offs, m, epoch, heap=heap, peer=s, op="ep_dispatch_ll data")
                    tl.store(recv + flat[:, None] * HW + offs[None, :],
                             tl.broadcast_to(words[None, :], [BLOCK_K, CHUNK]), mask=(flat >= 0)[:, None] & m[None, :])
                    if FP8:
                        got = wl.wait_ll(slot + K + HW + gg, gg < GROUPS, epoch, heap=heap, peer=s,
                                         op="ep_dispatch_ll scales")
                        tl.store(scales + flat[:, None] * GROUPS + gg[None, :],
                                 tl.broadcast_to(got[None, :], [BLOCK_K, G]),
                                 mask=(flat >= 0)[:, None] & (gg < GROUPS)[None, :])
            base += tl.where(ll < LOCAL, head, 0)
            if first:
                tl.store(src_tokens + s, n_s)
        if first:
            tl.store(counts + ll, tl.minimum(tl.maximum(base, 0), WORLD * MAX_T), mask=ll < LOCAL)


@triton.jit(do_not_specialize=["tokens", "half_words", "fp"])
def ep_combine_ll_kernel(y, topk, weights, out, src_rows, src_tokens, buf, counter, heap, tokens, half_words, sig,
                         sig_err, fp, HW: tl.constexpr, K: tl.constexpr, LOCAL: tl.constexpr, MAX_T: tl.constexpr,
                         WORLD: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, LANES: tl.constexpr,
                         ELEM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, SEND: tl.constexpr,
                         RECV: tl.constexpr):
    """out[t] = sum_j weights[t, j] * (output of expert j for token t), each rank's share summed where its
    experts are: my tokens' weights go to the ranks of their experts; each rank sends back, per token it
    received, chunk c of the weighted sum of its experts' rows of y (one row per token and rank, not per
    expert: at 2 ranks and top-8 a quarter of the bytes); the token's rank adds those (fp32 sums, rounded to
    y's dtype on each rank and at the end).

    A half of `buf` (epoch parity) holds acks [W][programs] (every program hears from every rank each call,
    which the halves' reuse relies on), weights [W][MAX_T][K] (of sender s's token t, written by the token's
    chunk-0 program) and partial sums [MAX_T][W][HW] (of my token t from rank r), all LL words. A program
    waits only on the same program of its peers (partial sums, acks) and on lower ones (weights, chunk 0).
    SEND: the weights, then the partial sums and the acks (it waits for its peers' weights); RECV: the sums.
    The send signs the call and checks every member's signature (wl.check_signed) before its first wait: on a
    mismatch nothing more is sent or written (a separate receive launch finds the family tripped).
    """
    p = tl.program_id(0)
    lane = p // CHUNKS
    c = p % CHUNKS
    me = wl.rank(heap)
    if SEND:
        epoch = wl.next_epoch(counter)
    else:
        epoch = wl.last_epoch(counter)
    live = wl.signature_live(sig, heap)
    ok = live
    half = buf + (epoch % 2) * (half_words // 32 * 32)
    PROGRAMS: tl.constexpr = LANES * CHUNKS
    EXPERTS: tl.constexpr = LOCAL * WORLD
    wslots = half + (WORLD * PROGRAMS + 1) // 2 * 2
    pslots = wslots + (WORLD * MAX_T * K + 1) // 2 * 2
    jj = tl.arange(0, BLOCK_K)
    ww = tl.arange(0, BLOCK_W)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < HW
    if SEND:
        if live:
            wl.sign(sig, epoch, fp, heap)
        if c == 0:  # my tokens' weights, to the ranks of their experts
            for t in range(lane, tl.where(live, tokens, 0), LANES):
                e = valid_experts(tl.load(topk + t * K + jj, mask=jj < K, other=-1), jj < K, EXPERTS)
                dest = tl.where(e >= 0, e // LOCAL, -1)
                wt = wl.pack_ll(tl.load(weights + t * K + jj, mask=jj < K, other=0.0).to(tl.int32, bitcast=True),
                                epoch)
                for r in range(WORLD):
                    if tl.sum((dest == r).to(tl.int32), axis=0) > 0:
                        tl.store(wl.symm_at(wslots + (me * MAX_T + t) * K, r, heap) + jj, wt, mask=jj < K)
        if live:
            ok = wl.check_signed(sig, epoch, fp, heap, sig_err, op="ep_combine_ll")
        for s in range(tl.where(ok, WORLD, 0)):
            n_s = tl.load(src_tokens + s)
            for t in range(lane, n_s, LANES):
                flat = tl.load(src_rows + (s * MAX_T + t) * K + jj, mask=jj < K, other=-1).to(tl.int64)
                if tl.sum((flat >= 0).to(tl.int32), axis=0) > 0:
                    wt = wl.wait_ll(wslots + (s * MAX_T + t) * K + jj, flat >= 0, epoch, heap=heap, peer=s,
                                    op="ep_combine_ll weights").to(tl.float32, bitcast=True)
                    rows = tl.load(y + flat[:, None] * HW + offs[None, :], mask=(flat >= 0)[:, None] & m[None, :],
                                   other=0)
                    a, b = halves_of(rows, ELEM)
                    part = word_of(tl.sum(wt[:, None] * a, axis=0), tl.sum(wt[:, None] * b, axis=0), ELEM)
                    tl.store(wl.symm_at(pslots + (t * WORLD + me) * HW, s, heap) + offs, wl.pack_ll(part, epoch),
                             mask=m)
            tl.store(wl.symm_at(half + me * PROGRAMS + p, s, heap), wl.pack_ll(p, epoch))
    if RECV:
        if ok:
            wl.wait_ll(half + ww * PROGRAMS + p, ww < WORLD, epoch, heap=heap, op="ep_combine_ll ack")
        for t in range(lane, tl.where(ok, tokens, 0), LANES):
            e = valid_experts(tl.load(topk + t * K + jj, mask=jj < K, other=-1), jj < K, EXPERTS)
            holds = tl.max(((e[None, :] >= 0) & (e[None, :] // LOCAL == ww[:, None])).to(tl.int32), axis=1) > 0
            # The chunk of every rank's partial sum at once: one round of polls, not one per rank.
            got = wl.wait_ll(pslots + (t * WORLD + ww[:, None]) * HW + offs[None, :], holds[:, None] & m[None, :],
                             epoch, heap=heap, op="ep_combine_ll")
            a, b = halves_of(got, ELEM)
            tl.store(out + t * HW + offs, word_of(tl.sum(a, axis=0), tl.sum(b, axis=0), ELEM), mask=m)


# -- low-latency host side ----------------------------------------------------------

class LLHandle:
    """What ep_combine_ll needs of an ep_dispatch_ll: its plan and its routes (one int32 tensor: counts, then
    src_tokens (W,), then src_rows (W, max_tokens, k), each from a 16-byte boundary; the launches take the
    last two as `src` (addresses on GPUs, views under the interpreter)), filled by the dispatch's receive
    (`received`: launched). `dispatch`: the dispatch's arguments but x's data (x, topk_idx, num_experts,
    max_tokens_per_rank, fp8, its group's name), from which a traced ep_combine_ll finds the plan again (a traced
    dispatch has none)."""

    def __init__(self, plan, routes, src, dispatch, received=True):
        self.plan, self.routes, self.src, self.received, self.dispatch = plan, routes, src, received, dispatch


def _route_layout(local: int, world_size: int, max_tokens: int, k: int) -> tuple[tuple, int]:
    """A call's routes in one int32 allocation (LLHandle): where counts, src_tokens and src_rows start (each from
    a 16-byte boundary), and its words."""
    tok_at = triton.cdiv(local, 4) * 4
    at = (0, tok_at, tok_at + triton.cdiv(world_size, 4) * 4)
    return at, at[2] + world_size * max_tokens * k


def check_dispatch_ll(group, x, topk_idx, num_experts, max_tokens, fp8) -> None:
    """ep_dispatch_ll's arguments but x's token count (checked per call against max_tokens): routing shapes and
    dtypes, max_tokens_per_rank, fp8 and the hidden size it needs. The single-node and the across-nodes plans'."""
    _check_routing(group, x, topk_idx, num_experts)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens < (1 << 16):
        raise ValueError(f"max_tokens_per_rank must be an int in [1, 65536), got {max_tokens!r}")
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    if fp8 and x.shape[1] % 128:
        raise ValueError(f"fp8 needs a hidden size that is a multiple of 128 (one scale per 128 channels), "
                         f"got {x.shape[1]}")


class RecvHook:
    """The receive half of an LL call made with return_recv_hook=True: the send was launched, and calling the
    hook launches the receive (on the current stream: the send's, or one ordered after it). Call it once,
    before the next call of the same op; what the op returned is valid once it has run."""

    def __init__(self, op: str, pending: dict, receive):
        self.op, self.pending, self.receive, self.done = op, pending, receive, False
        pending[op] = self

    def __call__(self) -> None:
        if self.done:
            raise RuntimeError(f"this {self.op} receive hook has run already")
        self.done = True
        del self.pending[self.op]
        self.receive()


def _no_pending_hook(ws, op: str) -> None:
    if op in ws.ll_pending:
        raise RuntimeError(f"{op}: the receive hook of the previous call (return_recv_hook=True) has not run; call "
                           "it first (the two calls would share the buffers it reads)")


# The LL kernels' launch settings on GPUs are tuning data (weft.tuning moe.ll_launch, swept by scripts/probe_ep_ll.py):
# at most `programs` programs and `per_sm` per SM (every program waits for its peers' programs, so all must be
# resident: programs wait only on the same or lower ones of their peers, and blocks start in order, so a program
# that must wait for a place gets one once the lower ones end), chunks of `chunk_words` words (a power of two >= 32),
# `warps` warps. Under the interpreter LL_CPU (programs, chunk words, warps): tiny chunks, so that the tests' small
# rows span several.
LL_CPU = (2, 32, 4)


def _ll_units(row_words: int, max_tokens: int, programs: int, chunk_words: int) -> tuple[int, int, int]:
    """(chunk words, chunks a row, token lanes) of an LL kernel over rows of `row_words` words: chunks of
    `chunk_words` (larger where a row would need more than `programs` of them), as many lanes of tokens as fit
    `programs` whole rows of chunks; the grid is lanes x chunks."""
    chunk = max(chunk_words, triton.next_power_of_2(triton.cdiv(row_words, programs)))
    chunks = triton.cdiv(row_words, chunk)
    return chunk, chunks, min(max_tokens, programs // chunks)


class LLPlan(Plan):
    """ep_dispatch_ll / ep_combine_ll of one call signature on one group: the launches (both halves, or the send
    and the receive apart), the workspace's regions, the checks done; `dispatch` and `combine` its entry points."""

    def __init__(self, group, x, topk_idx, num_experts, max_tokens, fp8):
        super().__init__(group)
        check_dispatch_ll(group, x, topk_idx, num_experts, max_tokens, fp8)
        if x.shape[0] > max_tokens:
            raise ValueError(f"x has {x.shape[0]} tokens, more than max_tokens_per_rank={max_tokens}")
        w = group.size
        self.heap, self.fp8 = group.heap.descriptor, fp8
        self.k, self.hidden, self.dtype, self.max_tokens = topk_idx.shape[1], x.shape[1], x.dtype, max_tokens
        self.num_experts, self.local = num_experts, num_experts // w
        # What the kernels cannot take as it is gets copied per call (_rows): x, topk_idx if not contiguous (fp8
        # reads x's elements: any alignment).
        self.cols = _word_columns(x)
        self.x_ready = (x.is_contiguous() if fp8 else _rows_ready(signature(x), self.cols))
        self.ready = self.x_ready and topk_idx.is_contiguous()
        x, topk_idx = self._prepared(x, topk_idx)
        self.hw = self.cols * x.element_size() // 4  # words of a row (combine)
        self.groups = x.shape[1] // 128 if fp8 else 0
        sent_hw = x.shape[1] // 4 if fp8 else self.hw  # words of a dispatched row
        gpu = group.device.type == "cuda"
        if gpu:
            ll = tuning.value("moe.ll_launch", group.device, w)
            programs, chunk_words, warps = (min(ll["programs"], ll["per_sm"] * num_sms(group.device)),
                                            ll["chunk_words"], ll["warps"])
        else:
            programs, chunk_words, warps = LL_CPU
        d_chunk, d_chunks, d_lanes = _ll_units(sent_hw, max_tokens, programs, chunk_words)
        c_chunk, c_chunks, c_lanes = _ll_units(self.hw, max_tokens, programs, chunk_words)
        self.ws = ws = _workspace(group)
        dispatch_words = w * (num_experts + 1) + 1 + w * max_tokens * (self.k + sent_hw + self.groups)
        even = lambda n: (n + 1) // 2 * 2  # noqa: E731
        combine_words = even(w * c_lanes * c_chunks) + even(w * max_tokens * self.k) + max_tokens * w * self.hw
        for what, words in (("ep_dispatch_ll", dispatch_words), ("ep_combine_ll", combine_words)):
            if words > ws.ll_half_words:
                raise _too_big(f"{what} with max_tokens_per_rank={max_tokens}, hidden={self.hidden}, k={self.k}",
                               2 * words * 8, 2 * ws.ll_half_words * 8)
        common = dict(K=self.k, LOCAL=self.local, MAX_T=max_tokens, WORLD=w)
        # What the members must agree on (the token count of each is its own: up to max_tokens).
        agreed = dict(experts=num_experts, hidden=self.hidden, dtype=str(x.dtype).removeprefix("torch."), k=self.k,
                      max_tokens=max_tokens)
        self.combine_fp = self.sign("ep_combine_ll", **agreed)
        self.dispatch_fp = self.sign("ep_dispatch_ll", **agreed, fp8=fp8)
        blk_k = triton.next_power_of_2(self.k)
        dev = group.device
        # A call's routes in one allocation (LLHandle): counts, src_tokens, src_rows, 16-byte aligned.
        self.route_at, self.route_words = _route_layout(self.local, w, max_tokens, self.k)
        self.recv_shape = (self.local, w * max_tokens, self.hidden)
        self.recv_cols = (self.local, w * max_tokens, self.cols)  # as the kernels fill it
        self.recv_dtype = torch.float8_e4m3fn if fp8 else x.dtype
        self.scales_shape = (self.local, w * max_tokens, self.groups)
        i32 = lambda *shape: torch.empty(shape, dtype=torch.int32, device=dev)  # noqa: E731
        self.warps = warps
        # The launches by (send, receive): both (one launch) made here, the split halves when first asked for.
        self.dispatch_grid = (d_lanes * d_chunks,)
        # A launch's first arguments (compiled for their specialisation): the call's x and topk_idx, new outputs.
        self.dispatch_args = lambda x, topk_idx: (  # noqa: E731
            x if fp8 else x.view(torch.int32), topk_idx, i32(1, sent_hw), i32(1), i32(self.local),
            i32(w, max_tokens, self.k), i32(w), ws.ll_dispatch, ws.counter(0), self.heap, ws.error, x.shape[0],
            ws.ll_half_words, ws.sig_dispatch, ws.signatures.tensor, self.dispatch_fp)
        self.dispatch_constexprs = dict(
            HW=sent_hw, **common, CHUNK=d_chunk, CHUNKS=d_chunks, LANES=d_lanes, FP8=fp8, GROUPS=self.groups,
            BLOCK_K=blk_k, BLOCK_L=triton.next_power_of_2(self.local + 1),
            BLOCK_E=triton.next_power_of_2(num_experts + 1),
            BLOCK_T=32 if gpu else triton.next_power_of_2(max(1, min(max_tokens, 16))))
        self.dispatch_launches = {}
        both = self._dispatch_launch(True, True, x, topk_idx)
        # Pointer arguments as the launch takes them (Launch.address): on GPUs addresses (no view made per
        # call; the workspace's taken once here), under the interpreter tensors of the kernel's types.
        self.address = address = both.address
        self.interpreted = both.kernel is None
        self.words = (lambda t: t.view(torch.int32)) if self.interpreted else address
        self.sent = address if fp8 else self.words  # x: its elements (quantized on the way) or its words
        self.dispatch_fixed = tuple(map(address, (ws.ll_dispatch, ws.counter(0), self.heap, ws.error)))
        self.combine_fixed = tuple(map(address, (ws.ll_combine, ws.counter(1), self.heap)))
        self.dispatch_sig = tuple(map(address, (ws.sig_dispatch, ws.signatures.tensor)))
        self.combine_sig = tuple(map(address, (ws.sig_combine, ws.signatures.tensor)))
        self.combine_launches = {}
        self.combine_grid = (c_lanes * c_chunks,)
        self.combine_constexprs = dict(HW=self.hw, **common, CHUNK=c_chunk, CHUNKS=c_chunks, LANES=c_lanes,
                                       ELEM=_ELEM[self.dtype], BLOCK_K=blk_k, BLOCK_W=triton.next_power_of_2(w))

    def _launch(self, launches: dict, kernel, grid, constexprs: dict, key, first) -> Launch:
        """The launch of `kernel` cached in `launches` under key = (..., send, receive), made (compiled for the
        specialisation of `first()`, the arguments of its first call) when missing."""
        launch = launches.get(key)
        if launch is None:
            launch = launches[key] = Launch(kernel, grid, first(), dict(constexprs, SEND=key[-2], RECV=key[-1]),
                                            self.warps)
        return launch

    def _dispatch_launch(self, send: bool, receive: bool, x, topk_idx) -> Launch:
        return self._launch(self.dispatch_launches, ep_dispatch_ll_kernel, self.dispatch_grid,
                            self.dispatch_constexprs, (send, receive), lambda: self.dispatch_args(x, topk_idx))

    def _combine_launch(self, key, send: bool, receive: bool, first) -> Launch:
        return self._launch(self.combine_launches, ep_combine_ll_kernel, self.combine_grid, self.combine_constexprs,
                            (key, send, receive), first)

    def _prepared(self, x, topk_idx):
        """The call's x and topk_idx as the kernels take them (_rows_ready; contiguous)."""
        if self.ready:
            return x, topk_idx
        return (x if self.x_ready else (x.contiguous() if self.fp8 else _rows(x, self.cols))), topk_idx.contiguous()

    def dispatch(self, x, topk_idx, hook: bool):
        dispatch = (x, topk_idx, self.num_experts, self.max_tokens, self.fp8, self.group.name)
        dev, ws, a = x.device, self.ws, self.address
        ws.raise_routing_error()
        _no_pending_hook(ws, "ep_dispatch_ll")
        x, topk_idx = self._prepared(x, topk_idx)
        recv = torch.empty(self.recv_cols, dtype=self.recv_dtype, device=dev)
        scales = torch.empty(self.scales_shape, dtype=torch.float32, device=dev) if self.fp8 else None
        routes = torch.empty(self.route_words, dtype=torch.int32, device=dev)
        counts = routes[:self.local]
        src = self._src(routes)
        args = (self.sent(x), a(topk_idx), self.words(recv), a(counts) if scales is None else self.words(scales),
                a(counts), *src, *self.dispatch_fixed, x.shape[0], self.ws.ll_half_words, *self.dispatch_sig,
                self.dispatch_fp)
        if self.cols != self.hidden:
            recv = recv[..., :self.hidden]  # rows of an odd length travelled with one more column
        if not hook:
            self._dispatch_launch(True, True, x, topk_idx)(*args)
            ws.raise_routing_error()
            ws.signatures.raise_recorded()
            return recv, counts, scales, LLHandle(self, routes, src, dispatch)
        self._dispatch_launch(True, False, x, topk_idx)(*args)
        handle = LLHandle(self, routes, src, dispatch, received=False)
        receive_launch = self._dispatch_launch(False, True, x, topk_idx)

        def receive():
            receive_launch(*args)
            ws.raise_routing_error()
            ws.signatures.raise_recorded()
            handle.received = True

        return recv, counts, scales, handle, RecvHook("ep_dispatch_ll", ws.ll_pending, receive)

    def _src(self, routes, views: bool = False) -> tuple:
        """(src_rows, src_tokens) of a routes tensor as the launches take them (views when asked)."""
        _, tok, rows = self.route_at
        if views or self.interpreted:
            w = self.group.size
            return routes[rows:].view(w, self.max_tokens, self.k), routes[tok:tok + w]
        base = routes.data_ptr()
        return base + 4 * rows, base + 4 * tok

    def combine(self, y, topk_idx, topk_weights, handle, hook: bool):
        ws = self.ws
        ws.raise_routing_error()
        _no_pending_hook(ws, "ep_combine_ll")
        if not handle.received:
            raise RuntimeError("ep_combine_ll: the handle's dispatch has not received yet (run its receive hook)")
        tokens = topk_idx.shape[0]
        key = (signature(y), signature(topk_idx), signature(topk_weights))
        if not _rows_ready(key[0], self.cols):  # y's rows in whole words, aligned to them
            y = _rows(y, self.cols)
        if not (key[1][3] and key[2][3]):
            topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        out = torch.empty((tokens, self.cols), dtype=self.dtype, device=y.device)
        # A new launch's first arguments (compiled for their specialisation), made only then.
        first = lambda: (y.view(torch.int32), topk_idx, topk_weights, out.view(torch.int32),  # noqa: E731
                         *self._src(handle.routes, views=True), ws.ll_combine, ws.counter(1), self.heap, tokens,
                         ws.ll_half_words, ws.sig_combine, ws.signatures.tensor, self.combine_fp)
        a = self.address
        args = (self.words(y), a(topk_idx), a(topk_weights), self.words(out), *handle.src, *self.combine_fixed,
                tokens, ws.ll_half_words, *self.combine_sig, self.combine_fp)
        # rows of an odd length travelled with one more column
        result = out if self.cols == self.hidden else out[:, :self.hidden]
        if not hook:
            self._combine_launch(key, True, True, first)(*args)
            ws.signatures.raise_recorded()
            return result
        self._combine_launch(key, True, False, first)(*args)
        ws.signatures.raise_recorded()
        receive = self._combine_launch(key, False, True, first)
        return result, RecvHook("ep_combine_ll", ws.ll_pending, lambda: receive(*args))


@declare_op(collective=True)
def ep_dispatch_ll(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, max_tokens_per_rank: int,
                   fp8: bool = False, return_recv_hook: bool = False, group=None) -> tuple:
    """Low-latency dispatch (decode) over `group` (default: the world; W its size, experts split contiguously
    over its ranks): one launch, no host sync, capturable in a CUDA graph.

    x (T, hidden) bf16/fp16/fp32 with T <= max_tokens_per_rank; topk_idx (T, k) (-1: no expert); any layout and
    hidden size (a 16-bit row of odd length travels with a zero column more: recv is then a view).
    Returns (recv (L, max_tokens_per_rank * W, hidden): rows [0, counts[e]) of recv[e] are the tokens of
    local expert e, ordered by source rank then source token; counts (L,) int32; scales; handle for
    ep_combine_ll). fp8=False: recv has x's dtype and scales is None. fp8=True (hidden a multiple of 128):
    tokens travel as float8_e4m3fn, recv is float8_e4m3fn and scales (L, max_tokens_per_rank * W,
    hidden / 128) fp32 holds one scale per 128 channels (x ~ recv * scale; scale = amax / 448).
    Collective over the group: every member passes the same num_experts and max_tokens_per_rank (a peer's token
    count or row past this rank's call is dropped and raised here as a ValueError naming that peer).

    topk_idx's values are checked on the device, with no host sync: a row naming an expert twice or one outside
    [0, num_experts) (and not -1) raises a ValueError naming topk_idx, the row and the expert at the next EP
    op's call on this rank once the kernel has run (under the interpreter: this call, after the collective
    launch, so every rank stays in step). Until then the row does no harm: entries outside the experts count
    as none, and an expert named twice gets the token once (combine returns it once per naming). A raise on
    entry skips that collective call on this rank while its peers wait in theirs: a bug to fix, not a path.

    return_recv_hook=True: the call launches only the send (which waits for nothing) and returns a fifth
    value, a RecvHook; calling it launches the receive, after which the outputs hold the tokens. Work queued
    between the two runs while the tokens travel. Run the hook once, before the next ep_dispatch_ll.
    """
    if not isinstance(return_recv_hook, bool):
        raise TypeError(f"return_recv_hook must be a bool, got {type(return_recv_hook).__name__}")
    g = resolve(group)
    if g.topology.spans_nodes:  # the network to the target node, then NVLink: ep_nodes
        return ep_nodes.ep_dispatch_ll(g, x, topk_idx, num_experts, max_tokens_per_rank, fp8, return_recv_hook)
    found = _plan(g, x, topk_idx, num_experts, max_tokens_per_rank, fp8)
    return found.dispatch(x, topk_idx, return_recv_hook)


def _plan(group, x, topk_idx, num_experts, max_tokens_per_rank, fp8) -> LLPlan:
    return plan(group, lambda: ("ep_ll", signature(x), signature(topk_idx), num_experts, max_tokens_per_rank, fp8),
                lambda: LLPlan(group, x, topk_idx, num_experts, max_tokens_per_rank, fp8))


@declare_op(collective=True)
def ep_combine_ll(y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LLHandle,
                  return_recv_hook: bool = False, group=None) -> torch.Tensor | tuple:
    """Low-latency combine: out (T, hidden) = sum_j topk_weights[t, j] * (expert topk_idx[t, j]'s output for
    token t), where y (L, max_tokens_per_rank * W, hidden) holds each rank's expert outputs in recv's rows:
    each rank sums its experts' weighted outputs of a token (fp32, rounded to y's dtype) and sends that one
    row back, where the ranks' rows are summed (fp32). One launch, no host sync. Collective over the dispatch's
    group (`group`: default that one; another raises).

    return_recv_hook=True: returns (out, hook); the call launches the send (which waits only for its peers'
    weights, sent first thing by their calls), the hook the receive, after which out holds the sums. Run the
    hook once, before the next ep_combine_ll."""
    if not isinstance(return_recv_hook, bool):
        raise TypeError(f"return_recv_hook must be a bool, got {type(return_recv_hook).__name__}")
    if isinstance(handle, ep_nodes.NodesHandle):  # a dispatch across nodes
        return ep_nodes.ep_combine_ll(y, topk_idx, topk_weights, handle, return_recv_hook, group)
    g = handle_group(handle, group, LLHandle, "ep_dispatch_ll")
    p = handle.plan
    check_tensor("y", y, g, dtypes=(p.dtype,), contiguous=False)
    if tuple(y.shape) != p.recv_shape:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {p.recv_shape} (recv's)")
    check_tensor("topk_idx", topk_idx, g, dtypes=INDEX_DTYPES, contiguous=False)
    check_tensor("topk_weights", topk_weights, g, dtypes=(torch.float32,), contiguous=False)
    if topk_idx.dim() != 2 or topk_idx.shape[1] != p.k or topk_idx.shape[0] > p.max_tokens:
        raise ValueError(f"topk_idx must be (tokens <= {p.max_tokens}, {p.k}), got {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected {tuple(topk_idx.shape)}")
    return p.combine(y, topk_idx, topk_weights, handle, return_recv_hook)


# -- the operators (inference) ---------------------------------------------------------------------------------
#   torch.ops.weft.ep_dispatch_ll(x, topk_idx, num_experts, max_tokens_per_rank, group_name, fp8)
#       -> (recv, counts, scales (an empty (0,) without fp8), routes)
#   torch.ops.weft.ep_combine_ll(y, topk_idx, topk_weights, routes, x, dispatch_topk_idx, num_experts,
#                                max_tokens_per_rank, group_name, fp8) -> (T, hidden)
# As for ep_combine (ep_ht): the combine takes the handle's routes and the dispatch's arguments, from whose
# signature it finds the dispatch's plan. return_recv_hook=True returns a Python callable: not traceable.

def _no_hook(return_recv_hook) -> None:
    if return_recv_hook:
        raise TypeError("return_recv_hook=True cannot be traced or differentiated: the hook is a Python callable "
                        "(call the op eagerly, or capture it in a CUDA graph)")


@ep_dispatch_ll.define
def ep_dispatch_ll_op(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, max_tokens_per_rank: int,
                      group_name: str, fp8: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ep_nodes.eager_only(group_name, "ep_dispatch_ll")
    recv, counts, scales, handle = ep_dispatch_ll.eager(x, topk_idx, num_experts, max_tokens_per_rank, fp8,
                                                        group=group_name)
    if scales is None:
        scales = x.new_empty((0,), dtype=torch.float32)
    return recv.contiguous(), counts.clone(), scales, handle.routes


@ep_dispatch_ll_op.register_fake
def _(x, topk_idx, num_experts, max_tokens_per_rank, group_name, fp8=False):
    world_size = group_size(group_name)
    local, hidden = num_experts // world_size, x.shape[1]
    rows = world_size * max_tokens_per_rank
    scales = (local, rows, hidden // 128) if fp8 else (0,)  # a scale per 128 channels
    return (x.new_empty((local, rows, hidden), dtype=torch.float8_e4m3fn if fp8 else x.dtype),
            x.new_empty((local,), dtype=torch.int32), x.new_empty(scales, dtype=torch.float32),
            x.new_empty((_route_layout(local, world_size, max_tokens_per_rank, topk_idx.shape[1])[1],),
                        dtype=torch.int32))


@ep_dispatch_ll.traced
def _(x, topk_idx, num_experts, max_tokens_per_rank, fp8=False, return_recv_hook=False, group=None):
    _no_hook(return_recv_hook)
    name = group_name(group)
    recv, counts, scales, routes = torch.ops.weft.ep_dispatch_ll(x, topk_idx, num_experts, max_tokens_per_rank,
                                                                 name, fp8)
    handle = LLHandle(None, routes, None, (x, topk_idx, num_experts, max_tokens_per_rank, fp8, name))
    return recv, counts, scales if fp8 else None, handle


@ep_combine_ll.define
def ep_combine_ll_op(y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, routes: torch.Tensor,
                     x: torch.Tensor, dispatch_topk_idx: torch.Tensor, num_experts: int, max_tokens_per_rank: int,
                     group_name: str, fp8: bool = False) -> torch.Tensor:
    ep_nodes.eager_only(group_name, "ep_combine_ll")
    found = _plan(resolve(group_name), x, dispatch_topk_idx, num_experts, max_tokens_per_rank, fp8)
    handle = LLHandle(found, routes, found._src(routes),
                      (x, dispatch_topk_idx, num_experts, max_tokens_per_rank, fp8, group_name))
    return ep_combine_ll.eager(y, topk_idx, topk_weights, handle).contiguous()


@ep_combine_ll_op.register_fake
def _(y, topk_idx, topk_weights, routes, x, dispatch_topk_idx, num_experts, max_tokens_per_rank, group_name,
      fp8=False):
    return y.new_empty((topk_idx.shape[0], y.shape[2]))


@ep_combine_ll.traced
def _(y, topk_idx, topk_weights, handle, return_recv_hook=False, group=None):
    _no_hook(return_recv_hook)
    if not isinstance(handle, LLHandle):
        raise TypeError(f"handle must be what ep_dispatch_ll returned, got {type(handle).__name__}")
    x, dispatch_topk_idx, num_experts, max_tokens_per_rank, fp8, name = handle.dispatch
    if group is not None and group_name(group) != name:
        raise ValueError(f"group is {group_name(group)!r}, but the handle's dispatch ran over group {name!r}")
    return torch.ops.weft.ep_combine_ll(y, topk_idx, topk_weights, handle.routes, x, dispatch_topk_idx, num_experts,
                                        max_tokens_per_rank, name, fp8)


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    (ep_dispatch_ll_kernel, dict(x=xt, topk=t, recv="*i32", scales="*i32", counts="*i32", src_rows="*i32",
                                 src_tokens="*i32", buf="*i64", counter="*i64", heap="*i64", err="*i64", tokens="i32",
                                 half_words="i32", sig="*i64", sig_err="*i64", fp="i32"),
     dict(HW=3584 // (1 + fp8), K=8, LOCAL=local, MAX_T=128, WORLD=wd, CHUNK=512, CHUNKS=4 if fp8 else 7,
          LANES=33 if fp8 else 18, FP8=fp8, GROUPS=56 * fp8, BLOCK_K=8,
          BLOCK_L=triton.next_power_of_2(local + 1), BLOCK_E=512, BLOCK_T=32, SEND=send, RECV=receive),
     dict(num_warps=8, **({"min_arch": 89} if fp8 else {})))  # fp8 e4m3 needs sm_89 or later
    for t in ("*i64", "*i32") for wd, local in ((2, 128), (8, 32))
    for fp8, xt in ((False, "*i32"), (True, "*bf16"), (True, "*fp16"))
    for send, receive in (((True, True), (True, False), (False, True)) if t == "*i64" and wd == 8 else ((True, True),))
] + [
    (ep_combine_ll_kernel, dict(y="*i32", topk=t, weights="*fp32", out="*i32", src_rows="*i32", src_tokens="*i32",
                                buf="*i64", counter="*i64", heap="*i64", tokens="i32", half_words="i32", sig="*i64",
                                sig_err="*i64", fp="i32"),
     dict(HW=3584, K=8, LOCAL=32, MAX_T=128, WORLD=8, CHUNK=512, CHUNKS=7, LANES=18, ELEM=e, BLOCK_K=8, BLOCK_W=8,
          SEND=send, RECV=receive), dict(num_warps=8))
    for t in ("*i64", "*i32") for e in (tl.bfloat16, tl.float16, tl.float32)
    for send, receive in (((True, True), (True, False), (False, True)) if t == "*i64" and e != tl.float32
                          else ((True, True),))
]
