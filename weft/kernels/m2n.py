"""M2N: rows routed from M sender ranks to N receiver ranks and back (m2n_dispatch / m2n_combine), the
disaggregated form of the EP LL ops (MegaScale-Infer's attention -> expert traffic): the senders and receivers are
two disjoint sets of ranks of one group (the union: `group=`, default the world), whose ranks the kernels see.

Dispatch: each sender row t names up to k receivers (`dest[t, j]`: a receiver index in [0, N), or -1 for none).
Sender s writes each (t, j) entry's row into receiver dest[t, j]'s segment for s, at the entry's position among
s's entries for that receiver (row-major (t, j) order), then the segment's row count, then raises its flag; a
receiver waits for every sender's flag and copies each segment out: recv[s, :counts[s]] are sender s's rows, in
order. Combine: each receiver pushes its processed rows y[s, :counts[s]] back into sender s's combine segment
for it; a sender waits for every receiver and sums out[t] = sum_j weights[t, j] * y_row(t, j) (fp32, rounded to
x's dtype once). One launch per side per op, no host sync, CUDA-graph capturable.

Synchronisation (per direction, both the same): the buffers are double-buffered by the call's epoch
(`wl.next_epoch` on a counter per op: every union rank calls each op once per step, so the epochs agree); flags
count epochs and are never reset. A writer (sender in dispatch, receiver in combine) of call e first waits for
every reader's acknowledgement of call e - 1, which a reader releases after it has copied its half out: so when
half e % 2 is rewritten at call e, its last reading (call e - 2) ended before the ack of e - 1 was sent. Only the
writer writes a segment, its count and its flag; only the reader its acknowledgement word in the writer's heap.
Each side's launch is one program (writers never wait on a program of a reader that waits on them).

Workspace: made at the group's first M2N call, collectively (an allocation and a host barrier over the group). That
needs no rank outside the call: the group must be exactly the senders and the receivers, and every one of them
calls each op (unlike p2p, where a first transfer between two members leaves the others out: weft/kernels/p2p.py).

A destination outside [-1, N) is never dereferenced: the entry counts as none and the sender records it in the
family's error word, raised (ValueError naming `dest`, the row and the value) after the launch under the
interpreter, and at the family's next call or `weft.check_errors()` on GPUs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

import weft.language as wl

from .blocks import cast
from .common import (Plan, check_tensor, group_name, group_size, handle_group, plan, resolve, signature, workspace,
                     zero_everywhere)
from ..runtime.group import Group
from .registry import declare_op, export

ERROR_SET = tl.constexpr(1 << 62)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _wide(v):
    """v as int64 (loop counters are plain ints under the interpreter): offsets of large buffers."""
    return v + tl.zeros([], tl.int64)


@triton.jit
def _row(dst, src, hidden, BLOCK: tl.constexpr):
    for c0 in range(0, hidden, BLOCK):
        cc = c0 + tl.arange(0, BLOCK)
        tl.store(dst + cc, tl.load(src + cc, mask=cc < hidden), mask=cc < hidden)


@triton.jit(do_not_specialize=["tokens"])
def m2n_dispatch_kernel(x, dest, routes, recv, counts, buf, seg_counts, flags, acks, counter, pos, err, heap,
                        tokens, hidden, max_rows, senders, receivers, ME: tl.constexpr, M: tl.constexpr,
                        N: tl.constexpr, K: tl.constexpr, SENDER: tl.constexpr, BLOCK: tl.constexpr):
    """SENDER: my rows into their receivers' segments (buf: [2][M][max_rows][hidden]), counts, flags[ME] on each
    receiver; routes[t, j] = receiver * max_rows + position, or -1. Else: wait for every sender, copy the segments
    into recv (M, max_rows, hidden), counts (M,), then acknowledge acks[ME] on every sender. ME: my sender or
    receiver index; senders / receivers: their group ranks."""
    epoch = wl.next_epoch(counter)
    half = epoch % 2
    if SENDER:
        for r in tl.static_range(N):
            wl.wait(acks + r, 1, epoch - 1, wl.CMP_GE, heap=heap, peer=receivers[r], op="m2n_dispatch (ack)")
            tl.store(pos + r, 0)
        for t in range(tokens):
            for j in tl.static_range(K):
                d = tl.load(dest + t * K + j).to(tl.int32)
                ok = (d >= 0) & (d < N)
                if (d != -1) & (ok == 0):
                    tl.store(err, ERROR_SET | (_wide(t) << 32) | (_wide(d) & 0xFFFFFFFF))
                route = -1
                if ok:
                    p = tl.load(pos + d)
                    tl.store(pos + d, p + 1)
                    route = (d * max_rows + p).to(tl.int32)
                    for r in tl.static_range(N):
                        if d == r:
                            seg = buf + ((half * M + ME) * max_rows + p).to(tl.int64) * hidden
                            _row(wl.symm_at(seg, receivers[r], heap), x + _wide(t) * hidden, hidden, BLOCK)
                tl.store(routes + t * K + j, route)
        for r in tl.static_range(N):
            tl.store(wl.symm_at(seg_counts + half * M + ME, receivers[r], heap), tl.load(pos + r))
            wl.notify(flags + ME, receivers[r], heap, epoch)
    else:
        for s in tl.static_range(M):
            token = wl.wait(flags + s, 1, epoch, wl.CMP_GE, heap=heap, peer=senders[s], op="m2n_dispatch")
            n = tl.load(wl.consume_token(seg_counts + half * M + s, token), volatile=True)
            seg = wl.consume_token(buf + ((half * M + s) * max_rows).to(tl.int64) * hidden, token)
            for i in range(n):
                _row(recv + _wide((s * max_rows + i)) * hidden, seg + _wide(i) * hidden, hidden, BLOCK)
            tl.store(counts + s, n)
        for s in tl.static_range(M):
            wl.notify(acks + ME, senders[s], heap, epoch)


@triton.jit(do_not_specialize=["tokens"])
def m2n_combine_kernel(y, weights, routes, counts, out, buf, flags, acks, counter, heap, tokens, hidden, max_rows,
                       senders, receivers, ME: tl.constexpr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                       SENDER: tl.constexpr, BLOCK: tl.constexpr):
    """Receiver: y[s, :counts[s]] into sender s's buf [2][N][max_rows][hidden] at [half][ME], flags[ME] on s.
    Sender: wait for every receiver, out[t] = sum_j weights[t, j] * buf[half][route], acknowledge acks[ME]."""
    epoch = wl.next_epoch(counter)
    half = epoch % 2
    if SENDER:
        for r in tl.static_range(N):
            wl.wait(flags + r, 1, epoch, wl.CMP_GE, heap=heap, peer=receivers[r], op="m2n_combine")
        seg = buf + _wide((half * N * max_rows)) * hidden
        for t in range(tokens):
            for c0 in range(0, hidden, BLOCK):
                cc = c0 + tl.arange(0, BLOCK)
                acc = tl.zeros([BLOCK], tl.float32)
                for j in tl.static_range(K):
                    route = tl.load(routes + t * K + j)
                    if route >= 0:
                        wt = tl.load(weights + t * K + j)
                        v = tl.load(seg + _wide(route) * hidden + cc, mask=cc < hidden, other=0.0)
                        acc += wt * v.to(tl.float32)
                tl.store(out + _wide(t) * hidden + cc, cast(acc, out.dtype.element_ty), mask=cc < hidden)
        for r in tl.static_range(N):
            wl.notify(acks + ME, receivers[r], heap, epoch)
    else:
        for s in tl.static_range(M):
            wl.wait(acks + s, 1, epoch - 1, wl.CMP_GE, heap=heap, peer=senders[s], op="m2n_combine (ack)")
            n = tl.load(counts + s)
            seg = buf + ((half * N + ME) * max_rows).to(tl.int64) * hidden
            for i in range(n):
                _row(wl.symm_at(seg + _wide(i) * hidden, senders[s], heap),
                     y + _wide((s * max_rows + i)) * hidden, hidden, BLOCK)
            wl.notify(flags + ME, senders[s], heap, epoch)


class M2NWorkspace:
    """The union group's M2N workspace: a data region (carved per plan: dispatch [2][M][rows][hidden], then
    combine [2][N][rows][hidden]), segment counts, flags and acks per op, epoch counters, positions, error word."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        self.data_bytes = group.workspace_bytes // 256 * 256
        self.data = heap.empty((self.data_bytes,), torch.uint8)
        self.words = heap.empty((2 * w + 4 * w + 2 + w + 1,), torch.int64)
        self.seg_counts = self.words[:2 * w]
        f = self.words[2 * w:6 * w]
        self.d_flags, self.d_acks, self.c_flags, self.c_acks = (f[i * w:(i + 1) * w] for i in range(4))
        self.d_counter, self.c_counter = self.words[6 * w:6 * w + 1], self.words[6 * w + 1:6 * w + 2]
        self.pos = self.words[6 * w + 2:7 * w + 2]
        self.err = self.words[7 * w + 2:]
        zero_everywhere(group, self.words)
        group.error_checks.append(self.raise_recorded)

    def raise_recorded(self) -> None:
        word = int(self.err[0])
        if word:
            self.err.zero_()
            value = word & 0xFFFFFFFF
            value -= (value >> 31) << 32
            raise ValueError(f"dest row {(word >> 32) & ((1 << 30) - 1)} holds {value}: a receiver outside "
                             "[0, number of receivers) (and not -1)")


def _ranks(name, ranks, g) -> tuple[int, ...]:
    """Group ranks of `ranks` (world ranks, or a Group's)."""
    world_ranks = getattr(ranks, "ranks", ranks)
    try:
        world_ranks = tuple(int(r) for r in world_ranks)
    except TypeError:
        raise TypeError(f"{name} must be a weft.Group or a sequence of world ranks, got {type(ranks).__name__}") \
            from None
    if not world_ranks or len(set(world_ranks)) != len(world_ranks):
        raise ValueError(f"{name} must name at least one rank, each once, got {list(world_ranks)}")
    missing = [r for r in world_ranks if r not in g.ranks]
    if missing:
        raise ValueError(f"{name}: world ranks {missing} are not in the group of ranks {list(g.ranks)}")
    return tuple(sorted(g.ranks.index(r) for r in world_ranks))


@export
class M2NHandle:
    """What m2n_dispatch returns for m2n_combine: its plan and routes (sender: (T, k) receiver * rows + position,
    or -1; receiver: the counts)."""

    def __init__(self, plan, routes):
        self.plan, self.routes = plan, routes


class M2NPlan(Plan):
    """A dispatch / combine pair of one signature on the union group."""

    def __init__(self, group, x, dest, senders, receivers, max_tokens):
        super().__init__(group)
        self.senders, self.receivers = s, r = _ranks("senders", senders, group), _ranks("receivers", receivers, group)
        if set(s) & set(r):
            raise ValueError(f"senders and receivers must be disjoint (group ranks {sorted(set(s) & set(r))} in both)")
        if set(s) | set(r) != set(range(group.size)):
            raise ValueError(f"senders and receivers must make up the group (of {group.size} ranks): pass their union "
                             "as group=")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        check_tensor("x", x, group, dtypes=(torch.float32, torch.bfloat16, torch.float16), contiguous=False)
        check_tensor("dest", dest, group, dtypes=INDEX_DTYPES, contiguous=False)
        if x.dim() != 2 or dest.dim() != 2 or dest.shape[0] != x.shape[0] or dest.shape[1] < 1:
            raise ValueError(f"x must be (tokens, hidden) and dest (tokens, k), got {tuple(x.shape)} and "
                             f"{tuple(dest.shape)}")
        self.is_sender = group.rank in s
        self.me = s.index(group.rank) if self.is_sender else r.index(group.rank)
        if not self.is_sender and x.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows on a receiver: receivers pass (0, hidden) (and dest (0, k))")
        if x.shape[0] > max_tokens:
            raise ValueError(f"x has {x.shape[0]} rows, more than max_tokens={max_tokens}")
        self.k, self.hidden, self.dtype = dest.shape[1], x.shape[1], x.dtype
        self.max_rows = max_tokens * self.k
        m, n = len(s), len(r)
        self.ws = ws = workspace(group, "m2n", M2NWorkspace)
        need = 2 * (m + n) * self.max_rows * self.hidden * x.element_size()
        if need > ws.data_bytes:
            raise ValueError(f"m2n needs {need} bytes of workspace for max_tokens={max_tokens}, k={self.k}, hidden="
                             f"{self.hidden}; the group's is {ws.data_bytes} (WEFT_WORKSPACE_BYTES)")
        elems = ws.data.view(x.dtype)
        self.d_buf = elems[:2 * m * self.max_rows * self.hidden]
        self.c_buf = elems[2 * m * self.max_rows * self.hidden:need // x.element_size()]
        self.recv_shape = (m if not self.is_sender else 0, self.max_rows, self.hidden)
        self.counts_len = 0 if self.is_sender else m
        self.block = min(1024, triton.next_power_of_2(max(1, self.hidden)))
        self.consts = dict(ME=self.me, M=m, N=n, K=self.k, SENDER=self.is_sender, BLOCK=self.block)
        self.heap = group.heap.descriptor

    def dispatch(self, x, dest):
        self.ws.raise_recorded()
        x, dest = x.contiguous(), dest.contiguous()
        recv = torch.empty(self.recv_shape, dtype=self.dtype, device=x.device)
        counts = torch.zeros((self.counts_len,), dtype=torch.int32, device=x.device)
        routes = torch.empty(dest.shape, dtype=torch.int32, device=x.device)
        ws = self.ws
        m2n_dispatch_kernel[(1,)](x, dest, routes, recv, counts, self.d_buf, ws.seg_counts, ws.d_flags, ws.d_acks,
                                  ws.d_counter, ws.pos, ws.err, self.heap, x.shape[0], self.hidden, self.max_rows,
                                  self.senders, self.receivers, **self.consts)
        if x.device.type == "cpu":
            ws.raise_recorded()
        return recv, counts, M2NHandle(self, routes if self.is_sender else counts)

    def combine(self, y, weights, handle):
        ws = self.ws
        tokens = handle.routes.shape[0] if self.is_sender else 0
        out = torch.empty((tokens, self.hidden), dtype=self.dtype, device=self.group.device)
        if self.is_sender:
            check_tensor("weights", weights, self.group, dtypes=(torch.float32,), contiguous=False)
            if tuple(weights.shape) != tuple(handle.routes.shape):
                raise ValueError(f"weights has shape {tuple(weights.shape)}, expected {tuple(handle.routes.shape)}")
            y = self.d_buf  # unused on a sender
            counts = handle.routes
        else:
            check_tensor("y", y, self.group, dtypes=(self.dtype,), contiguous=False)
            if tuple(y.shape) != self.recv_shape:
                raise ValueError(f"y has shape {tuple(y.shape)}, expected {self.recv_shape} (recv's)")
            y, weights, counts = y.contiguous(), self.d_buf, handle.routes
        m2n_combine_kernel[(1,)](y, weights, handle.routes, counts, out, self.c_buf, ws.c_flags, ws.c_acks,
                                 ws.c_counter, self.heap, tokens, self.hidden, self.max_rows, self.senders,
                                 self.receivers, **self.consts)
        return out


def _plan(x, dest, senders, receivers, max_tokens, group) -> M2NPlan:
    g = resolve(group)
    key = lambda: ("m2n", signature(x), signature(dest), tuple(getattr(senders, "ranks", senders)),  # noqa: E731
                   tuple(getattr(receivers, "ranks", receivers)), max_tokens)
    return plan(g, key, lambda: M2NPlan(g, x, dest, senders, receivers, max_tokens))


@declare_op(collective=True)
def m2n_dispatch(x: torch.Tensor, dest: torch.Tensor, senders: Group | Sequence[int],
                 receivers: Group | Sequence[int], max_tokens: int,
                 group=None) -> tuple[torch.Tensor, torch.Tensor, M2NHandle]:
    """Route rows from the `senders` ranks to the `receivers` ranks (two disjoint sets making up `group`, default
    the world; each a weft.Group or a sequence of world ranks, the same on every rank). Collective over the group.

    A sender passes x (T, hidden) (T <= max_tokens; bf16/fp16/fp32, any layout) and dest (T, k): each row's
    receivers by index in `receivers` (group order), -1 for none; a receiver passes x (0, hidden) of the same
    dtype and dest (0, k). Returns (recv, counts, handle): on a receiver recv (M, max_tokens * k, hidden) whose
    rows [0, counts[s]) are sender s's rows for it, in (row, j) order, bit-exact, counts (M,) int32; on a sender
    recv (0, max_tokens * k, hidden) and counts (0,). No host sync, capturable. A dest value outside [-1, N)
    counts as none and raises a ValueError naming it (see the module doc)."""
    found = _plan(x, dest, senders, receivers, max_tokens, group)
    return found.dispatch(x, dest)


@declare_op(collective=True)
def m2n_combine(y: torch.Tensor | None, weights: torch.Tensor | None, handle: M2NHandle,
                group=None) -> torch.Tensor:
    """The way back: a receiver passes y (recv's shape: its processed rows; rows past counts unread), weights
    None; a sender passes y None and weights (T, k) fp32. A sender gets out (T, hidden) = sum_j weights[t, j] *
    (the processed row of entry (t, j)), 0 where a row has no receiver (fp32 sums, rounded once); a receiver
    gets (0, hidden). Collective over the dispatch's group, after the dispatch whose handle it takes (`group`:
    default that one; another raises)."""
    handle_group(handle, group, M2NHandle, "m2n_dispatch")
    return handle.plan.combine(y, weights, handle)


# -- the operators, by group name: senders / receivers as world ranks; the combine takes the dispatch's arguments --

@m2n_dispatch.define
def m2n_dispatch_op(x: torch.Tensor, dest: torch.Tensor, senders: list[int], receivers: list[int], max_tokens: int,
                    group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recv, counts, handle = m2n_dispatch.eager(x, dest, senders, receivers, max_tokens, group=group_name)
    return recv, counts, handle.routes.clone()


def _role(senders, group_name):
    g = resolve(group_name)
    return g.ranks[g.rank] in senders


@m2n_dispatch_op.register_fake
def _(x, dest, senders, receivers, max_tokens, group_name):
    sender = _role(senders, group_name)
    rows = max_tokens * dest.shape[1]
    return (x.new_empty((0 if sender else len(senders), rows, x.shape[1])),
            x.new_empty((0 if sender else len(senders),), dtype=torch.int32),
            x.new_empty(tuple(dest.shape) if sender else (len(senders),), dtype=torch.int32))


def _world_ranks(ranks, group):
    return [int(r) for r in getattr(ranks, "ranks", ranks)]


@m2n_dispatch.traced
def _(x, dest, senders, receivers, max_tokens, group=None):
    s, r = _world_ranks(senders, group), _world_ranks(receivers, group)
    recv, counts, routes = torch.ops.weft.m2n_dispatch(x, dest, s, r, max_tokens, group_name(group))
    return recv, counts, M2NHandle((x, dest, s, r, max_tokens, group_name(group)), routes)


@m2n_combine.define
def m2n_combine_op(y: torch.Tensor, weights: torch.Tensor, routes: torch.Tensor, x: torch.Tensor, dest: torch.Tensor,
                   senders: list[int], receivers: list[int], max_tokens: int, group_name: str) -> torch.Tensor:
    found = _plan(x, dest, senders, receivers, max_tokens, group_name)
    return m2n_combine.eager(None if found.is_sender else y, weights if found.is_sender else None,
                             M2NHandle(found, routes))


@m2n_combine_op.register_fake
def _(y, weights, routes, x, dest, senders, receivers, max_tokens, group_name):
    return x.new_empty((dest.shape[0] if _role(senders, group_name) else 0, x.shape[1]))


@m2n_combine.traced
def _(y, weights, handle, group=None):
    x, dest, s, r, max_tokens, name = handle.plan
    return torch.ops.weft.m2n_combine(y if y is not None else x, weights if weights is not None else x.new_empty(0),
                                      handle.routes, x, dest, s, r, max_tokens, name)


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    (m2n_dispatch_kernel, dict(x="*bf16", dest="*i64", routes="*i32", recv="*bf16", counts="*i32", buf="*bf16",
                               seg_counts="*i64", flags="*i64", acks="*i64", counter="*i64", pos="*i64", err="*i64",
                               heap="*i64", tokens="i32", hidden="i32", max_rows="i32", senders=("i32",) * m,
                               receivers=("i32",) * n),
     dict(ME=0, M=m, N=n, K=2, SENDER=sender, BLOCK=1024))
    for m, n in ((2, 2),) for sender in (True, False)
] + [
    (m2n_combine_kernel, dict(y="*bf16", weights="*fp32", routes="*i32", counts="*i32", out="*bf16", buf="*bf16",
                              flags="*i64", acks="*i64", counter="*i64", heap="*i64", tokens="i32", hidden="i32",
                              max_rows="i32", senders=("i32",) * m, receivers=("i32",) * n),
     dict(ME=0, M=m, N=n, K=2, SENDER=sender, BLOCK=1024))
    for m, n in ((2, 2),) for sender in (True, False)
]
