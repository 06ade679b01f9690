"""MoE routing: the router, the routing layout, and the checks of topk_idx's values.

Experts are split contiguously over ranks: rank r owns experts [r * L, (r + 1) * L), L = E / W.
`topk_idx` (tokens x k) names each token's experts (-1: none); a row must not name an expert twice.

router_topk: the k largest softmax probabilities of each token's router logits and their experts, divided by
their sum, in one launch (router_topk_torch: the same in torch's ops).

routing_layout: per-rank and per-expert token counts and each token's slot per destination rank, with torch
ops on the device (no host sync); its topk_idx's values are checked on the device as the tensor-parallel ops
check them (_RoutingCheck), an entry outside [0, E) counted nowhere until raised.

The checks. check_routing_values reads topk_idx on the host (a sync). The ops check on the device as they read
the rows, with no host sync: the EP dispatch kernels (ep_ht, ep_ll) call check_rows, and the tensor-parallel
ops (tp, routed) launch moe_tp_check_kernel first (_RoutingCheck). A bad row is recorded in an error word
(RoutingErrorWord: the EP workspace's, and one of the tensor-parallel family, per group) that the host reads
with no sync and raises as a ValueError naming topk_idx, the row and the expert at the op's next call on that
rank. The same word records a count or row number a peer sent that is out of bounds (a peer whose call does not
match this rank's: other shapes or arguments), which the kernels then ignore (peer_error): no index that comes
from a tensor reaches memory unchecked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import Launch, Plan, check_tensor, plan, signature, workspace, world_or_raise
from ..registry import declare_op

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int64, torch.int32)


# -- routing layout -----------------------------------------------------------------

class Layout:
    """Where this rank's tokens go, from topk_idx (T, k) on the device:
    to_rank (T, W) int32 0/1: the token goes to rank r; tokens_per_rank (W,) int32;
    tokens_per_expert (E,) int32; rank_pos (T, W) int32: the token's position among this rank's tokens
    to rank r, -1 where it does not go there."""

    def __init__(self, topk_idx: torch.Tensor, num_experts: int, world_size: int):
        self.to_rank, self.tokens_per_rank, self.rank_pos, self.tokens_per_expert = _layout(topk_idx, num_experts,
                                                                                              world_size)

    @classmethod
    def of(cls, to_rank, tokens_per_rank, rank_pos, tokens_per_expert) -> "Layout":
        layout = cls.__new__(cls)
        layout.to_rank, layout.tokens_per_rank, layout.rank_pos, layout.tokens_per_expert = (
            to_rank, tokens_per_rank, rank_pos, tokens_per_expert)
        return layout


def _layout(topk_idx, num_experts, world_size):
    """(to_rank, tokens_per_rank, rank_pos, tokens_per_expert) of Layout, in torch ops on the device."""
    t, dev = topk_idx.shape[0], topk_idx.device
    local = num_experts // world_size
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < num_experts)  # a bad entry (reported by the op's check) goes nowhere
    ranks = torch.where(valid, idx // local, world_size)  # world_size: nowhere
    hit = torch.zeros((t, world_size + 1), dtype=torch.int32, device=dev).scatter_(1, ranks, 1)
    to_rank = hit[:, :world_size]
    rank_pos = torch.where(to_rank > 0, to_rank.cumsum(0, dtype=torch.int32) - 1, -1)
    experts = torch.where(valid, idx, num_experts).reshape(-1)
    ones = torch.ones_like(experts, dtype=torch.int32)
    tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev).scatter_add_(
        0, experts, ones)[:num_experts]
    return to_rank, to_rank.sum(0, dtype=torch.int32), rank_pos, tokens_per_expert


@declare_op()
def routing_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int | None = None) -> Layout:
    """The routing layout of `topk_idx` over `world_size` ranks (default: the world's), on the device.

    topk_idx's values are checked on the device with no host sync, as the tensor-parallel ops check them: a row
    naming an expert twice or one outside [0, num_experts) (and not -1) raises a ValueError naming topk_idx, the
    row and the expert (under the interpreter in this call; on GPUs at this rank's next call of routing_layout,
    ag_group_gemm, group_gemm_rs or routed_gemm, once the check has run). Until then such an entry goes to no
    rank and no expert."""
    world = world_or_raise()
    if world_size is None:
        world_size = world.world_size
    check_tensor("topk_idx", topk_idx, world, dtypes=INDEX_DTYPES, contiguous=False)
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be (tokens, k), got shape {tuple(topk_idx.shape)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    _check_experts(num_experts, world_size)
    check = plan(world, lambda: ("routing_layout", signature(topk_idx), num_experts),
                 lambda: _RoutingCheck(world, topk_idx, num_experts))
    check.raise_recorded()
    check.run(topk_idx if topk_idx.is_contiguous() else topk_idx.contiguous())
    layout = Layout(topk_idx, num_experts, world_size)
    check.raise_recorded()
    return layout


# -- the router ---------------------------------------------------------------------

@triton.jit
def router_topk_kernel(logits, idx, weights, tokens, experts, K: tl.constexpr, NORM: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """For BLOCK_T tokens' rows of logits: the K largest softmax probabilities (fp32) and their experts, largest
    first, chosen on the logits themselves (softmax keeps their order: the same experts as torch.topk of the
    probabilities, a tie to the lower index); NORM: the K weights divided by their sum. One pass where torch
    runs softmax, topk (with its sort) and the division: ~20 us at decode and ~70 at 8192 tokens on an H200.

    A row whose softmax is NaN in torch (a NaN logit, a +inf one, or every logit -inf) gets NaN weights, as
    torch.topk of those NaNs does (it ranks NaN above every number), and K distinct experts in [0, experts):
    a NaN logit ranks above every number (as torch.topk ranks NaN), ties to the lower index."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    jj = tl.arange(0, BLOCK_K)
    live = (t[:, None] < tokens) & (e[None, :] < experts)
    x = tl.load(logits + t.to(tl.int64)[:, None] * experts + e[None, :], mask=live, other=float("-inf"))
    x = tl.where(live, x.to(tl.float32), float("-inf"))
    nan = x != x
    has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    key = tl.where(nan, float("inf"), x)  # the ranking: NaN above every number
    top = tl.max(key, axis=1)
    nan_row = has_nan | (top == float("inf")) | (top == float("-inf"))  # torch's softmax row is NaN
    total = tl.sum(tl.where(live, tl.exp(x - top[:, None]), 0.0), axis=1)
    taken = (e[None, :] >= experts) | (t[:, None] >= tokens)  # dead columns are never chosen
    chosen = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    probs = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), key), axis=1)
        pick = tl.min(tl.where((key == best[:, None]) & ~taken, e[None, :], BLOCK_E), axis=1)
        pick = tl.where(pick < BLOCK_E, pick, 0)  # rows past the tokens: never stored
        chosen = tl.where(jj[None, :] == j, pick[:, None], chosen)
        prob = tl.where(nan_row, float("nan"), tl.exp(best - top) / total)
        probs = tl.where(jj[None, :] == j, prob[:, None], probs)
        taken = taken | (e[None, :] == pick[:, None])
    if NORM:
        probs = probs / tl.sum(probs, axis=1)[:, None]
    out = t.to(tl.int64)[:, None] * K + jj[None, :]
    mask = (t[:, None] < tokens) & (jj[None, :] < K)
    tl.store(idx + out, chosen.to(tl.int64), mask=mask)
    tl.store(weights + out, probs, mask=mask)


@declare_op(tensors=("logits",))
def router_topk(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE router's choice from its logits (T, E) (bf16 / fp16 / fp32): (topk_idx (T, k) int64, topk_weights
    (T, k) fp32), the k largest of softmax(logits) in fp32, largest first, divided by their sum when
    `renormalize` (Qwen3-MoE's norm_topk_prob; Mixtral's always) -- what torch's softmax, topk and division give
    (router_topk_torch), the experts the same, the weights within a few ulps (exp differs), in one launch.
    A row whose softmax is NaN (a NaN or +inf logit, or every logit -inf) gets NaN weights, as in torch, and k
    distinct experts in [0, E): its NaN and +inf logits first (torch.topk ranks NaN above every number), then the
    largest,
    ties to the lower index (torch.topk's order among NaN probabilities is its sort's, unspecified)."""
    world = world_or_raise()
    found = plan(world, lambda: ("router_topk", signature(logits), k, renormalize),
                 lambda: _RouterPlan(world, logits, k, renormalize))
    return found.run(logits)


def router_topk_torch(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk in torch's own ops (for traced calls, and the baselines)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, idx = torch.topk(probs, k, dim=-1)
    return idx, (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights)


class _RouterPlan(Plan):
    """router_topk of one signature: the checks, the launch; `run` runs a call."""

    def __init__(self, world, logits, k, renormalize):
        super().__init__(world)
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

    def run(self, logits):
        idx, weights = self._outputs(logits.device)
        if self.launch is not None:
            a = self.launch.address
            self.launch(a(logits if self.contiguous else logits.contiguous()), a(idx), a(weights), self.tokens,
                        self.experts)
        return idx, weights


# -- checks -------------------------------------------------------------------------

def _check_experts(num_experts, size: int) -> None:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the group size ({size}): "
                         "experts are split contiguously over the group's ranks")


def _check_routing(group, x, topk_idx, num_experts, topk_weights=None):
    """Shapes and dtypes of a dispatch's arguments (no values: those need a host sync). Any layout: the plans copy
    what the kernels cannot take as it is (_rows)."""
    check_tensor("x", x, group, dtypes=DTYPES, contiguous=False)
    check_tensor("topk_idx", topk_idx, group, dtypes=INDEX_DTYPES, contiguous=False)
    _check_experts(num_experts, group.size)
    if x.dim() != 2:
        raise ValueError(f"x must be (tokens, hidden), got shape {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or not 1 <= topk_idx.shape[1] <= num_experts:
        raise ValueError(f"topk_idx must be (tokens, k) with tokens = {x.shape[0]} and 1 <= k <= num_experts, "
                         f"got shape {tuple(topk_idx.shape)}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, group, dtypes=(torch.float32,), contiguous=False)
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected "
                             f"{tuple(topk_idx.shape)} (that of topk_idx)")


@declare_op()
def check_routing_values(topk_idx: torch.Tensor, num_experts: int) -> None:
    """ValueError unless every entry of topk_idx is -1 or an expert in [0, num_experts), and no row names an
    expert twice. Reads the values: host syncs. (The EP and tensor-parallel MoE ops check on the device
    instead, with no sync: check_rows.)"""
    if topk_idx.numel() == 0:
        return
    if bool(((topk_idx < -1) | (topk_idx >= num_experts)).any()):
        raise ValueError(f"topk_idx holds an expert outside [0, {num_experts}) (and not -1)")
    srt = topk_idx.sort(dim=1).values
    if bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()):
        raise ValueError("topk_idx names the same expert twice in a row: each token's experts must differ")


# -- the operators -------------------------------------------------------------------------------------------
#   torch.ops.weft.routing_layout(topk_idx, num_experts, world_size) -> (to_rank, tokens_per_rank, rank_pos,
#                                                                        tokens_per_expert)
#   torch.ops.weft.router_topk(logits, k, renormalize) -> (topk_idx, topk_weights)
#   torch.ops.weft.check_routing_values(topk_idx, num_experts) -> ()   (raises; kept by graph passes)

@routing_layout.define
def routing_layout_op(topk_idx: torch.Tensor, num_experts: int,
                      world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = routing_layout.eager(topk_idx, num_experts, world_size)
    return layout.to_rank.clone(), layout.tokens_per_rank, layout.rank_pos, layout.tokens_per_expert


@routing_layout_op.register_fake
def _(topk_idx, num_experts, world_size):
    t = topk_idx.shape[0]
    i32 = dict(dtype=torch.int32)
    return (topk_idx.new_empty((t, world_size), **i32), topk_idx.new_empty((world_size,), **i32),
            topk_idx.new_empty((t, world_size), **i32), topk_idx.new_empty((num_experts,), **i32))


@routing_layout.traced
def _(topk_idx, num_experts, world_size=None):
    if world_size is None:
        world_size = world_or_raise().world_size
    return Layout.of(*torch.ops.weft.routing_layout(topk_idx, num_experts, world_size))


@router_topk.define
def router_topk_op(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return router_topk.eager(logits, k, renormalize)


@router_topk_op.register_fake
def _(logits, k, renormalize=True):
    t = logits.shape[0]
    return logits.new_empty((t, k), dtype=torch.int64), logits.new_empty((t, k), dtype=torch.float32)


@router_topk.traced
def _(logits, k, renormalize=True):
    # A call autograd must record takes torch's own ops, differentiable as they are (the operator is not).
    if logits.requires_grad and torch.is_grad_enabled():
        return router_topk_torch(logits, k, renormalize)
    return torch.ops.weft.router_topk(logits, k, renormalize)


@check_routing_values.define
def check_routing_values_op(topk_idx: torch.Tensor, num_experts: int) -> None:
    check_routing_values.eager(topk_idx, num_experts)


@check_routing_values_op.register_fake
def _(topk_idx, num_experts):
    return None


torch.fx.node.has_side_effect(check_routing_values_op._opoverload)  # a check: no output, never dropped


# -- routing checks on the device ---------------------------------------------------
# A bad topk_idx row (an expert named twice, or outside [0, E) and not -1) is found by the kernels that read
# the rows, not by a host sync: they read an entry outside [0, E) as -1 (no expert), count a token once per
# expert or rank however often its row names it (so a repeat lands on one row and never past a buffer), and
# record the row in an error word that the host reads with no sync (RoutingErrorWord, which decodes it into
# the ValueError).

ERROR_SET = tl.constexpr(1 << 62)  # marks a recorded error: word = ERROR_SET | row << 33 | kind << 32 | expert
# ... or, for what a peer sent: ERROR_SET | PEER_ERROR | peer << 33 | what (peer_error, PEER_WHAT).
PEER_ERROR = tl.constexpr(1 << 61)


@triton.jit
def valid_experts(raw, live, EXPERTS: tl.constexpr):
    """Entries of topk rows (any integer type) as int32 experts, -1 where none or outside [0, EXPERTS)."""
    raw = raw.to(tl.int64)
    return tl.where(live & (raw >= 0) & (raw < EXPERTS), raw, -1).to(tl.int32)


@triton.jit
def check_rows(raw, rows, err, live, EXPERTS: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile of topk rows (raw (R, BLOCK_K), row numbers `rows` (R,)) as valid_experts, and how many of its
    entries are bad; the tile's first bad row is recorded in the error word `err`, with its first entry
    outside [0, EXPERTS) (and not -1), else the expert it names twice. Any program or tile may record over
    another: one 8-byte store of the whole word, so the host reads one bad row whole."""
    e = valid_experts(raw, live, EXPERTS)
    jj = tl.arange(0, BLOCK_K)
    raw = raw.to(tl.int64)
    outside = live & ((raw < -1) | (raw >= EXPERTS))
    later = (e[:, :, None] == e[:, None, :]) & (jj[None, :, None] < jj[None, None, :]) & (e[:, :, None] >= 0)
    twice = tl.max(later.to(tl.int32), axis=2) > 0
    bad = tl.sum(tl.sum((outside | twice).to(tl.int32), axis=1), axis=0)
    if bad > 0:
        first_row = tl.min(tl.where(tl.max((outside | twice).to(tl.int32), axis=1) > 0, rows, 1 << 30), axis=0)
        here = (rows == first_row)[:, None]
        outside = outside & here
        first = tl.min(tl.min(tl.where(outside, jj[None, :], BLOCK_K), axis=1), axis=0)
        shown = tl.minimum(tl.maximum(raw, -(1 << 31)), (1 << 31) - 1)
        named_twice = tl.max(tl.max(tl.where(twice & here, e, -1), axis=1), axis=0).to(tl.int64)
        expert = tl.where(first < BLOCK_K,
                          tl.sum(tl.sum(tl.where(outside & (jj[None, :] == first), shown, 0), axis=1), axis=0),
                          named_twice)
        kind = (first < BLOCK_K).to(tl.int64)
        tl.store(err, ERROR_SET | (first_row.to(tl.int64) << 33) | (kind << 32) | (expert & 0xFFFFFFFF))
    return e, bad


@triton.jit
def peer_error(err, peer, WHAT: tl.constexpr):
    """Record in the error word `err` that group rank `peer` sent a count or row number out of bounds for this
    rank's call (WHAT: which, a key of PEER_WHAT); the kernel ignores what it sent."""
    tl.store(err, ERROR_SET | PEER_ERROR | (peer.to(tl.int64) << 33) | WHAT)


@triton.jit
def moe_tp_check_kernel(topk, err, tokens, K: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """Check BLOCK_T rows of topk (tokens, K) per program: a bad row is recorded in the error word `err`
    (check_rows)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    jj = tl.arange(0, BLOCK_K)
    live = (rows[:, None] < tokens) & (jj[None, :] < K)
    check_rows(tl.load(topk + rows[:, None] * K + jj[None, :], mask=live, other=-1), rows, err, live, EXPERTS,
               BLOCK_K)


# -- the error word, on the host -------------------------------------------------------

class RoutingErrorWord:
    """An error word where kernels record a bad topk_idx row (check_rows) or an out-of-bounds count a peer sent
    (peer_error), read by the host with no sync: on GPUs pinned host memory, which the kernels store to through
    its address (unified addressing maps it for the device), so a recorded row shows up once the kernel has run;
    on the cpu backend a word of the group's heap (made in the same order on every member). Made zero. `tensor`:
    what the kernels take."""

    def __init__(self, group):
        if group.device.type == "cuda":
            self.tensor = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        else:
            self.tensor = group.heap.empty((1,), torch.int64).zero_()
        self.host = self.tensor.numpy()  # the host's view: a read is a load, no torch op
        group.error_checks.append(self.raise_recorded)  # weft.check_errors() raises it too

    def raise_recorded(self) -> None:
        """The ValueError naming topk_idx, the row and the expert for a bad row recorded since the last one
        raised, if any. The word is cleared as it is raised: the next valid call works."""
        word = int(self.host[0])
        if word:
            self.host[0] = 0
            raise _routing_error(word)


# What a peer sent out of bounds (peer_error's WHAT), as the error names it.
PEER_WHAT = {
    1: "the layout chunk of its tokens (ag_group_gemm / group_gemm_rs: a token count or pair row outside this "
       "rank's m x k)",
    2: "its token counts (ep_dispatch: rows past what this rank's receive region holds)",
    3: "its token header (ep_dispatch_ll: more tokens than max_tokens_per_rank, or an expert or position outside "
       "this rank's)",
}


def _routing_error(word: int) -> ValueError:
    """The ValueError of a recorded error word (ERROR_SET | row << 33 | kind << 32 | expert, or a peer's:
    ERROR_SET | PEER_ERROR | peer << 33 | what)."""
    if word & (1 << 61):
        peer, what = (word >> 33) & ((1 << 28) - 1), word & 0xFFFFFFFF
        return ValueError(f"group rank {peer} sent {PEER_WHAT.get(what, what)}: its call does not match this "
                          "rank's; every member must pass the same shapes and arguments (what it sent was ignored)")
    row, outside, expert = (word >> 33) & ((1 << 28) - 1), (word >> 32) & 1, word & 0xFFFFFFFF
    expert -= (expert >> 31) << 32
    if outside:
        return ValueError(f"topk_idx row {row} holds {expert}: an expert outside [0, num_experts) (and not -1)")
    return ValueError(f"topk_idx row {row} names expert {expert} twice: each token's experts must differ")


# -- the tensor-parallel ops' check launch ---------------------------------------------

class _RoutingCheck(Plan):
    """topk_idx's values checked on the device, with no host sync (moe_tp_check_kernel): a bad row is recorded
    in the family's error word of the group (a RoutingErrorWord, made with the family's first call whatever its
    method), and raise_recorded raises it. routing_layout's plan; a part of the tensor-parallel ops' plans."""

    def __init__(self, group, topk_idx, num_experts: int):
        super().__init__(group)
        self.errors = workspace(group, "moe_tp_errors", RoutingErrorWord)
        m, k = topk_idx.shape
        self.m, self.launch = m, None
        if m == 0:
            return
        block_k = triton.next_power_of_2(k)
        # check_rows compares every pair of a row's entries: BLOCK_T x BLOCK_K^2 at once, at most 4096.
        block_t = min(64, triton.next_power_of_2(m), max(1, 4096 // block_k ** 2))
        self.launch = Launch(moe_tp_check_kernel, (triton.cdiv(m, block_t),), (topk_idx, self.errors.tensor, m),
                             dict(K=k, EXPERTS=num_experts, BLOCK_T=block_t, BLOCK_K=block_k))
        self.err = self.launch.address(self.errors.tensor)  # on GPUs the pinned word's address, taken once

    def run(self, topk_idx) -> None:
        if self.launch is not None:
            self.launch(self.launch.address(topk_idx), self.err, self.m)

    def raise_recorded(self) -> None:
        self.errors.raise_recorded()


def _checked(found, *args):
    """found.run(*args) between the routing checks' raises: a bad row an earlier call of the family recorded
    (nothing launched), then this call's, where its check has run (always under the interpreter)."""
    found.routing.raise_recorded()
    result = found.run(*args)
    found.routing.raise_recorded()
    return result


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    (router_topk_kernel, dict(logits=t, idx="*i64", weights="*fp32", tokens="i32", experts="i32"),
     dict(K=k, NORM=norm, BLOCK_T=2048 // e, BLOCK_E=e, BLOCK_K=k), dict(num_warps=4))
    for t in ("*bf16", "*fp32") for k, e, norm in ((8, 128, True), (2, 8, False), (8, 256, True))
] + [
    (moe_tp_check_kernel, dict(topk=t, err="*i64", tokens="i32"),
     dict(K=k, EXPERTS=experts, BLOCK_T=64, BLOCK_K=triton.next_power_of_2(k)), dict(num_warps=4))
    for t in ("*i64", "*i32") for experts, k in ((128, 8), (8, 2))
]
