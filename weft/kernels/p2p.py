"""Device-initiated point-to-point transfers: send / recv, isend / irecv, batch_isend_irecv.

Semantics are torch.distributed's: a send to rank d matches the next recv from this rank on d, in order; sends
and recvs between the same two ranks are ordered; peers are group ranks. A blocking send returns once its data
sits in the receiver's workspace (it waits only for a free slot), so two ranks that both send a large message
before receiving wait for each other for ever, as with NCCL: exchange through `batch_isend_irecv`, whose one
launch moves all its sends and receives forward together.

Protocol (per group, in its workspace). The kernel runs P programs (P fixed per workspace: WEFT_P2P_PROGRAMS,
else the tuning table's p2p.programs on GPUs, 1 on cpu; the same on every rank of a group, as the workspace size
is), and program p moves part p of every message through a stream of its own: one SM copies a fraction of what
NVLink carries, P of them the whole. A message of n bytes is cut into P parts of equal whole 256-byte blocks, each
at least p2p.part_min_bytes, so a small message is all in part 0 (the other programs carry an empty part) and
only a large one spreads over every program. The parts depend on n alone, the sender's byte count, which every
chunk carries. P is not chosen per message: a receiver whose tensor is not the size sent could not know which of
its programs to run, and one that waited for a part never sent would hang. Each program's stream is the
one-program protocol below, on words and slots of its own, so the programs never wait on each other: program p
waits only on program p of its peers.
Every ordered pair (s, d) has, per program, a ring of SLOTS chunk slots in d's heap (`data[s][slot]`, the
message's byte count in `head[s][slot]`, the chunk's sequence number in `full[s][slot]`) and, in s's heap, a
credit word `credit[d]` (the last chunk d consumed). Chunks are numbered per pair and program from 1 and never
reset (s counts in `sent[d]`, d in `recvd[s]`, both local words), so back-to-back calls and CUDA-graph replays
need no clean-up. A part of b bytes is max(1, cdiv(b, slot bytes)) chunks, each carrying n: an empty part is
one chunk of no data, so every program takes part in every message.
- The sender of chunk k waits until credit[d] >= k - SLOTS (d has copied chunk k - SLOTS out of the slot), writes
  the data and head of slot (k - 1) % SLOTS in d's heap, then releases full = k (`notify`).
- The receiver waits (acquire) for full >= k, reads head and data, copies them out, then releases credit = k
  into s's heap.
Who writes what: a slot's data, head and full only its sender, and only between the receiver's credit for the
chunk before in that slot (acquired) and its own release; the receiver reads them only between that release
(acquired) and its credit (released after its loads). credit and the mismatch words only the receiver. So no
word is ever written by two ranks, and no slot is rewritten while it is read.

Progress: a launch runs rounds in each program. In round r every send op moves chunk r of its pair's stream (the
concatenated chunks of the launch's sends to that peer in this program, in order), then every receive op takes
the next chunk from its peer. Chunk r of a pair is thus sent and taken in round r on both ranks, whatever else
either launch does; sending it needs only the peer's round r - SLOTS, taking it only the peer's round-r sends,
which come first: no cycle, so a batch's exchanges cannot deadlock, in each program alone (the interpreter runs
a rank's programs one after the other: its rule that a program waits only on the same program of its peers holds).

A size mismatch is never a wrong result or a hang: every program of the receiver follows the sender's framing
(the byte count in head sets its part and chunk count), so it drains exactly the sender's chunks and the pair
stays in step; it writes nothing into its tensor. Program 0 records the error in the error word and stores the
byte count it expected into the sender's mismatch word `rerr[d]` (one per peer, program 0's). The receiver's
call raises a ValueError naming both counts; the sender's program 0 moves rerr into its own error word at its
next p2p launch, and raises then (or at `weft.check_errors()`, which reads both). Under the interpreter the
receiver's call raises at once; on GPUs the error words are read at `weft.check_errors()`.

Route on GPUs, per message: the kernel when WEFT_P2P_KERNEL=1, the process group's send / recv (NCCL) when 0;
unset, the kernel for messages of at most `p2p.kernel_max_bytes` (weft.tuning) and NCCL above: on 2x H200
(2026-11-26, CUDA-graph replay) the kernel delivers 4-64 KiB in 8-15 us against NCCL's 27-31, and NCCL moves 16+
MiB at ~350 GB/s where the kernel's 16 programs reach ~100. Both ends route a message by its own byte count, so
in a valid program they agree; each route keeps its messages in order, so a pair's messages still match in
order across routes. (A receiver whose tensor size differs from the sender's across the threshold waits on the
other route: as with NCCL's own mismatched sizes, no error.) `forced_route` picks one route for the calls made
within it (`weft bench p2p` times both). The cpu backend runs the kernel, except within
`forced_route(kernel=False)`: then gloo's send / recv (the tests check that route's code there).

Workspace: the group's p2p workspace lives in its heap's tail, made by each rank at its own first p2p call with
no collective step (weft/runtime/heap.py), so a first send between two members needs nothing of the others. A
group other than the world makes its heap on its first collective use among all members: use such a group once
(any collective op, or weft.empty(..., group=)) before a first transfer between some of its members.

Streams: every p2p launch of a group runs on the group's p2p stream (GPUs), in issue order (the per-pair counters
are the launch's own words); send/recv make the caller's stream wait for it, isend/irecv return a handle whose
`wait()` does. On the cpu backend every call is done when it returns.

Host path of an eager call (what it costs beside the transfer): one plan per batch signature (the tensors'
signatures, the peers, forced_route / WEFT_P2P_KERNEL), made with the full checks and each message's route; a call
that finds it checks only what the key cannot say (a peer that is not an int: 1.0 and True find peer 1's plan; a
receive tensor named twice). The kernel's launch is a `Launch` compiled once per plan, given the tensors'
addresses and the workspace's arguments taken once, on the p2p stream with no stream context; a blocking call
joins the two streams through the workspace's two events (each wait issued right after its record) and needs no
record_stream (the caller's stream waits for the launch before anything can reuse the memory); isend / irecv
record their tensors on the p2p stream and return a fresh event. The process group's route calls isend / irecv
directly for a lone message (no P2POp, no coalescing) and records no event for a blocking call.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import weft.language as wl

from .blocks import copy
from .. import tuning
from ..runtime import settings
from .common import Launch, Plan, as_words, check_tensor, group_name, plan, resolve, signature, workspace
from .registry import declare_op, export

SLOTS = 2  # chunk slots per ordered pair and program: double-buffered
BLOCK = 1024  # words a program moves per step
# The route on GPUs when WEFT_P2P_KERNEL is unset: the process group's send / recv until the kernel's is measured
# there (module doc). The one place that default lives.
CPU_PART_MIN_BYTES = 256  # on the interpreter: any message of more than 256 bytes spreads over the programs


def programs(device: torch.device, world_size: int) -> int:
    """Programs of the kernel (streams per pair): WEFT_P2P_PROGRAMS, else the tuning table's on GPUs, 1 on cpu."""
    found = settings.get("WEFT_P2P_PROGRAMS")
    if found is None:
        found = tuning.value("p2p.programs", device, world_size) if device.type == "cuda" else 1
    if found < 1:
        raise ValueError(f"p2p.programs must be at least 1, got {found}")
    return found


def part_min_bytes(device: torch.device, world_size: int) -> int:
    """Bytes a program's part of a message holds at least (a multiple of 256): the tuning table's on GPUs."""
    found = tuning.value("p2p.part_min_bytes", device, world_size) if device.type == "cuda" else CPU_PART_MIN_BYTES
    return -(-max(found, 1) // 256) * 256


def kernel_route(device: torch.device, nbytes: int, world_size: int) -> bool:
    """Whether a message of `nbytes` on `device` goes through weft's kernel (else the process group's send /
    recv): always on cpu; on GPUs as `forced_route` says within it, else WEFT_P2P_KERNEL, else whether it is at
    most p2p.kernel_max_bytes (module doc)."""
    if _forced:
        return _forced[-1]
    if device.type != "cuda":
        return True
    chosen = settings.get("WEFT_P2P_KERNEL")
    if chosen is not None:
        return bool(chosen)
    return nbytes <= tuning.value("p2p.kernel_max_bytes", device, world_size)


_forced: list[bool] = []


class forced_route:
    """`with forced_route(kernel=True):` send / recv calls made (or captured) within take that route on GPUs
    whatever WEFT_P2P_KERNEL says: for benchmarks that time both."""

    def __init__(self, kernel: bool):
        self.kernel = bool(kernel)

    def __enter__(self):
        _forced.append(self.kernel)
        return self

    def __exit__(self, *exc):
        _forced.pop()
        return False


@triton.jit
def p2p_kernel(sends, recvs, send_peer, send_bytes, send_first, recv_peer, recv_bytes, recv_prev,
               data, head, full, credit, rerr, sent, recvd, state, err, heap, slot_bytes, part_min_bytes,
               NS: tl.constexpr, NR: tl.constexpr, WORD: tl.constexpr, SLOTS: tl.constexpr, STATE: tl.constexpr,
               BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Run this program's stream of the launch's NS sends and NR receives to completion, round by round (module
    doc). Tuples: sends[i] (words) goes to group rank send_peer[i], send_bytes[i] bytes; recvs[i] takes
    recv_bytes[i] bytes from recv_peer[i], after the receive recv_prev[i] (-1: none) of the same peer.
    send_first[p, i]: the round of send i's first chunk in program p's stream. Program p's words: head, full,
    data [p][source][slot], credit, sent, recvd [p][peer], state [p][STATE] (state[2 i], state[2 i + 1]: receive
    i's first round and chunk count, -1 until known); rerr and err are program 0's."""
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    sw = slot_bytes // WORD  # words of a slot
    # This program's stream: its own slots and words, the same offsets on every rank.
    data += pid * world * SLOTS * sw
    head += pid * world * SLOTS
    full += pid * world * SLOTS
    credit += pid * world
    sent += pid * world
    recvd += pid * world
    state += pid * STATE
    if pid == 0:
        for q in range(world):  # mismatches peers reported for my earlier sends
            bad = tl.atomic_add(rerr + q, 0, sem="acquire", scope="sys")
            if bad != 0:
                tl.store(rerr + q, 0)
                tl.store(err + 1, q.to(tl.int64))
                tl.store(err + 2, -1)
                tl.store(err + 3, bad - 1)
                tl.store(err, 2)
    for i in tl.static_range(NR):
        tl.store(state + 2 * i, -1)
        tl.store(state + 2 * i + 1, -1)
    rnd = 0
    busy = 1
    while busy > 0:
        # sent, recvd and state are this program's own words, stored by one thread and loaded by all: the last
        # round's stores must be visible to every thread before they are read again.
        wl.program_sync()
        busy = 0
        for i in tl.static_range(NS):
            peer = send_peer[i]
            nbytes = send_bytes[i]
            lo_b, part = _part(nbytes, pid, programs, part_min_bytes)
            chunks = tl.maximum(tl.cdiv(part, slot_bytes), 1)
            j = rnd - tl.load(send_first + pid * NS + i)
            if (j >= 0) & (j < chunks):
                seq = tl.load(sent + peer) + 1
                slot = (seq - 1) % SLOTS
                wl.wait(credit + peer, 1, seq - SLOTS, wl.CMP_GE, heap=heap, peer=peer, op="send (credit)")
                lo = (lo_b + j * slot_bytes) // WORD
                hi = tl.minimum(lo + sw, (lo_b + part) // WORD)
                dst = wl.symm_at(data + (me * SLOTS + slot) * sw, peer, heap)
                copy(dst - lo, sends[i], lo, hi, BLOCK, VEC)
                tl.store(wl.symm_at(head + me * SLOTS + slot, peer, heap), nbytes.to(tl.int64))
                wl.notify(full + me * SLOTS + slot, peer, heap, seq)
                tl.store(sent + peer, seq)
            if j < chunks - 1:
                busy = 1
        for i in tl.static_range(NR):
            peer = recv_peer[i]
            if tl.load(state + 2 * i) < 0:  # not started: after the previous receive from this peer is done
                ready = 1
                if recv_prev[i] >= 0:
                    p0 = tl.load(state + 2 * recv_prev[i])
                    pn = tl.load(state + 2 * recv_prev[i] + 1)
                    ready = ((p0 >= 0) & (p0 + pn <= rnd)).to(tl.int32)
                if ready > 0:
                    tl.store(state + 2 * i, rnd)
                wl.program_sync()
            start = tl.load(state + 2 * i)
            j = rnd - start
            if start >= 0:
                chunks = tl.load(state + 2 * i + 1)
                if (j == 0) | (j < chunks):
                    seq = tl.load(recvd + peer) + 1
                    slot = (seq - 1) % SLOTS
                    token = wl.wait(full + peer * SLOTS + slot, 1, seq, wl.CMP_GE, heap=heap, peer=peer, op="recv")
                    got = tl.load(wl.consume_token(head + peer * SLOTS + slot, token), volatile=True)
                    want = recv_bytes[i]
                    # The sender's framing: its byte count sets this program's part and chunk count.
                    lo_b, part = _part(got, pid, programs, part_min_bytes)
                    if j == 0:
                        chunks = tl.maximum(tl.cdiv(part, slot_bytes), 1)
                        tl.store(state + 2 * i + 1, chunks)
                        wl.program_sync()
                        if (got != want) & (pid == 0):  # mine and the sender's error words; all drain
                            tl.store(err + 1, peer.to(tl.int64))
                            tl.store(err + 2, got)
                            tl.store(err + 3, want.to(tl.int64))
                            tl.store(err, 1)
                            wl.notify(rerr + me, peer, heap, want.to(tl.int64) + 1)
                    if got == want:
                        lo = (lo_b + j * slot_bytes) // WORD
                        hi = tl.minimum(lo + sw, (lo_b + part) // WORD)
                        src = wl.consume_token(data + (peer * SLOTS + slot) * sw, token)
                        copy(recvs[i], src - lo, lo, hi, BLOCK, VEC)
                    tl.store(recvd + peer, seq)
                    wl.notify(credit + me, peer, heap, seq)
                if j < chunks - 1:
                    busy = 1
            else:
                busy = 1
        rnd += 1


@triton.jit
def _part(nbytes, pid, programs, part_min_bytes):
    """(first byte, bytes) of program `pid`'s part of a message of `nbytes`: equal parts of whole 256-byte blocks,
    each at least part_min_bytes (a multiple of 256), so a small message is all in part 0 and the last parts of
    a middling one are empty."""
    nbytes = nbytes.to(tl.int64)
    each = tl.maximum(tl.cdiv(tl.cdiv(nbytes, programs), 256) * 256, part_min_bytes)
    lo_b = tl.minimum(pid * each, nbytes)
    return lo_b, tl.minimum(each, nbytes - lo_b)


class P2PWorkspace:
    """A group's p2p workspace: per program (stream) and source rank SLOTS chunk slots (data, head, full), per
    program and peer credit words and this rank's chunk counters, per program the launch's receive state; per
    peer the mismatch words, and the error word. On GPUs the p2p stream."""

    MAX_RECVS = 256  # receives one launch may hold (state words)

    def __init__(self, group):
        # In the heap's tail (weft/runtime/heap.py): the same offset on every member and zero since the heap was
        # made, so the two ends of a first transfer make it alone, with no allocation or barrier the other members
        # would have to join (a send between 2 of 4 ranks at first use).
        w = group.size
        self.programs = p = programs(group.device, w)
        self.part_min_bytes = part_min_bytes(group.device, w)
        tail = group.heap.tail()
        n_words = 2 * p * w * SLOTS + 3 * p * w + w + 2 * p * self.MAX_RECVS + 4
        words_bytes = -(-n_words * 8 // 256) * 256
        self.slot_bytes = (tail.numel() - words_bytes) // (p * w * SLOTS) // 256 * 256 if words_bytes < \
            tail.numel() else 0
        if self.slot_bytes < 256:
            raise ValueError(f"the group's p2p workspace ({tail.numel()} bytes: WEFT_WORKSPACE_BYTES) leaves no "
                             f"256-byte slot per peer for {w} ranks and {p} programs (WEFT_P2P_PROGRAMS)")
        self.words = tail[:n_words * 8].view(torch.int64)
        self.data = tail[words_bytes:words_bytes + p * w * SLOTS * self.slot_bytes]
        n = p * w * SLOTS
        self.head, self.full = self.words[:n], self.words[n:2 * n]
        rest = self.words[2 * n:]
        self.credit, self.sent, self.recvd = (rest[k * p * w:(k + 1) * p * w] for k in range(3))
        rest = rest[3 * p * w:]
        self.rerr = rest[:w]
        self.state = rest[w:w + 2 * p * self.MAX_RECVS]
        self.err = rest[w + 2 * p * self.MAX_RECVS:]
        self.stream = torch.cuda.Stream(group.device) if group.device.type == "cuda" else None
        # A blocking call's two stream joins (the p2p stream waits for the caller's, then the caller's for it): each
        # wait is issued right after its record, so one pair of events serves every call.
        self.issued, self.done = (torch.cuda.Event(), torch.cuda.Event()) if self.stream is not None else (None,
                                                                                                        None)
        self.callers: dict = {}  # the caller's stream objects by raw handle: torch.cuda.current_stream costs µs
        self.err_host = self.err.numpy() if group.device.type == "cpu" else None
        group.error_checks.append(self.raise_recorded)

    def caller_stream(self) -> torch.cuda.Stream:
        """The current stream (GPUs): its object made once per stream (a few, reused: the handle names it)."""
        raw = torch._C._cuda_getCurrentRawStream(self.stream.device_index)
        found = self.callers.get(raw)
        if found is None:
            if len(self.callers) >= 64:  # a program making ever new streams
                self.callers.clear()
            found = self.callers[raw] = torch.cuda.current_stream(self.stream.device)
        return found

    def raise_recorded(self, reported: bool = True) -> None:
        """The ValueError for a size mismatch this rank's kernels recorded (cleared as it is raised); with
        `reported`, also one a receiver reported into rerr that no launch has moved into err yet."""
        if not reported and self.err_host is not None and not self.err_host[0]:
            return  # the cpu backend's check after every launch: one load, no tensor op
        code, peer, got, want = (int(v) for v in self.err.tolist())
        if code == 0:
            if not reported:
                return
            bad = [(q, int(v)) for q, v in enumerate(self.rerr.tolist()) if v]
            if not bad:
                return
            self.rerr.zero_()
            (peer, v), code, got, want = bad[0], 2, -1, bad[0][1] - 1
        self.err.zero_()
        if code == 1:
            raise ValueError(f"weft.ops.recv: group rank {peer} sent a message of {got} bytes, but this rank's recv "
                             f"tensor has {want} bytes (nothing was written into it)")
        raise ValueError(f"weft.ops.send: group rank {peer} received a message of this rank into a tensor of {want} "
                         "bytes, which is not the size sent")


def _workspace(group) -> P2PWorkspace:
    return workspace(group, "p2p", P2PWorkspace)


def check_batch(group, sends, recvs) -> None:
    """A batch's peers, tensors and receive list, checked before anything moves."""
    w = group.size
    for kind, items in (("send", sends), ("recv", recvs)):
        for t, peer in items:
            check_tensor("tensor", t, group, contiguous=False)
            if isinstance(peer, bool) or not isinstance(peer, int):
                raise TypeError(f"{kind}: the peer must be an int group rank, got {type(peer).__name__}")
            if not 0 <= peer < w:
                raise ValueError(f"{kind}: peer {peer} is not a rank of the group of {w} ranks")
            if peer == group.rank:
                raise ValueError(f"{kind}: peer {peer} is this rank (a rank cannot {kind} to itself)")
    if len(recvs) > P2PWorkspace.MAX_RECVS:
        raise ValueError(f"a batch takes at most {P2PWorkspace.MAX_RECVS} receives, got {len(recvs)}")
    _distinct(sends, recvs)


def _distinct(sends, recvs) -> None:
    for t, _ in recvs:
        if any(t is u for u, _ in sends) or sum(t is u for u, _ in recvs) > 1:
            raise ValueError("a recv tensor is also sent or received again in the same batch")


class P2PPlan(Plan):
    """A batch of one signature (its tensors' signatures and peers, and what the routes depend on): its checks, the
    route of each message (GPUs, or `forced_route`) and the kernel's launch of the messages it carries."""

    def __init__(self, group, sends, recvs):
        super().__init__(group)
        check_batch(group, sends, recvs)
        route = lambda ops: [kernel_route(group.device, t.numel() * t.element_size(), group.size)  # noqa: E731
                             for t, _ in ops]
        self.send_kernel, self.recv_kernel = route(sends), route(recvs)
        self.one_route = len(set(self.send_kernel + self.recv_kernel)) == 1  # no split to make per call
        self.kernel = _KernelLaunch(group, *_routed(sends, recvs, self.send_kernel, self.recv_kernel, True)) \
            if any(self.send_kernel) or any(self.recv_kernel) else None

    def recheck(self, sends, recvs) -> None:
        """What a call that found this plan must still be checked for: the peers' type (the key took them by value:
        1.0 and True find the plan of 1) and that no receive tensor is also sent or received again."""
        for _, peer in sends + recvs:
            if type(peer) is not int:
                check_batch(self.group, sends, recvs)
                return
        if recvs and len(sends) + len(recvs) > 1:
            _distinct(sends, recvs)

    def run(self, sends, recvs, blocking: bool):
        """Launch the batch; on GPUs the event that ends it (None where `blocking`: the caller's stream waits for
        it already), None on cpu (done)."""
        if self.one_route:
            if self.kernel is not None:
                return self.kernel.run([t for t, _ in sends], [t for t, _ in recvs], blocking)
            return _run_process_group(self.group, sends, recvs, blocking)
        k_sends, k_recvs = _routed(sends, recvs, self.send_kernel, self.recv_kernel, True)
        pg_sends, pg_recvs = _routed(sends, recvs, self.send_kernel, self.recv_kernel, False)
        _run_process_group(self.group, pg_sends, pg_recvs, True)
        event = self.kernel.run([t for t, _ in k_sends], [t for t, _ in k_recvs], blocking)
        if event is None:
            return None
        torch.cuda.current_stream(self.group.device).wait_event(event)  # one event that ends both
        return _recorded(self.group.device)


def _routed(sends, recvs, send_kernel, recv_kernel, kernel: bool):
    """(sends, recvs) of a batch that take the kernel's route (`kernel`), else the process group's, in order."""
    return ([op for op, k in zip(sends, send_kernel) if k == kernel],
            [op for op, k in zip(recvs, recv_kernel) if k == kernel])


class _KernelLaunch:
    """The kernel's launch of a batch's messages of one signature: word size, the rounds of each send in each
    program's stream, the order of each peer's receives, the arguments that are the same every call. A call
    passes its tensors only: on GPUs their addresses straight to the compiled kernel (`Launch`), on the group's
    p2p stream."""

    def __init__(self, group, sends, recvs):
        self.ws = ws = _workspace(group)
        nbytes = [t.numel() * t.element_size() for t, _ in sends + recvs]
        # Non-contiguous tensors are staged through fresh (aligned) copies: only the contiguous ones' addresses count.
        addresses = [t.data_ptr() for t, _ in sends + recvs if t.is_contiguous()]
        aligned = all(n % 4 == 0 for n in nbytes) and all(a % 4 == 0 for a in addresses)
        self.word = torch.int32 if aligned else torch.uint8
        # 16-byte vectors where every address allows (parts and chunks start at multiples of 256 bytes).
        vec = 4 if aligned and all(a % 16 == 0 for a in addresses) else 1
        self.ns, self.nr = len(sends), len(recvs)
        self.send_contig = [t.is_contiguous() for t, _ in sends]
        self.recv_contig = [t.is_contiguous() for t, _ in recvs]
        self.contig = all(self.send_contig) and all(self.recv_contig)
        self.send_empty = [n == 0 for n in nbytes[:self.ns]]
        self.recv_empty = [n == 0 for n in nbytes[self.ns:]]
        send_peer = tuple(p for _, p in sends)
        send_bytes = tuple(nbytes[:self.ns])
        # send_first[p][i]: the round of send i's first chunk in program p's stream to its peer (the chunks of the
        # launch's earlier sends to that peer come first).
        firsts = []
        for pid in range(ws.programs):
            row, stream_len = [], {}
            for peer, n in zip(send_peer, send_bytes):
                row.append(stream_len.get(peer, 0))
                stream_len[peer] = row[-1] + part_chunks(n, pid, ws)
            firsts.append(row or [0])
        self.send_first = torch.tensor(firsts, dtype=torch.int32, device=group.device)
        recv_peer = tuple(p for _, p in recvs)
        prev, last = [], {}
        for i, p in enumerate(recv_peer):
            prev.append(last.get(p, -1))
            last[p] = i
        data = ws.data.view(self.word)
        # A tuple argument may not be empty: an unused placeholder then (NS / NR say how many are real).
        self.tuples = (send_peer or (0,), send_bytes or (0,))
        fixed = (self.send_first, recv_peer or (0,), tuple(nbytes[self.ns:]) or (0,), tuple(prev) or (0,), data,
                 ws.head, ws.full, ws.credit, ws.rerr, ws.sent, ws.recvd, ws.state, ws.err, group.heap.descriptor,
                 ws.slot_bytes, ws.part_min_bytes)
        # Compiled (GPUs) for the first call's tensors; its key (the batch's signatures) fixes their alignment.
        first_sends = tuple(self._words(t if c else t.contiguous()) if t.numel() else data[:0]
                            for (t, _), c in zip(sends, self.send_contig)) or (data[:0],)
        first_recvs = tuple(self._words(t if c else torch.empty(t.shape, dtype=t.dtype, device=t.device))
                            if t.numel() else data[:0] for (t, _), c in zip(recvs, self.recv_contig)) or (data[:0],)
        self.launch = Launch(p2p_kernel, (ws.programs,), (first_sends, first_recvs, *self.tuples, *fixed),
                             dict(NS=self.ns, NR=self.nr, WORD=self.word.itemsize, SLOTS=SLOTS,
                                  STATE=2 * ws.MAX_RECVS, BLOCK=BLOCK, VEC=vec))
        # What a call passes for a tensor: under the interpreter its words (the kernel's pointer type), on GPUs its
        # address; the workspace's arguments so taken once.
        interpreted = self.launch.kernel is None
        self.pointer = self._words if interpreted else torch.Tensor.data_ptr
        self.nothing = data[:0] if interpreted else data.data_ptr()
        self.fixed = self.launch.arguments(fixed)

    def _words(self, t):
        return as_words(t).view(self.word)

    def run(self, send_tensors, recv_tensors, blocking: bool):
        ws, ptr, nothing = self.ws, self.pointer, self.nothing
        if self.contig:
            staged_sends, staged = send_tensors, recv_tensors
        else:
            staged_sends = [t if c else t.contiguous() for t, c in zip(send_tensors, self.send_contig)]
            staged = [t if c else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                      for t, c in zip(recv_tensors, self.recv_contig)]
        sends = tuple(nothing if e else ptr(t) for t, e in zip(staged_sends, self.send_empty)) or (nothing,)
        recvs = tuple(nothing if e else ptr(t) for t, e in zip(staged, self.recv_empty)) or (nothing,)
        stream = ws.stream
        if stream is None:
            self.launch(sends, recvs, *self.tuples, *self.fixed)
            for t, buf in zip(recv_tensors, staged):
                if buf is not t:
                    t.copy_(buf)
            # The interpreter ran the launch: its errors are known now. Not a receiver's report of this launch's
            # send, which may or may not have arrived yet: the next launch or weft.check_errors() raises that.
            ws.raise_recorded(reported=False)
            return None
        # The p2p stream waits for the caller's (the tensors' producers), runs the launch, and the caller's waits
        # for it (blocking) or the returned event does.
        current = ws.caller_stream()
        ws.issued.record(current)
        stream.wait_event(ws.issued)
        self.launch.on(stream, sends, recvs, *self.tuples, *self.fixed)
        if not self.contig:
            with torch.cuda.stream(stream):
                for t, buf in zip(recv_tensors, staged):
                    if buf is not t:
                        t.copy_(buf)
        if blocking:
            # The caller's stream waits for the launch before its next work: its tensors (and the staged copies,
            # freed to it) are not reused before the launch is done, with no record_stream.
            ws.done.record(stream)
            current.wait_event(ws.done)
            return None
        for t in (*send_tensors, *recv_tensors, *staged_sends, *staged):
            t.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event


def part_chunks(nbytes: int, pid: int, ws: P2PWorkspace) -> int:
    """Chunks of program `pid`'s part of a message of `nbytes` (the kernel's `_part`): at least one."""
    each = max(-(-(-(-nbytes // ws.programs)) // 256) * 256, ws.part_min_bytes)
    part = max(0, min(each, nbytes - pid * each))
    return max(1, -(-part // ws.slot_bytes))


def _run_process_group(group, sends, recvs, blocking: bool):
    """The messages of a (checked) batch that the process group's send / recv take (module doc: the large ones on
    GPUs); on GPUs the event on the caller's stream that ends them (None where `blocking`: that stream waits for
    them already), None on cpu."""
    pg, staged = group.process_group, []
    # One message alone goes by the plain call: batch_isend_irecv's coalescing (and P2POp's checks) cost tens of
    # µs of host time.
    if len(sends) + len(recvs) == 1:
        if sends:
            t, p = sends[0]
            works = [dist.isend(t.contiguous(), group=pg, group_dst=p)]
        else:
            t, p = recvs[0]
            buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            staged.append((t, buf))
            works = [dist.irecv(buf, group=pg, group_src=p)]
    else:
        ops = [dist.P2POp(dist.isend, t.contiguous(), group=pg, group_peer=p) for t, p in sends]
        for t, p in recvs:
            buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            staged.append((t, buf))
            ops.append(dist.P2POp(dist.irecv, buf, group=pg, group_peer=p))
        works = dist.batch_isend_irecv(ops)
    for work in works:
        work.wait()  # the caller's stream waits for NCCL's (gloo: the transfer is done)
    for t, buf in staged:
        if buf is not t:
            t.copy_(buf)
    return None if blocking else _recorded(group.device)


def _recorded(device: torch.device):
    """An event recorded on the current stream on GPUs; None on cpu (no streams: what was issued is done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _route_setting(device: torch.device):
    """What a message's route depends on besides its size, for the plan key: forced_route's innermost choice, else
    on GPUs WEFT_P2P_KERNEL as set (read per call, as kernel_route does; on cpu it does not count)."""
    if _forced:
        return _forced[-1]
    return os.environ.get("WEFT_P2P_KERNEL") if device.type == "cuda" else None


def _run(group, sends, recvs, blocking: bool = False):
    """Launch `sends` [(tensor, peer)] and `recvs` as one batch on `group`; the GPU event that ends it (None on
    cpu, where it has run, and where `blocking`: the caller's stream waits for it already)."""
    g = resolve(group)
    key = lambda: ("p2p", _route_setting(g.device), tuple((signature(t), p) for t, p in sends),  # noqa: E731
                   tuple((signature(t), p) for t, p in recvs))
    found = plan(g, key, lambda: P2PPlan(g, sends, recvs))
    found.recheck(sends, recvs)
    return found.run(sends, recvs, blocking)


@export
class P2PWork:
    """What isend / irecv / batch_isend_irecv return: `wait()` makes the current stream wait for the transfer
    (on cpu it is done already); `is_completed()` says whether it has finished."""

    def __init__(self, event=None):
        self.event = event

    def wait(self, timeout=None) -> bool:
        if self.event is not None:
            torch.cuda.current_stream(self.event.device if hasattr(self.event, "device") else None).wait_event(
                self.event)
        return True

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()


@declare_op(collective=True)
def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Send `tensor` (any shape, dtype and layout) to group rank `dst` of `group` (default: the world), whose
    matching `recv` takes it, bit-exact. Device-initiated: no host sync, CUDA-graph capturable; ordered on the
    caller's stream. Returns once the data is in the receiver's workspace (messages larger than a slot move in
    chunks as the receiver frees slots)."""
    _run(group, [(tensor, dst)], [], blocking=True)


@declare_op(collective=True)
def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Receive the next message group rank `src` sends to this rank into `tensor` (any layout; its bytes must be
    the sent tensor's bytes: a mismatch raises a ValueError on both ranks and leaves `tensor` unchanged)."""
    _run(group, [], [(tensor, src)], blocking=True)


@declare_op(collective=True)
def isend(tensor: torch.Tensor, dst: int, group=None) -> P2PWork:
    """`send` returning a P2PWork at once: the transfer runs on the group's p2p stream, `wait()` joins it."""
    return P2PWork(_run(group, [(tensor, dst)], []))


@declare_op(collective=True)
def irecv(tensor: torch.Tensor, src: int, group=None) -> P2PWork:
    """`recv` returning a P2PWork at once: `tensor` holds the message once the current stream waited on it."""
    return P2PWork(_run(group, [], [(tensor, src)]))


@export
class P2POp:
    """One entry of batch_isend_irecv: `op` weft.ops.isend / irecv (or torch.distributed's), `tensor`, `peer` (a
    group rank), `group` (default: the world). torch.distributed.P2POp entries are taken too (their `peer` a
    world rank, as torch has it)."""

    def __init__(self, op, tensor: torch.Tensor, peer: int, group=None):
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


def _kind(op) -> str:
    if op in (isend, dist.isend, send, dist.send):
        return "send"
    if op in (irecv, dist.irecv, recv, dist.recv):
        return "recv"
    raise ValueError(f"batch_isend_irecv: op must be isend or irecv, got {op!r}")


def _split(p2p_ops, group=None):
    """(group, sends, recvs) of a batch's entries, peers as group ranks; `group`, if given, must be theirs."""
    if not isinstance(p2p_ops, (list, tuple)) or not p2p_ops:
        raise ValueError("batch_isend_irecv takes a non-empty list of P2POp entries")
    groups = {id(e.group) for e in p2p_ops if hasattr(e, "op")}
    if len(groups) != 1 or not all(hasattr(e, "op") and hasattr(e, "tensor") for e in p2p_ops):
        raise ValueError("batch_isend_irecv: every entry must be a P2POp, all of one group")
    g = resolve(p2p_ops[0].group)
    if group is not None and resolve(group) is not g:
        raise ValueError(f"group is {resolve(group)!r}, but the entries' group is {g!r}")
    sends, recvs = [], []
    for e in p2p_ops:
        peer = e.peer
        if isinstance(e, dist.P2POp):  # torch's peers are world ranks (group_peer: the group rank)
            peer = e.group_peer if getattr(e, "group_peer", None) is not None else g.ranks.index(peer) \
                if peer in g.ranks else -1
        (sends if _kind(e.op) == "send" else recvs).append((e.tensor, peer))
    return g, sends, recvs


@declare_op(collective=True)
def batch_isend_irecv(p2p_ops: list, group=None) -> list:
    """Run a list of P2POp (isend / irecv entries of one group) as one launch whose sends and receives progress
    together: exchanges of any size cannot deadlock. Returns one P2PWork per entry (one event: they end together).
    Entries to the same peer keep their order. `group`: default the entries' (as torch's, which takes none);
    another raises."""
    g, sends, recvs = _split(p2p_ops, group)
    work = P2PWork(_run(g, sends, recvs))
    return [work] * len(p2p_ops)


# -- the operators: by group name; recv and batch_isend_irecv mutate their receive tensors --------------------------

@send.define
def send_op(tensor: torch.Tensor, dst: int, group_name: str) -> None:
    send.eager(tensor, dst, group=group_name)


@send_op.register_fake
def _(tensor, dst, group_name):
    return None


@send.traced
def _(tensor, dst, group=None):
    torch.ops.weft.send(tensor, dst, group_name(group))


@recv.define(mutates_args=("tensor",))
def recv_op(tensor: torch.Tensor, src: int, group_name: str) -> None:
    recv.eager(tensor, src, group=group_name)


@recv_op.register_fake
def _(tensor, src, group_name):
    return None


@recv.traced
def _(tensor, src, group=None):
    torch.ops.weft.recv(tensor, src, group_name(group))


@isend.define
def isend_op(tensor: torch.Tensor, dst: int, group_name: str) -> None:
    send.eager(tensor, dst, group=group_name)


@isend_op.register_fake
def _(tensor, dst, group_name):
    return None


@isend.traced
def _(tensor, dst, group=None):
    # Traced, the transfer is one node of the graph, ordered on its stream: the handle is done.
    torch.ops.weft.isend(tensor, dst, group_name(group))
    return P2PWork()


@irecv.define(mutates_args=("tensor",))
def irecv_op(tensor: torch.Tensor, src: int, group_name: str) -> None:
    recv.eager(tensor, src, group=group_name)


@irecv_op.register_fake
def _(tensor, src, group_name):
    return None


@irecv.traced
def _(tensor, src, group=None):
    torch.ops.weft.irecv(tensor, src, group_name(group))
    return P2PWork()


@batch_isend_irecv.define(mutates_args=("recv_tensors",))
def batch_isend_irecv_op(send_tensors: list[torch.Tensor], send_peers: list[int], recv_tensors: list[torch.Tensor],
                         recv_peers: list[int], group_name: str) -> None:
    _run(group_name, list(zip(send_tensors, send_peers)), list(zip(recv_tensors, recv_peers)), blocking=True)


@batch_isend_irecv_op.register_fake
def _(send_tensors, send_peers, recv_tensors, recv_peers, group_name):
    return None


@batch_isend_irecv.traced
def _(p2p_ops, group=None):
    g, sends, recvs = _split(p2p_ops, group)
    torch.ops.weft.batch_isend_irecv([t for t, _ in sends], [p for _, p in sends], [t for t, _ in recvs],
                                     [p for _, p in recvs], g.name)
    return [P2PWork()] * len(p2p_ops)


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    (p2p_kernel, dict(sends=("*i32",) * ns, recvs=("*i32",) * nr, send_peer=("i32",) * ns, send_bytes=("i64",) * ns,
                      send_first="*i32", recv_peer=("i32",) * nr, recv_bytes=("i64",) * nr,
                      recv_prev=("i32",) * nr, data="*i32", head="*i64", full="*i64", credit="*i64", rerr="*i64",
                      sent="*i64", recvd="*i64", state="*i64", err="*i64", heap="*i64", slot_bytes="i64",
                      part_min_bytes="i64"),
     dict(NS=ns, NR=nr, WORD=4, SLOTS=SLOTS, STATE=2 * P2PWorkspace.MAX_RECVS, BLOCK=BLOCK, VEC=vec))
    for ns, nr, vec in ((1, 1, 4), (2, 2, 1))
]
