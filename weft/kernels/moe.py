"""Mixture-of-experts through the symmetric heap: routing layout, expert-parallel dispatch and combine.

Experts are split contiguously over ranks: rank r owns experts [r * L, (r + 1) * L), L = E / W.
`topk_idx` (tokens x k) names each token's experts (-1: none); a row must not name an expert twice. The
dispatch kernels check the rows on the device as they read them (no host sync): a bad row is recorded in the
workspace's error word and raised as a ValueError by the next EP op on that rank (see blocks.check_rows,
RoutingErrorWord, which the tensor-parallel MoE ops share, and MoeWorkspace); check_routing_values is the same
check on the host, for other uses.

routing_layout: per-rank and per-expert token counts and each token's slot per destination rank, with torch
ops on the device (no host sync).

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

Buffers are double-buffered by call parity, one epoch counter per kernel (each takes `wl.next_epoch` once
per call): a sender writes half e % 2 of rank q in call e only after its own call e - 1 ended, in which it
waited for a word every program of q wrote in q's call e - 1, after q's call e - 2 (the last reader of the
half) had ended. LL regions are only ever written with LL words, so a stale word carries an older epoch.

The grouped GEMM that runs the experts between dispatch and combine is weft/kernels/grouped_gemm.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import weft.language as wl

from .blocks import check_rows, copy, fp8_quantize, halves_of, valid_experts, word_of
from .common import Launch, check_tensor, plan, signature, workspace, world_or_raise, zero_everywhere
from .gemm import num_sms

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int64, torch.int32)


# -- routing layout -----------------------------------------------------------------

class Layout:
    """Where this rank's tokens go, from topk_idx (T, k) on the device:
    to_rank (T, W) int32 0/1: the token goes to rank r; tokens_per_rank (W,) int32;
    tokens_per_expert (E,) int32; rank_pos (T, W) int32: the token's position among this rank's tokens
    to rank r, -1 where it does not go there."""

    def __init__(self, topk_idx: torch.Tensor, num_experts: int, world_size: int):
        t, dev = topk_idx.shape[0], topk_idx.device
        local = num_experts // world_size
        idx = topk_idx.long()
        valid = idx >= 0
        ranks = torch.where(valid, idx // local, world_size)  # world_size: nowhere
        hit = torch.zeros((t, world_size + 1), dtype=torch.int32, device=dev).scatter_(1, ranks, 1)
        self.to_rank = hit[:, :world_size]
        self.tokens_per_rank = self.to_rank.sum(0, dtype=torch.int32)
        self.rank_pos = torch.where(self.to_rank > 0, self.to_rank.cumsum(0, dtype=torch.int32) - 1, -1)
        experts = torch.where(valid, idx, num_experts).reshape(-1)
        ones = torch.ones_like(experts, dtype=torch.int32)
        self.tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev).scatter_add_(
            0, experts, ones)[:num_experts]


def routing_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int | None = None) -> Layout:
    """The routing layout of `topk_idx` over `world_size` ranks (default: the world's), on the device."""
    if world_size is None:
        world_size = world_or_raise().world_size
    _check_experts(num_experts, world_size)
    return Layout(topk_idx, num_experts, world_size)


# -- the router ---------------------------------------------------------------------

@triton.jit
def router_topk_kernel(logits, idx, weights, tokens, experts, K: tl.constexpr, NORM: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """For BLOCK_T tokens' rows of logits: the K largest softmax probabilities (fp32) and their experts, largest
    first, chosen on the logits themselves (softmax keeps their order: the same experts as torch.topk of the
    probabilities, a tie to the lower index); NORM: the K weights divided by their sum. One pass where torch
    runs softmax, topk (with its sort) and the division: ~20 us at decode and ~70 at 8192 tokens on an H200."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    jj = tl.arange(0, BLOCK_K)
    live = (t[:, None] < tokens) & (e[None, :] < experts)
    x = tl.load(logits + t.to(tl.int64)[:, None] * experts + e[None, :], mask=live, other=float("-inf"))
    x = tl.where(live, x.to(tl.float32), float("-inf"))
    top = tl.max(x, axis=1)
    total = tl.sum(tl.where(live, tl.exp(x - top[:, None]), 0.0), axis=1)
    chosen = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    probs = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for j in tl.static_range(K):
        best = tl.max(x, axis=1)
        pick = tl.min(tl.where(x == best[:, None], e[None, :], BLOCK_E), axis=1)
        chosen = tl.where(jj[None, :] == j, pick[:, None], chosen)
        probs = tl.where(jj[None, :] == j, (tl.exp(best - top) / total)[:, None], probs)
        x = tl.where(e[None, :] == pick[:, None], float("-inf"), x)
    if NORM:
        probs = probs / tl.sum(probs, axis=1)[:, None]
    out = t.to(tl.int64)[:, None] * K + jj[None, :]
    mask = (t[:, None] < tokens) & (jj[None, :] < K)
    tl.store(idx + out, chosen.to(tl.int64), mask=mask)
    tl.store(weights + out, probs, mask=mask)


def router_topk(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE router's choice from its logits (T, E) (bf16 / fp16 / fp32): (topk_idx (T, k) int64, topk_weights
    (T, k) fp32), the k largest of softmax(logits) in fp32, largest first, divided by their sum when
    `renormalize` (Qwen3-MoE's norm_topk_prob; Mixtral's always) -- what torch's softmax, topk and division give
    (router_topk_torch), the experts the same, the weights within a few ulps (exp differs), in one launch."""
    world = world_or_raise()
    found = plan(world, lambda: ("router_topk", signature(logits), k, renormalize),
                 lambda: _RouterPlan(world, logits, k, renormalize))
    return found(logits)


def router_topk_torch(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk in torch's own ops (for traced calls, and the baselines)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, idx = torch.topk(probs, k, dim=-1)
    return idx, (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights)


class _RouterPlan:
    def __init__(self, world, logits, k, renormalize):
        check_tensor("logits", logits, world, dtypes=DTYPES, contiguous=False)
        if logits.dim() != 2:
            raise ValueError(f"logits must be (tokens, experts), got shape {tuple(logits.shape)}")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= logits.shape[1]:
            raise ValueError(f"k must be an int in [1, {logits.shape[1]}] (the experts), got {k!r}")
        if not isinstance(renormalize, bool):
            raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
        self.tokens, self.experts, self.k = logits.shape[0], logits.shape[1], k
        self.contiguous = logits.is_contiguous()
        block_e = triton.next_power_of_2(self.experts)
        block_t = max(1, min(triton.next_power_of_2(max(self.tokens, 1)), 2048 // block_e))
        idx, weights = self._outputs(logits.device)
        self.launch = None if self.tokens == 0 else Launch(
            router_topk_kernel, (triton.cdiv(self.tokens, block_t),),
            (logits.contiguous(), idx, weights, self.tokens, self.experts),
            dict(K=k, NORM=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k)), 4)

    def _outputs(self, dev):
        return (torch.empty((self.tokens, self.k), dtype=torch.int64, device=dev),
                torch.empty((self.tokens, self.k), dtype=torch.float32, device=dev))

    def __call__(self, logits):
        idx, weights = self._outputs(logits.device)
        if self.launch is not None:
            a = self.launch.address
            self.launch(a(logits if self.contiguous else logits.contiguous()), a(idx), a(weights), self.tokens,
                        self.experts)
        return idx, weights


# -- checks -------------------------------------------------------------------------

def _check_experts(num_experts, world_size: int) -> None:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % world_size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the world size ({world_size}): "
                         "experts are split contiguously over ranks")


def _check_routing(world, x, topk_idx, num_experts, topk_weights=None):
    """Shapes and dtypes of a dispatch's arguments (no values: those need a host sync). Any layout: the plans copy
    what the kernels cannot take as it is (_rows)."""
    check_tensor("x", x, world, dtypes=DTYPES, contiguous=False)
    check_tensor("topk_idx", topk_idx, world, dtypes=INDEX_DTYPES, contiguous=False)
    _check_experts(num_experts, world.world_size)
    if x.dim() != 2:
        raise ValueError(f"x must be (tokens, hidden), got shape {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or not 1 <= topk_idx.shape[1] <= num_experts:
        raise ValueError(f"topk_idx must be (tokens, k) with tokens = {x.shape[0]} and 1 <= k <= num_experts, "
                         f"got shape {tuple(topk_idx.shape)}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, world, dtypes=(torch.float32,), contiguous=False)
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected "
                             f"{tuple(topk_idx.shape)} (that of topk_idx)")


def check_routing_values(topk_idx: torch.Tensor, num_experts: int) -> None:
    """ValueError unless every entry of topk_idx is -1 or an expert in [0, num_experts), and no row names an
    expert twice. Reads the values: host syncs. (The EP and tensor-parallel MoE ops check on the device
    instead, with no sync: blocks.check_rows.)"""
    if topk_idx.numel() == 0:
        return
    if bool(((topk_idx < -1) | (topk_idx >= num_experts)).any()):
        raise ValueError(f"topk_idx holds an expert outside [0, {num_experts}) (and not -1)")
    srt = topk_idx.sort(dim=1).values
    if bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()):
        raise ValueError("topk_idx names the same expert twice in a row: each token's experts must differ")


def _word_columns(t: torch.Tensor) -> int:
    """Columns of t's rows as the kernels move them, in whole 4-byte words: 16-bit rows of an odd length get one
    more (a zero column, cut off again in what the ops return)."""
    return t.shape[-1] + (t.shape[-1] * t.element_size()) % 4 // 2


def _rows_ready(sig: tuple, cols: int) -> bool:
    """Whether a tensor of signature `sig` (common.signature) goes to the kernels as it is: contiguous, 4-byte
    aligned (its rows are int32 words), `cols` columns."""
    shape, _, _, contiguous, misalign = sig
    # An empty view says nothing of its offset in data_ptr (a copy of nothing is free).
    return contiguous and misalign % 4 == 0 and shape[-1] == cols and shape.numel() > 0


def _rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t as the kernels take it (see _rows_ready): a contiguous copy, with a zero column where `cols` has one more."""
    if cols == t.shape[-1]:
        return t.clone(memory_format=torch.contiguous_format)
    out = t.new_zeros((*t.shape[:-1], cols))
    out[..., :t.shape[-1]] = t
    return out


# -- the family's workspace ---------------------------------------------------------

# Programs of the high-throughput push (a fixed number: the receivers wait on the flags of each), and each
# program's block of words and warps on GPUs.
HT_PROGRAMS = {"cpu": 2, "cuda": 128}
HT_MAX_PROGRAMS = 1024  # the workspace's push flags: [program][rank] (scripts/probe_ep_ht.py sweeps HT_PROGRAMS)
# Measured (scripts/probe_ep_ht.py, 2 H200s, 2026-11-23, 4096 tokens of 7168, top-8 of 256, graph replay):
# dispatch + combine 839.7 / 737.1 / 695.3 / 750.7 / 747.4 us with blocks of 1024 / 2048 / 4096 / 4096 / 2048
# words and 8 / 8 / 8 / 16 / 4 warps (128 push programs); since the receivers wait on all flags at once
# (eleventh session) 489.3 us with 4096 words, 8 warps, 128 programs; 494.5 with 264 programs, 503.4 with 2048
# words and 264, 483.6 with 16 warps and 132, 526.7 with 2048 words, 4 warps, 528 programs.
HT_BLOCK_WARPS = (4096, 8)
# Programs of the receiving kernels (ep_receive_kernel copies the region's rows out, ep_combine_reduce_kernel sums
# each token's rows): local passes after the pushes, swept by scripts/probe_ep_ht.py too.
HT_COPY_PROGRAMS = {"cpu": 2, "cuda": 132}
# Tokens a program of the count and position kernels takes (the route kernel, one program, then only scans
# the blocks' counts: over all 4096 tokens itself it took 79 us of a 400 us dispatch).
HT_ROUTE_TOKENS = {"cpu": 16, "cuda": 64}


class RoutingErrorWord:
    """An error word where kernels record a bad topk_idx row (blocks.check_rows), read by the host with no
    sync: on GPUs pinned host memory, which the kernels store to through its address (unified addressing maps
    it for the device), so a recorded row shows up once the kernel has run; on the cpu backend a word of this
    rank's heap (made in the same order on every rank). Made zero. `tensor`: what the kernels take."""

    def __init__(self, world):
        if world.device.type == "cuda":
            self.tensor = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        else:
            self.tensor = world.heap.empty((1,), torch.int64).zero_()
        self.host = self.tensor.numpy()  # the host's view: a read is a load, no torch op

    def raise_recorded(self) -> None:
        """The ValueError naming topk_idx, the row and the expert for a bad row recorded since the last one
        raised, if any. The word is cleared as it is raised: the next valid call works."""
        word = int(self.host[0])
        if word:
            self.host[0] = 0
            raise _routing_error(word)


def _routing_error(word: int) -> ValueError:
    """The ValueError of a recorded error word (blocks.ERROR_SET | row << 33 | kind << 32 | expert)."""
    row, outside, expert = (word >> 33) & ((1 << 28) - 1), (word >> 32) & 1, word & 0xFFFFFFFF
    expert -= (expert >> 31) << 32
    if outside:
        return ValueError(f"topk_idx row {row} holds {expert}: an expert outside [0, num_experts) (and not -1)")
    return ValueError(f"topk_idx row {row} names expert {expert} twice: each token's experts must differ")


class MoeWorkspace:
    """The MoE family's symmetric workspace, made once whatever the call sizes: the LL dispatch and LL combine
    regions (int64 LL words, zeroed: epoch 0 is never awaited; 3/8 of workspace_bytes each), the
    high-throughput receive region (1/4), each in two halves; the count table's LL words, the push flags
    [program][rank], and one epoch counter per kernel; the LL ops' receive hooks not yet run.

    And the error word (a RoutingErrorWord), where the kernels record a bad topk_idx row (check_rows): every
    EP op raises it on entry (and dispatches again after their launches: under the interpreter, kernels have
    run by then, so the call that passed the row raises)."""

    def __init__(self, world):
        heap, w = world.heap, world.world_size
        total = world.workspace_bytes // 4096 * 4096
        self.ll_half_words = total * 3 // 8 // 16  # a multiple of 32 words, as the LL kernels assume
        self.ll_dispatch = heap.empty((2 * self.ll_half_words,), torch.int64)
        self.ll_combine = heap.empty((2 * self.ll_half_words,), torch.int64)
        self.ht_half_words = total // 4 // 8
        self.ht = heap.empty((2 * self.ht_half_words,), torch.int32)
        self.table = heap.empty((2 * w * (w + 1),), torch.int64)  # [sender][tokens to each rank | bad rows]
        self.flags = heap.empty((HT_MAX_PROGRAMS * w,), torch.int32)
        self.counters = heap.empty((5,), torch.int64)  # ll dispatch, ll combine, count exchange, push, wait
        self.ll_pending = {}  # LL op -> its RecvHook not yet run
        self.errors = RoutingErrorWord(world)
        self.error = self.errors.tensor
        zero_everywhere(world, self.ll_dispatch, self.ll_combine, self.table, self.flags, self.counters)

    def raise_routing_error(self) -> None:
        self.errors.raise_recorded()

    def counter(self, i: int) -> torch.Tensor:
        return self.counters[i:i + 1]


def _workspace(world) -> MoeWorkspace:
    return workspace(world, "moe", MoeWorkspace)


def _too_big(what: str, need: int, have: int) -> ValueError:
    return ValueError(f"{what} needs {need} bytes of the MoE workspace, which has {have} (workspace_bytes: set "
                      "WEFT_WORKSPACE_BYTES or weft.init(workspace_bytes=...) larger)")


# -- routing checks on the device ---------------------------------------------------
# A bad topk_idx row (an expert named twice, or outside [0, E) and not -1) is found by the kernels that read
# the rows, not by a host sync: they read an entry outside [0, E) as -1 (no expert), count a token once per
# expert or rank however often its row names it (so a repeat lands on one row and never past a buffer), and
# record the row in the workspace's error word (blocks.check_rows; RoutingErrorWord).

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


@triton.jit
def ep_route_kernel(block_counts, block_start, table, counts, info, buf, counter, heap, blocks,
                    LOCAL: tl.constexpr, WORLD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
                    BLOCK_L: tl.constexpr):
    """In one program, from the token blocks' counts (ep_count_kernel): block_start[b, r] = the position of
    block b's first token to rank r among my tokens to r; then every rank's [tokens to each rank | bad rows]
    to every rank as LL words, so each holds table[s, r] = tokens rank s sends to rank r with no host round
    trip, and info = [most rows any rank receives, rows I receive, bad rows anywhere]. Zeroes counts
    (ep_receive_kernel counts into them)."""
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
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
    for q in range(WORLD):
        tl.store(wl.symm_at(half + me * (WORLD + 1), q, heap) + ww, row, mask=ww <= WORLD)
    total = tl.zeros([BLOCK_W], tl.int32)
    for s in range(WORLD):
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
def ep_push_kernel(x, topk, weights, rank_pos, table, region, x_out, idx_out, w_out, flags, counter, heap, tokens,
                   limit, half_words,
                   HW: tl.constexpr, K: tl.constexpr, ROW: tl.constexpr, LOCAL: tl.constexpr, WORLD: tl.constexpr,
                   PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    """Token i of x (HW int32 words a row) to every rank r it goes to, at row rank_pos[i, r] + (rows of ranks
    s < me) of r's region (half epoch % 2), rows from `limit` on dropped: [x | its experts as r's local
    indices (-1: not r's) | topk weights' bits], ROW words; then flag [p][me] on every rank. Program p pushes
    tokens p, p + PROGRAMS, ... A token to myself goes straight to its row of x_out, idx_out and w_out (what
    ep_receive_kernel makes of the region's rows), not through my region."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    half = region + (epoch % 2) * half_words
    ww = tl.arange(0, BLOCK_W)
    jj = tl.arange(0, BLOCK_K)
    start = _rows_before_mine(table, me, WORLD, BLOCK_W)
    for i in range(p, tokens, PROGRAMS):
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
    wl.notify_all(flags + p * WORLD + me, heap, epoch)


@triton.jit(do_not_specialize=["rows", "half_words"])
def ep_push_back_kernel(y, table, region, flags, counter, heap, rows, half_words, HW: tl.constexpr,
                        WORLD: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    """Received row i of y (HW int32 words) back to its source s, at the row s numbered it by (its rows for
    ranks r < me, then its position among those it sent me), in s's region; then flag [p][me] on every rank.
    Rows of my own tokens stay in y, where ep_combine_reduce_kernel reads them."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    half = region + (epoch % 2) * half_words
    s = tl.arange(0, BLOCK_W)
    got = tl.load(table + s * WORLD + me, mask=s < WORLD, other=0)  # rows from each source, in source order
    ends = tl.cumsum(got, axis=0)
    r = tl.arange(0, BLOCK_W)[None, :]
    sent_before = tl.sum(tl.load(table + s[:, None] * WORLD + r, mask=(s[:, None] < WORLD) & (r < me), other=0),
                         axis=1)  # for each source: its rows for ranks r < me
    n = tl.minimum(tl.sum(got, axis=0), rows)
    for i in range(p, n, PROGRAMS):
        src = tl.sum((ends <= i).to(tl.int32), axis=0)
        if src != me:
            slot = tl.sum(tl.where(s == src, sent_before + i - (ends - got), 0), axis=0).to(tl.int64)
            copy(wl.symm_at(half + slot * HW, src, heap), y + i * HW, 0, HW, BLOCK, VEC)
    wl.notify_all(flags + p * WORLD + me, heap, epoch)


@triton.jit
def _wait_pushes(region, flags, counter, heap, half_words, WORLD: tl.constexpr, PROGRAMS: tl.constexpr):
    """The half of `region` this call's push wrote, once every program of every rank has flagged me."""
    epoch = wl.next_epoch(counter)
    # All PROGRAMS x WORLD flags in one wait: 32 a round trip, where a wait per program took one each.
    token = wl.wait(flags, PROGRAMS * WORLD, epoch, wl.CMP_GE, heap=heap, op="ep_dispatch/ep_combine push",
                    ranks=WORLD)
    return wl.consume_token(region + (epoch % 2) * half_words, token)


@triton.jit(do_not_specialize=["half_words", "rows"])
def ep_receive_kernel(region, flags, counter, heap, table, x_out, idx_out, w_out, counts, half_words, rows,
                      HW: tl.constexpr, K: tl.constexpr, ROW: tl.constexpr, LOCAL: tl.constexpr, WORLD: tl.constexpr,
                      PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr):
    """After the pushes: rows [0, n) of the region (n: what the table says I receive, at most `rows`) split
    into x_out (HW words a row), idx_out and w_out (K a row), but for the rows of my own tokens, which the
    push wrote there itself; rows [n, rows) zero, -1 and 0. counts[e] += the rows naming my expert e (each
    program adds its own)."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    half = _wait_pushes(region, flags, counter, heap, half_words, WORLD, PROGRAMS)
    s = tl.arange(0, BLOCK_W)
    got = tl.load(table + s * WORLD + me, mask=s < WORLD, other=0)  # rows from each source, in source order
    n = tl.minimum(tl.sum(got, axis=0), rows)
    own_lo = tl.sum(tl.where(s < me, got, 0), axis=0)
    own_hi = own_lo + tl.sum(tl.where(s == me, got, 0), axis=0)
    jj = tl.arange(0, BLOCK_K)
    ll = tl.arange(0, BLOCK_L)
    named = tl.zeros([BLOCK_L], tl.int32)
    for i in range(p, rows, tl.num_programs(0)):
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
    tl.atomic_add(counts + ll, named, mask=ll < LOCAL)


@triton.jit(do_not_specialize=["half_words", "tokens", "limit"])
def ep_combine_reduce_kernel(region, flags, counter, heap, rank_pos, table, y, out, half_words, tokens, limit,
                             HW: tl.constexpr, ELEM: tl.constexpr, WORLD: tl.constexpr, PROGRAMS: tl.constexpr,
                             BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    """After the pushes back: out[t] = sum in rank order r of the row token t came back on from r (fp32): my
    rows for ranks r' < r, then its position among them; none where the dispatch did not send or dropped it.
    The row from me is read from y (my received rows: those of ranks s < me, then mine), never pushed."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    half = _wait_pushes(region, flags, counter, heap, half_words, WORLD, PROGRAMS)
    ww = tl.arange(0, BLOCK_W)
    start = _rows_before_mine(table, me, WORLD, BLOCK_W)
    mine = tl.load(table + me * WORLD + ww, mask=ww < WORLD, other=0)
    back_start = tl.cumsum(mine, axis=0) - mine
    for t in range(p, tokens, tl.num_programs(0)):
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

_ELEM = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _vec(words: int, *tensors) -> int:
    """4 (16-byte vectors) where rows of `words` int32 words and every tensor's address allow it, else 1."""
    return 4 if words % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors) else 1


class HTHandle:
    """What ep_combine needs of an ep_dispatch: its plan, and on the device rank_pos (T, W) and table (W, W)
    (ep_position_kernel's and ep_route_kernel's), from which each row's way back is computed; rows received (R)
    and the row limit."""

    def __init__(self, plan, rank_pos, table, rows, limit):
        self.plan, self.rank_pos, self.table, self.rows, self.limit = plan, rank_pos, table, rows, limit


class _HTPlan:
    """ep_dispatch / ep_combine of one call signature: the launches, the region's rows, the checks done.

    A dispatch is five launches: count, route (with the count exchange), position, push, receive; without
    max_recv_tokens, one host sync between route and push reads info (the exact row count, and whether any rank's
    topk_idx was bad: then every rank raises before anything is pushed)."""

    def __init__(self, world, x, topk_idx, topk_weights, num_experts, max_recv_tokens):
        _check_routing(world, x, topk_idx, num_experts, topk_weights)
        if max_recv_tokens is not None and (not isinstance(max_recv_tokens, int) or isinstance(max_recv_tokens, bool)
                                            or max_recv_tokens < 0):
            raise ValueError(f"max_recv_tokens must be None or an int >= 0, got {max_recv_tokens!r}")
        self.world, w = world, world.world_size
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
        self.ws = ws = _workspace(world)
        self.cap = ws.ht_half_words // self.row  # dispatched rows a half holds
        have = 2 * ws.ht_half_words * 4
        if max_recv_tokens is not None and max_recv_tokens > self.cap:
            raise _too_big(f"ep_dispatch with max_recv_tokens={max_recv_tokens}", 2 * max_recv_tokens * self.row * 4,
                           have)
        if t * min(w, k) * self.hw > ws.ht_half_words:  # the rows that come back to me in ep_combine
            raise _too_big(f"ep_combine of {t} tokens", 2 * t * min(w, k) * self.hw * 4, have)
        self.heap = heap = world.heap.descriptor
        dev = world.device
        gpu = dev.type == "cuda"
        block, warps = HT_BLOCK_WARPS if gpu else (256, 4)
        programs = HT_PROGRAMS[dev.type]  # push programs: the receivers wait on the flag of each
        if programs > HT_MAX_PROGRAMS:
            raise ValueError(f"HT_PROGRAMS = {programs} is more than the workspace's flags ({HT_MAX_PROGRAMS})")
        self.grid = HT_COPY_PROGRAMS[dev.type]  # programs that copy out / sum what arrived
        i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=dev)  # noqa: E731
        blk_w, blk_k = triton.next_power_of_2(w), triton.next_power_of_2(k)
        blk_t = HT_ROUTE_TOKENS[dev.type]
        self.blocks = max(1, triton.cdiv(t, blk_t))  # token blocks of the count and position kernels
        blk_b = min(1024, triton.next_power_of_2(self.blocks))
        blk_wide = max(4, triton.next_power_of_2(w + 1))  # [ranks | bad entries]
        self.count = Launch(ep_count_kernel, (self.blocks,), (topk_idx, i32(self.blocks, w + 1), ws.error, t),
                            dict(K=k, LOCAL=self.local, WORLD=w, BLOCK_T=blk_t, BLOCK_K=blk_k, BLOCK_W=blk_wide), 4)
        self.route = Launch(ep_route_kernel, (1,),
                            (i32(self.blocks, w + 1), i32(self.blocks, w), i32(w, w), i32(self.local), i32(3),
                             ws.table, ws.counter(2), heap, self.blocks),
                            dict(LOCAL=self.local, WORLD=w, BLOCK_B=blk_b, BLOCK_W=blk_wide,
                                 BLOCK_L=triton.next_power_of_2(self.local)), 4)
        self.position = Launch(ep_position_kernel, (self.blocks,),
                               (topk_idx, i32(self.blocks, w), i32(max(t, 1), w), t),
                               dict(K=k, LOCAL=self.local, WORLD=w, BLOCK_T=blk_t, BLOCK_K=blk_k, BLOCK_W=blk_wide),
                               4)
        self.push = Launch(ep_push_kernel, (programs,),
                           (x.view(torch.int32), topk_idx, topk_weights, i32(max(t, 1), w), i32(w, w), ws.ht,
                            i32(1, self.hw), torch.zeros((1, k), dtype=topk_idx.dtype, device=dev),
                            torch.zeros((1, k), device=dev), ws.flags, ws.counter(3), heap, t, 1, ws.ht_half_words),
                           dict(HW=self.hw, K=k, ROW=self.row, LOCAL=self.local, WORLD=w, PROGRAMS=programs,
                                BLOCK=block, VEC=_vec(self.hw, x), BLOCK_K=blk_k, BLOCK_W=blk_w), warps)
        self.receive = Launch(ep_receive_kernel, (self.grid,),
                              (ws.ht, ws.flags, ws.counter(4), heap, i32(w, w), i32(1, self.hw),
                               torch.zeros((1, k), dtype=topk_idx.dtype, device=dev),
                               torch.zeros((1, k), device=dev), i32(self.local), ws.ht_half_words, 1),
                              dict(HW=self.hw, K=k, ROW=self.row, LOCAL=self.local, WORLD=w, PROGRAMS=programs,
                                   BLOCK=block, VEC=_vec(self.hw), BLOCK_K=blk_k,
                                   BLOCK_L=triton.next_power_of_2(self.local), BLOCK_W=blk_w), warps)
        # y's rows go back 16-byte vectors at a time: the combine takes y at that alignment (else a copy).
        self.push_back = Launch(ep_push_back_kernel, (programs,),
                                (i32(1, self.hw), i32(w, w), ws.ht, ws.flags, ws.counter(3), heap, 1,
                                 ws.ht_half_words),
                                dict(HW=self.hw, WORLD=w, PROGRAMS=programs, BLOCK=block, VEC=_vec(self.hw),
                                     BLOCK_W=blk_w), warps)
        self.reduce = Launch(ep_combine_reduce_kernel, (self.grid,),
                             (ws.ht, ws.flags, ws.counter(4), heap, i32(max(t, 1), w), i32(w, w), i32(1, self.hw),
                              i32(1, self.hw), ws.ht_half_words, t, 1),
                             dict(HW=self.hw, ELEM=_ELEM[x.dtype], WORLD=w, PROGRAMS=programs, BLOCK=block,
                                  BLOCK_W=blk_w), warps)
        # Pointer arguments as the launches take them (Launch.address): on GPUs addresses (the workspace's
        # taken once here, no view made per call), under the interpreter tensors of the kernels' types.
        a = self.address = self.route.address
        self.words = (lambda t: t.view(torch.int32)) if self.route.kernel is None else a
        self.route_fixed = tuple(map(a, (ws.table, ws.counter(2), heap)))
        self.error_at = a(ws.error)
        self.push_fixed = tuple(map(a, (ws.ht, ws.flags, ws.counter(3), heap)))
        self.region_at, self.signal_fixed = self.push_fixed[0], self.push_fixed[1:]
        self.wait_fixed = tuple(map(a, (ws.ht, ws.flags, ws.counter(4), heap)))

    def _prepared(self, x, topk_idx, topk_weights):
        """The call's tensors as the kernels take them (contiguous; x in whole words, aligned to them)."""
        if self.ready:
            return x, topk_idx, topk_weights
        return (x if _rows_ready(signature(x), self.cols) else _rows(x, self.cols), topk_idx.contiguous(),
                topk_weights.contiguous())

    def dispatch(self, x, topk_idx, topk_weights):
        ws, w, dev, a = self.ws, self.world.world_size, x.device, self.address
        ws.raise_routing_error()
        x, topk_idx, topk_weights = self._prepared(x, topk_idx, topk_weights)
        rank_pos = torch.empty((self.tokens, w), dtype=torch.int32, device=dev)
        table = torch.empty((w, w), dtype=torch.int32, device=dev)
        counts = torch.empty(self.local, dtype=torch.int32, device=dev)
        info = torch.empty(3, dtype=torch.int32, device=dev)
        block_counts = torch.empty((self.blocks, w + 1), dtype=torch.int32, device=dev)
        block_start = torch.empty((self.blocks, w), dtype=torch.int32, device=dev)
        self.count(a(topk_idx), a(block_counts), self.error_at, self.tokens)
        self.route(a(block_counts), a(block_start), a(table), a(counts), a(info), *self.route_fixed, self.blocks)
        self.position(a(topk_idx), a(block_start), a(rank_pos), self.tokens)
        if self.max_recv is None:
            most, rows, bad = info.tolist()  # the one host sync: the same table on every rank, so all raise or none
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
        return recv_x[:, :self.hidden], recv_idx, recv_w, counts, HTHandle(self, rank_pos, table, rows, limit)

    def combine(self, y, handle):
        ws, a = self.ws, self.address
        ws.raise_routing_error()
        if y.data_ptr() % 16 or not _rows_ready(signature(y), self.cols):
            y = _rows(y, self.cols)  # the push back was compiled for 16-byte aligned rows of whole words
        self.push_back(self.words(y), a(handle.table), *self.push_fixed, handle.rows, ws.ht_half_words)
        out = torch.empty((self.tokens, self.cols), dtype=self.dtype, device=y.device)
        self.reduce(*self.wait_fixed, a(handle.rank_pos), a(handle.table), self.words(y), self.words(out),
                    ws.ht_half_words, self.tokens, handle.limit)
        return out if self.cols == self.hidden else out[:, :self.hidden].contiguous()


def ep_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                max_recv_tokens: int | None = None):
    """Send each token once to every rank that holds one of its experts (high throughput, prefill).

    x (T, hidden) bf16/fp16/fp32; topk_idx (T, k) int64/int32 (-1: no expert); topk_weights (T, k) fp32; any
    layout and hidden size (a 16-bit row of odd length travels with a zero column more: recv_x is then a view).
    Returns (recv_x (R, hidden), recv_topk_idx (R, k): the row's experts as local indices on this rank, -1
    for experts elsewhere; recv_topk_weights (R, k); counts (L,) int32: received tokens per local expert;
    handle for ep_combine). Rows are ordered by source rank, then source token. Without max_recv_tokens R is
    exact (one host sync); with it (the same on every rank) R = max_recv_tokens (no sync, capturable): rows
    past the received ones have idx -1, weights 0 and x 0, and tokens beyond it are dropped (their combine
    gets nothing from this rank). Collective.

    topk_idx's values are checked on the device: a row naming an expert twice or one outside [0,
    num_experts) (and not -1) raises a ValueError naming topk_idx. Without max_recv_tokens every rank
    raises in this call, before anything is pushed (the sync sees every rank's check); with it, this rank
    raises at its next EP op's call once the kernel has run, and until then the row does no harm (entries
    outside the experts count as none, a repeated expert once).
    """
    world = world_or_raise()
    found = plan(world, lambda: ("ep", signature(x), signature(topk_idx), signature(topk_weights), num_experts,
                                 max_recv_tokens),
                 lambda: _HTPlan(world, x, topk_idx, topk_weights, num_experts, max_recv_tokens))
    return found.dispatch(x, topk_idx, topk_weights)


def ep_combine(y: torch.Tensor, handle: HTHandle) -> torch.Tensor:
    """Return each received row's result to its source: out (T, hidden) on the source rank = the sum over the
    ranks the token went to of their y row (y (R, hidden): each rank's weighted sum of its local experts'
    outputs per received row), in rank order, fp32. Collective."""
    world = world_or_raise()
    if not isinstance(handle, HTHandle):
        raise TypeError(f"handle must be what ep_dispatch returned, got {type(handle).__name__}")
    p = handle.plan
    check_tensor("y", y, world, dtypes=(p.dtype,), contiguous=False)
    if tuple(y.shape) != (handle.rows, p.hidden):
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {(handle.rows, p.hidden)} (recv_x's)")
    return p.combine(y, handle)


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


@triton.jit(do_not_specialize=["tokens", "half_words"])
def ep_dispatch_ll_kernel(x, topk, recv, scales, counts, src_rows, src_tokens, buf, counter, heap, err, tokens,
                          half_words, HW: tl.constexpr, K: tl.constexpr, LOCAL: tl.constexpr, MAX_T: tl.constexpr,
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
    launch of the same grid, which takes the send's epoch).
    """
    p = tl.program_id(0)
    lane = p // CHUNKS
    c = p % CHUNKS
    me = wl.rank(heap)
    if SEND:
        epoch = wl.next_epoch(counter)
    else:
        epoch = wl.last_epoch(counter)
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
        ee = tl.arange(0, BLOCK_E)
        if (lane == 0) & (c == 0):
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
        first = (lane == 0) & (c == 0)
        base = tl.zeros([BLOCK_L], tl.int32)  # rows of each of my experts taken by senders before s
        for s in range(WORLD):
            head = wl.wait_ll(half + s * HEAD + tl.where(ll < LOCAL, me * LOCAL + ll, EXPERTS), ll <= LOCAL, epoch,
                              heap=heap, peer=s, op="ep_dispatch_ll header")
            n_s = tl.sum(tl.where(ll == LOCAL, head, 0), axis=0)
            for t in range(lane, n_s, LANES):
                slot = slots + (s * MAX_T + t) * SLOT
                meta = wl.wait_ll(slot + jj, jj < K, epoch, heap=heap, peer=s, op="ep_dispatch_ll token")
                taken = (meta >= 0) & (jj < K)
                lexp = tl.where(taken, meta >> 16, -1)
                row = tl.sum(tl.where(ll[None, :] == lexp[:, None], base[None, :], 0), axis=1) + (meta & 0xFFFF)
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
            tl.store(counts + ll, base, mask=ll < LOCAL)


@triton.jit(do_not_specialize=["tokens", "half_words"])
def ep_combine_ll_kernel(y, topk, weights, out, src_rows, src_tokens, buf, counter, heap, tokens, half_words,
                         HW: tl.constexpr, K: tl.constexpr, LOCAL: tl.constexpr, MAX_T: tl.constexpr,
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
    """
    p = tl.program_id(0)
    lane = p // CHUNKS
    c = p % CHUNKS
    me = wl.rank(heap)
    if SEND:
        epoch = wl.next_epoch(counter)
    else:
        epoch = wl.last_epoch(counter)
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
        if c == 0:  # my tokens' weights, to the ranks of their experts
            for t in range(lane, tokens, LANES):
                e = valid_experts(tl.load(topk + t * K + jj, mask=jj < K, other=-1), jj < K, EXPERTS)
                dest = tl.where(e >= 0, e // LOCAL, -1)
                wt = wl.pack_ll(tl.load(weights + t * K + jj, mask=jj < K, other=0.0).to(tl.int32, bitcast=True),
                                epoch)
                for r in range(WORLD):
                    if tl.sum((dest == r).to(tl.int32), axis=0) > 0:
                        tl.store(wl.symm_at(wslots + (me * MAX_T + t) * K, r, heap) + jj, wt, mask=jj < K)
        for s in range(WORLD):
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
        wl.wait_ll(half + ww * PROGRAMS + p, ww < WORLD, epoch, heap=heap, op="ep_combine_ll ack")
        for t in range(lane, tokens, LANES):
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
    (`received`: launched)."""

    def __init__(self, plan, routes, src, received=True):
        self.plan, self.routes, self.src, self.received = plan, routes, src, received


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


# The LL kernels' launch settings on GPUs (scripts/probe_ep_ll.py sweeps them): at most LL_PROGRAMS programs and
# LL_PER_SM per SM (every program waits for its peers' programs, so all must be resident: programs wait only on
# the same or lower ones of their peers, and blocks start in order, so a program that must wait for a place
# gets one once the lower ones end), chunks of LL_CHUNK_WORDS words (a power of two >= 32), LL_WARPS warps.
# Under the interpreter LL_CPU (programs, chunk words, warps): tiny chunks, so that the tests' small rows span
# several. Measured on 2 H200s (2026-11-23, eighth session, hidden 7168 bf16, top-8 of 256, graph replay,
# dispatch / dispatch + combine us at 1, 32 and 128 tokens per rank): 132 programs, 1024-word chunks 10.0 /
# 17.7, 10.6 / 27.4, 34.2 / 99.7; 512-word 9.1 / 16.2, 13.9 / 34.2, 49.9 / 132.9; 256-word 9.4 / 15.8, 27.5 /
# 52.1, 126.8 / 227.3 (the kernels before the units: 29.1 / 68.4, 37.3 / 87.1, 101.6 / 220.0). Tenth session
# (combine one row per token and rank; fp8 dispatch + combine at 32 / 128 tokens): 132 programs 21.5 / 53.0,
# 264 (2 per SM) 21.8 / 39.8, 528 21.6 / 41.0, all with 1024-word chunks and 8 warps (4 warps: 23.9 / 42.4).
LL_PROGRAMS = 264
LL_PER_SM = 2
LL_CHUNK_WORDS = 1024
LL_WARPS = 8
LL_CPU = (2, 32, 4)


def _ll_units(row_words: int, max_tokens: int, programs: int, chunk_words: int) -> tuple[int, int, int]:
    """(chunk words, chunks a row, token lanes) of an LL kernel over rows of `row_words` words: chunks of
    `chunk_words` (larger where a row would need more than `programs` of them), as many lanes of tokens as fit
    `programs` whole rows of chunks; the grid is lanes x chunks."""
    chunk = max(chunk_words, triton.next_power_of_2(triton.cdiv(row_words, programs)))
    chunks = triton.cdiv(row_words, chunk)
    return chunk, chunks, min(max_tokens, programs // chunks)


class _LLPlan:
    def __init__(self, world, x, topk_idx, num_experts, max_tokens, fp8):
        _check_routing(world, x, topk_idx, num_experts)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens < (1 << 16):
            raise ValueError(f"max_tokens_per_rank must be an int in [1, 65536), got {max_tokens!r}")
        if x.shape[0] > max_tokens:
            raise ValueError(f"x has {x.shape[0]} tokens, more than max_tokens_per_rank={max_tokens}")
        if not isinstance(fp8, bool):
            raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
        if fp8 and x.shape[1] % 128:
            raise ValueError(f"fp8 needs a hidden size that is a multiple of 128 (one scale per 128 channels), "
                             f"got {x.shape[1]}")
        w = world.world_size
        self.world, self.heap, self.fp8 = world, world.heap.descriptor, fp8
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
        gpu = world.device.type == "cuda"
        programs, chunk_words, warps = ((min(LL_PROGRAMS, LL_PER_SM * num_sms(world.device)), LL_CHUNK_WORDS,
                                          LL_WARPS) if gpu
                                        else LL_CPU)
        d_chunk, d_chunks, d_lanes = _ll_units(sent_hw, max_tokens, programs, chunk_words)
        c_chunk, c_chunks, c_lanes = _ll_units(self.hw, max_tokens, programs, chunk_words)
        self.ws = ws = _workspace(world)
        dispatch_words = w * (num_experts + 1) + 1 + w * max_tokens * (self.k + sent_hw + self.groups)
        even = lambda n: (n + 1) // 2 * 2  # noqa: E731
        combine_words = even(w * c_lanes * c_chunks) + even(w * max_tokens * self.k) + max_tokens * w * self.hw
        for what, words in (("ep_dispatch_ll", dispatch_words), ("ep_combine_ll", combine_words)):
            if words > ws.ll_half_words:
                raise _too_big(f"{what} with max_tokens_per_rank={max_tokens}, hidden={self.hidden}, k={self.k}",
                               2 * words * 8, 2 * ws.ll_half_words * 8)
        common = dict(K=self.k, LOCAL=self.local, MAX_T=max_tokens, WORLD=w)
        blk_k = triton.next_power_of_2(self.k)
        dev = world.device
        # A call's routes in one allocation (LLHandle): counts, src_tokens, src_rows, 16-byte aligned.
        tok_at = triton.cdiv(self.local, 4) * 4
        self.route_at = (0, tok_at, tok_at + triton.cdiv(w, 4) * 4)
        self.route_words = self.route_at[2] + w * max_tokens * self.k
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
            ws.ll_half_words)
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
                a(counts), *src, *self.dispatch_fixed, x.shape[0], self.ws.ll_half_words)
        if self.cols != self.hidden:
            recv = recv[..., :self.hidden]  # rows of an odd length travelled with one more column
        if not hook:
            self._dispatch_launch(True, True, x, topk_idx)(*args)
            ws.raise_routing_error()
            return recv, counts, scales, LLHandle(self, routes, src)
        self._dispatch_launch(True, False, x, topk_idx)(*args)
        handle = LLHandle(self, routes, src, received=False)
        receive_launch = self._dispatch_launch(False, True, x, topk_idx)

        def receive():
            receive_launch(*args)
            handle.received = True
            ws.raise_routing_error()

        return recv, counts, scales, handle, RecvHook("ep_dispatch_ll", ws.ll_pending, receive)

    def _src(self, routes, views: bool = False) -> tuple:
        """(src_rows, src_tokens) of a routes tensor as the launches take them (views when asked)."""
        _, tok, rows = self.route_at
        if views or self.interpreted:
            w = self.world.world_size
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
                         ws.ll_half_words)
        a = self.address
        args = (self.words(y), a(topk_idx), a(topk_weights), self.words(out), *handle.src, *self.combine_fixed,
                tokens, ws.ll_half_words)
        # rows of an odd length travelled with one more column
        result = out if self.cols == self.hidden else out[:, :self.hidden]
        if not hook:
            self._combine_launch(key, True, True, first)(*args)
            return result
        self._combine_launch(key, True, False, first)(*args)
        receive = self._combine_launch(key, False, True, first)
        return result, RecvHook("ep_combine_ll", ws.ll_pending, lambda: receive(*args))


def ep_dispatch_ll(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, max_tokens_per_rank: int,
                   fp8: bool = False, return_recv_hook: bool = False):
    """Low-latency dispatch (decode): one launch, no host sync, capturable in a CUDA graph.

    x (T, hidden) bf16/fp16/fp32 with T <= max_tokens_per_rank; topk_idx (T, k) (-1: no expert); any layout and
    hidden size (a 16-bit row of odd length travels with a zero column more: recv is then a view).
    Returns (recv (L, max_tokens_per_rank * W, hidden): rows [0, counts[e]) of recv[e] are the tokens of
    local expert e, ordered by source rank then source token; counts (L,) int32; scales; handle for
    ep_combine_ll). fp8=False: recv has x's dtype and scales is None. fp8=True (hidden a multiple of 128):
    tokens travel as float8_e4m3fn, recv is float8_e4m3fn and scales (L, max_tokens_per_rank * W,
    hidden / 128) fp32 holds one scale per 128 channels (x ~ recv * scale; scale = amax / 448).
    Collective: every rank passes the same num_experts and max_tokens_per_rank.

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
    world = world_or_raise()
    if not isinstance(return_recv_hook, bool):
        raise TypeError(f"return_recv_hook must be a bool, got {type(return_recv_hook).__name__}")
    found = plan(world, lambda: ("ep_ll", signature(x), signature(topk_idx), num_experts, max_tokens_per_rank, fp8),
                 lambda: _LLPlan(world, x, topk_idx, num_experts, max_tokens_per_rank, fp8))
    return found.dispatch(x, topk_idx, return_recv_hook)


def ep_combine_ll(y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LLHandle,
                  return_recv_hook: bool = False):
    """Low-latency combine: out (T, hidden) = sum_j topk_weights[t, j] * (expert topk_idx[t, j]'s output for
    token t), where y (L, max_tokens_per_rank * W, hidden) holds each rank's expert outputs in recv's rows:
    each rank sums its experts' weighted outputs of a token (fp32, rounded to y's dtype) and sends that one
    row back, where the ranks' rows are summed (fp32). One launch, no host sync. Collective.

    return_recv_hook=True: returns (out, hook); the call launches the send (which waits only for its peers'
    weights, sent first thing by their calls), the hook the receive, after which out holds the sums. Run the
    hook once, before the next ep_combine_ll."""
    world = world_or_raise()
    if not isinstance(return_recv_hook, bool):
        raise TypeError(f"return_recv_hook must be a bool, got {type(return_recv_hook).__name__}")
    if not isinstance(handle, LLHandle):
        raise TypeError(f"handle must be what ep_dispatch_ll returned, got {type(handle).__name__}")
    p = handle.plan
    check_tensor("y", y, world, dtypes=(p.dtype,), contiguous=False)
    if tuple(y.shape) != p.recv_shape:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {p.recv_shape} (recv's)")
    check_tensor("topk_idx", topk_idx, world, dtypes=INDEX_DTYPES, contiguous=False)
    check_tensor("topk_weights", topk_weights, world, dtypes=(torch.float32,), contiguous=False)
    if topk_idx.dim() != 2 or topk_idx.shape[1] != p.k or topk_idx.shape[0] > p.max_tokens:
        raise ValueError(f"topk_idx must be (tokens <= {p.max_tokens}, {p.k}), got {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected {tuple(topk_idx.shape)}")
    return p.combine(y, topk_idx, topk_weights, handle, return_recv_hook)


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    (router_topk_kernel, dict(logits=t, idx="*i64", weights="*fp32", tokens="i32", experts="i32"),
     dict(K=k, NORM=norm, BLOCK_T=2048 // e, BLOCK_E=e, BLOCK_K=k), dict(num_warps=4))
    for t in ("*bf16", "*fp32") for k, e, norm in ((8, 128, True), (2, 8, False), (8, 256, True))
] + [
    (ep_count_kernel, dict(topk=t, block_counts="*i32", err="*i64", tokens="i32"),
     dict(K=8, LOCAL=256 // wd, WORLD=wd, BLOCK_T=64, BLOCK_K=8, BLOCK_W=max(4, triton.next_power_of_2(wd + 1))),
     dict(num_warps=4))
    for t in ("*i64", "*i32") for wd in (2, 8)
] + [
    (ep_route_kernel, dict(block_counts="*i32", block_start="*i32", table="*i32", counts="*i32", info="*i32",
                           buf="*i64", counter="*i64", heap="*i64", blocks="i32"),
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
                          tokens="i32", limit="i32", half_words="i32"),
     dict(HW=hw, K=8, ROW=triton.cdiv(hw + 16, 4) * 4, LOCAL=32, WORLD=8, PROGRAMS=128, BLOCK=HT_BLOCK_WARPS[0],
          VEC=_vec(hw), BLOCK_K=8, BLOCK_W=8), dict(num_warps=8))
    for t in ("*i64", "*i32") for hw in (3584, 3585)
] + [
    (ep_push_back_kernel, dict(y="*i32", table="*i32", region="*i32", flags="*i32", counter="*i64", heap="*i64",
                               rows="i32", half_words="i32"),
     dict(HW=3584, WORLD=8, PROGRAMS=128, BLOCK=HT_BLOCK_WARPS[0], VEC=4, BLOCK_W=8), dict(num_warps=8)),
] + [
    (ep_receive_kernel, dict(region="*i32", flags="*i32", counter="*i64", heap="*i64", table="*i32", x_out="*i32",
                             idx_out=t, w_out="*fp32", counts="*i32", half_words="i32", rows="i32"),
     dict(HW=3584, K=8, ROW=3600, LOCAL=32, WORLD=8, PROGRAMS=128, BLOCK=HT_BLOCK_WARPS[0], VEC=4, BLOCK_K=8,
          BLOCK_L=32, BLOCK_W=8), dict(num_warps=8))
    for t in ("*i64", "*i32")
] + [
    (ep_combine_reduce_kernel, dict(region="*i32", flags="*i32", counter="*i64", heap="*i64", rank_pos="*i32",
                                    table="*i32", y="*i32", out="*i32", half_words="i32", tokens="i32", limit="i32"),
     dict(HW=3584, ELEM=e, WORLD=8, PROGRAMS=128, BLOCK=HT_BLOCK_WARPS[0], BLOCK_W=8), dict(num_warps=8))
    for e in (tl.bfloat16, tl.float32)
] + [
    (ep_dispatch_ll_kernel, dict(x=xt, topk=t, recv="*i32", scales="*i32", counts="*i32", src_rows="*i32",
                                 src_tokens="*i32", buf="*i64", counter="*i64", heap="*i64", err="*i64", tokens="i32",
                                 half_words="i32"),
     dict(HW=3584 // (1 + fp8), K=8, LOCAL=local, MAX_T=128, WORLD=wd, CHUNK=512, CHUNKS=4 if fp8 else 7,
          LANES=33 if fp8 else 18, FP8=fp8, GROUPS=56 * fp8, BLOCK_K=8,
          BLOCK_L=triton.next_power_of_2(local + 1), BLOCK_E=512, BLOCK_T=32, SEND=send, RECV=receive),
     dict(num_warps=8, **({"min_arch": 89} if fp8 else {})))  # fp8 e4m3 needs sm_89 or later
    for t in ("*i64", "*i32") for wd, local in ((2, 128), (8, 32))
    for fp8, xt in ((False, "*i32"), (True, "*bf16"), (True, "*fp16"))
    for send, receive in (((True, True), (True, False), (False, True)) if t == "*i64" and wd == 8 else ((True, True),))
] + [
    (ep_combine_ll_kernel, dict(y="*i32", topk=t, weights="*fp32", out="*i32", src_rows="*i32", src_tokens="*i32",
                                buf="*i64", counter="*i64", heap="*i64", tokens="i32", half_words="i32"),
     dict(HW=3584, K=8, LOCAL=32, MAX_T=128, WORLD=8, CHUNK=512, CHUNKS=7, LANES=18, ELEM=e, BLOCK_K=8, BLOCK_W=8,
          SEND=send, RECV=receive), dict(num_warps=8))
    for t in ("*i64", "*i32") for e in (tl.bfloat16, tl.float16, tl.float32)
    for send, receive in (((True, True), (True, False), (False, True)) if t == "*i64" and e != tl.float32
                          else ((True, True),))
]
