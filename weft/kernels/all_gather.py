"""All-gather through the symmetric heap: push (write into peers) and pull (read from peers).

out[r * n : (r + 1) * n] = x on rank r, for every rank r.

The shard is split into one slice per program. Program p of every rank
handles slice p only and waits only on program p of its peers, so programs
never wait on a later program of their own grid (the interpreter runs them
one after another).

One workspace serves every call whatever its size (`AllGatherWorkspace`): a
data region in two halves used by call parity (push: W slots of the shard;
pull: my staged shard), flags per program slot, and one epoch counter
(`wl.next_epoch`: every call takes the next epoch, the same in all its
programs; flags are compared with >=, never reset). Rank s writes half
e % 2 on rank q in call e only after its call e - 1 ended, in which its
programs (0, i) waited for a signal of every rank's call e - 1, sent after
that rank's call e - 2, the last reader of the half, had completed. Shards
larger than a half go through in passes. Into a symmetric output the push
writes straight into the peers' `out`, after a handshake per call.

Flags per program slot: push [ready, arrived] per peer pair; pull ready[W].

They stay hand-written rather than on the tile primitives
(`weft.language.tile`), for the reasons all_reduce.py gives for its family
(program slots and per-call epochs, not data tiles; parts of runtime size
streamed in 16-byte vectors, not constexpr blocks), and two of their own:
push's `ready` is a call-level handshake (the peer's symmetric `out` is free
again), not a tile's arrival, and its flags are indexed by peer pair, so the
same tile's flag sits at a different index on every rank; pull polls its own
copy of each rank's flag (raised everywhere by `notify_all`), where
`tile_pull` polls the owner's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning

from ..runtime.backend import INTERPRET
from . import hierarchical
from .blocks import copy
from .common import (Launch, Plan, as_words, check_method, check_out, check_tensor, group_name, group_size,
                     nccl_all_gather, nccl_from, out_kind, overlaps, plan, resolve, signature, signature_words,
                     signatures, workspace, zero_everywhere)
from .registry import declare_op, fresh, into

METHODS = ("auto", "push", "pull", "nccl")


@triton.jit(do_not_specialize=["n", "chunk", "out_stride", "half_len", "fp"])
def all_gather_push_kernel(x, gathered, out, flags, counter, heap, n, chunk, out_stride, half_len, sig, err, fp,
                           COPY_OUT: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Program (p, i) pairs me with rank q = (i - me) mod W, and q's program (p, i) pairs back
    with me: it pushes my slice p into q's buffer and waits for q's slice p to arrive in mine.
    All peers are served in parallel, one program each, so a small gather costs one round trip.
    Rank r's shard lands at out + r * out_stride.

    COPY_OUT: `gathered` is the workspace's data region (W slots of n in half epoch % 2) and
    the slice is copied to `out` afterwards (no handshake: see the module doc). Otherwise
    `gathered` is the caller's symmetric output, which q may still be reading: wait until q
    says it is free ("ready") before writing; the signatures are checked before that wait (a peer's `out`
    takes no push from a call that does not match), and with COPY_OUT before the wait for q's slice.
    """
    p = tl.program_id(0)
    i = tl.program_id(1)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        q = (i - me + world) % world
        f = flags + (p * world + i) * 2  # [ready from q, arrived from q]
        lo = p * chunk
        hi = tl.minimum(lo + chunk, n)
        if COPY_OUT:
            buf = gathered + (epoch % 2) * half_len
            copy(wl.symm_at(buf, q, heap) + me * n, x, lo, hi, BLOCK, VEC)
            wl.notify(f + 1, q, heap, epoch)
            if wl.check_signed(sig, epoch, fp, heap, err, op="all_gather push"):
                token = wl.wait(f + 1, 1, epoch, wl.CMP_GE, heap=heap, peer=q, op="all_gather push")
                copy(out + q * out_stride, wl.consume_token(buf, token) + q * n, lo, hi, BLOCK, VEC)
        else:
            wl.notify(f, q, heap, epoch)
            if wl.check_signed(sig, epoch, fp, heap, err, op="all_gather push"):
                token = wl.wait(f, 1, epoch, wl.CMP_GE, heap=heap, peer=q, op="all_gather push (ready)")
                buf = wl.consume_token(gathered, token)
                copy(wl.symm_at(buf, q, heap) + me * out_stride, x, lo, hi, BLOCK, VEC)
                wl.notify(f + 1, q, heap, epoch)
                wl.wait(f + 1, 1, epoch, wl.CMP_GE, heap=heap, peer=q, op="all_gather push")


@triton.jit(do_not_specialize=["n", "chunk", "out_stride", "half_len", "fp"])
def all_gather_pull_kernel(x, stage, out, flags, counter, heap, n, chunk, out_stride, half_len, sig, err, fp,
                           BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Publish my slice in my `stage` (half epoch % 2), then read every rank's slice into `out`."""
    p = tl.program_id(0)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        ready = flags + p * world
        half = stage + (epoch % 2) * half_len
        lo = p * chunk
        hi = tl.minimum(lo + chunk, n)
        copy(half, x, lo, hi, BLOCK, VEC)
        wl.notify_all(ready + me, heap, epoch)
        if wl.check_signed(sig, epoch, fp, heap, err, op="all_gather pull"):
            for i in range(world):
                q = (me + 1 + p + i) % world
                token = wl.wait(ready + q, 1, epoch, wl.CMP_GE, heap=heap, peer=q, op="all_gather pull")
                src = wl.consume_token(wl.symm_at(half, q, heap), token)
                copy(out + q * out_stride, src, lo, hi, BLOCK, VEC)


# On GPUs a program moves its part of the shard block after block, so a part too large makes the call as slow
# as one SM's stores (push) or its round trips of remote loads (pull): the shard bytes per program and the
# most programs (per peer for push) are measured settings (weft.tuning: all_gather.push_program_bytes,
# push_max_programs, pull_program_bytes; their runs are in weft/tuning/data/).


def _launch_shape(method: str, nbytes: int, device: torch.device, world_size: int) -> tuple[int, int, int]:
    """(programs, BLOCK words, num_warps) for a shard of `nbytes`: grid rows of pull, or of push
    (which has one column per peer)."""
    if device.type != "cuda":
        return min(4, max(1, nbytes // 4096)), 1024, 4
    if method == "push":
        most = min(MAX_PROGRAMS, tuning.value("all_gather.push_max_programs", device, world_size))
        return max(1, min(most, nbytes // tuning.value("all_gather.push_program_bytes", device, world_size))), 2048, 8
    return max(1, min(MAX_PROGRAMS, nbytes // tuning.value("all_gather.pull_program_bytes", device, world_size))), \
        2048, 8


def _vector_width(n: int, stride: int, *tensors: torch.Tensor) -> int:
    """Words per 16-byte access if every slice boundary and base is 16-byte aligned, else 1."""
    words = 16 // tensors[0].element_size()
    aligned = n % words == 0 and stride % words == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
    return words if aligned else 1


# Program slots of the workspace's flags: the most programs (per peer, for push) the launch rule uses.
MAX_PROGRAMS = 64


class AllGatherWorkspace:
    """The all_gather workspace: a data region in two halves (by call parity), flags per program slot
    (push: [ready, arrived] per peer pair; pull: ready[W]), the epoch counter, the signature words and the
    group's SignatureWord (`errors`)."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        self.half_bytes = group.workspace_bytes // 2 // 256 * 256
        self.data = heap.empty((2 * self.half_bytes,), torch.uint8)
        self.push_flags = heap.empty((MAX_PROGRAMS * w * 2,), torch.int32)
        self.pull_flags = heap.empty((MAX_PROGRAMS * w,), torch.int32)
        self.counter = heap.empty((1,), torch.int64)
        self.sig = signature_words(group, w)
        self.errors = signatures(group)
        self.errors.register(self.sig, self.counter)
        zero_everywhere(group, self.push_flags, self.pull_flags, self.counter, self.sig)

    def data_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        return self.data.view(dtype), self.half_bytes // dtype.itemsize


# "auto" hands shards of at least all_gather.nccl_above.<output kind> bytes (weft.tuning) to the process group's
# all_gather (NCCL): where NCCL measured faster. Into a plain output that is only the largest shards; with no
# output given NCCL's call costs ~10 us more (its output, allocated per call, is recorded on NCCL's stream);
# into a symmetric output push was ahead at every size measured.


@declare_op(tensors=("x", "out"), collective=True)
def all_gather(x: torch.Tensor, out: torch.Tensor | None = None, method: str = "auto", group=None) -> torch.Tensor:
    """Gather `x` from every member of `group` (default: the world) along dim 0: returns
    (group size * x.shape[0], *x.shape[1:]), member i's `x` at rows [i * x.shape[0], (i + 1) * x.shape[0]).

    Any dtype, shape and layout. method: "push" writes into peers' symmetric
    buffers (zero-copy when `out` is itself symmetric, from `weft.empty` with the
    same group); "pull" reads peers' staged slices straight into `out`; "nccl" is
    the process group's own all_gather; "auto" is push, or NCCL for large shards
    into a plain output (where it is measured faster). Shards larger than the
    workspace go through in passes. On a group of one: a copy of x (into `out`, or
    a fresh tensor), no kernel. Collective over the group.
    """
    g = resolve(group)
    found = plan(g, lambda: ("all_gather", signature(x), method, out_kind(g, out),
                             None if out is None else signature(out)),
                 lambda: AllGatherPlan(g, x, out, method))
    return found.run(x, out)


class AllGatherPlan(Plan):
    """An all_gather of one signature: no data, the process group's collective, or the kernel's passes."""

    def __init__(self, group, x, out, method):
        super().__init__(group)
        check_tensor("x", x, group, contiguous=False)
        check_method(method, METHODS)
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension")
        w = group.size
        self.shape = shape = (w * x.shape[0], *x.shape[1:])
        if out is not None:
            check_out(out, shape, x.dtype, group)
            self.check_overlap(x, out)  # before the workspace is made
        self.has_out = out is not None
        if w == 1:  # before anything that would make the group's heap
            self.run = self.run_alone
            return
        if group.topology.spans_nodes:
            h = hierarchical.hierarchy(group)
            if method != "nccl" and h is not None:  # weft/kernels/hierarchical.py
                self.run = hierarchical.AllGather(group, h, shape, x.dtype, self._check_out).run
                return
            method = "nccl"  # nodes of unequal member counts: no rails
        self.x_contig = x.is_contiguous()
        self.out_contig = out is None or out.is_contiguous()
        symmetric = out is not None and self.out_contig and group.heap.contains(out)
        nbytes = x.numel() * x.element_size()
        if method == "auto":
            kind = "symmetric" if symmetric else "none" if out is None else "plain"
            method = "nccl" if nbytes >= nccl_from(f"all_gather.nccl_above.{kind}", group) else "push"
        self.dtype, self.device = x.dtype, x.device  # not x itself: a plan keeps no caller tensor
        if nbytes == 0:
            self.run = self.run_empty
        elif method == "nccl":
            self.run = self.run_nccl
        else:
            self.prepare_passes(group, x, out, method, symmetric)

    def _check_out(self, x, out):
        if self.has_out:
            self.check_overlap(x, out)

    def check_overlap(self, x, out):
        if overlaps(x, out):
            raise ValueError("out overlaps x: pass a separate tensor")

    def result(self, out):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device) if out is None else out

    def run_alone(self, x, out):
        """A group of one: the gather of one shard is the shard (one copy, no kernel, no workspace)."""
        if self.has_out:
            self.check_overlap(x, out)
            return out.copy_(x)
        return x.clone(memory_format=torch.contiguous_format)

    def run_empty(self, x, out):
        if self.has_out:
            self.check_overlap(x, out)
        return self.result(out)

    def run_nccl(self, x, out):
        if self.has_out:
            self.check_overlap(x, out)
        res = self.result(out)
        dst = res if self.out_contig else torch.empty(self.shape, dtype=x.dtype, device=x.device)
        nccl_all_gather(dst, x if self.x_contig else x.contiguous(), self.group.process_group)
        if dst is not res:
            res.copy_(dst)
        return res

    def prepare_passes(self, group, x, out, method, symmetric):
        """The kernel's launches: one pass per workspace-sized part of the shard."""
        w = group.size
        ws = _workspace(group)
        xw = as_words(x if self.x_contig else torch.empty(x.shape, dtype=x.dtype, device=x.device))
        sample_out = out if self.out_contig and out is not None else \
            torch.empty(self.shape, dtype=x.dtype, device=x.device)
        ow = as_words(sample_out)
        if xw.dtype != ow.dtype:  # alignment differs: move bytes
            xw, ow = xw.view(torch.uint8), ow.view(torch.uint8)
        self.word = xw.dtype
        n = xw.numel()
        zero_copy = method == "push" and symmetric
        # The word size follows x's and out's alignment (as_words): members that differ in it split the shard's
        # bytes differently, which the signature check reports.
        fp = self.sign("all_gather", bytes=n * xw.element_size(), word=str(self.word).removeprefix("torch."),
                       method=method + (" into a symmetric out" if zero_copy else ""))
        self.errors = ws.errors
        buf, half_len = ws.data_as(self.word)
        most = half_len if method == "pull" else half_len // w
        most = max(16, most // 16 * 16)
        heap = group.heap.descriptor
        self.passes = []
        for lo in range(0, n, most):
            hi = min(lo + most, n)
            k = hi - lo
            programs, block, warps = _launch_shape(method, k * xw.element_size(), x.device, w)
            chunk = triton.cdiv(triton.cdiv(k, programs), block) * block  # whole blocks but the last
            vec = _vector_width(k, n, xw[lo:hi], ow[lo:], *([] if zero_copy else [buf]))
            if method == "push":
                grid = (programs, w)
                kernel, flags, consts = all_gather_push_kernel, ws.push_flags, dict(COPY_OUT=not zero_copy)
            else:
                grid = (programs,)
                kernel, flags, consts = all_gather_pull_kernel, ws.pull_flags, {}

            def args(xs, os, f, k=k, chunk=chunk):
                return (xs, os if zero_copy else f[0], os, f[1], f[2], f[3], k, chunk, n, half_len, f[4], f[5], fp)
            fixed = (buf, flags, ws.counter, heap, ws.sig, ws.errors.tensor)
            launch = Launch(kernel, grid, args(xw[lo:hi], ow[lo:], fixed), dict(**consts, BLOCK=block, VEC=vec),
                            warps)
            self.passes.append((lo, hi, launch, args, tuple(map(launch.address, fixed))))  # GPUs: addresses, once
        self.run = self.run_one_launch if len(self.passes) == 1 and self.x_contig and self.out_contig and \
            not INTERPRET else self.run_passes

    def run_one_launch(self, x, out):
        if self.has_out:
            self.check_overlap(x, out)
        res = self.result(out)
        _, _, launch, args, fixed = self.passes[0]
        launch(*args(launch.address(x), launch.address(res), fixed))
        self.errors.raise_recorded()
        return res

    def run_passes(self, x, out):
        if self.has_out:
            self.check_overlap(x, out)
        res = self.result(out)
        dst = res if self.out_contig else torch.empty(self.shape, dtype=x.dtype, device=x.device)
        xs = as_words(x if self.x_contig else x.contiguous()).view(self.word)
        os = as_words(dst).view(self.word)
        for lo, hi, launch, args, fixed in self.passes:
            launch(*args(xs[lo:hi], os[lo:], fixed))
            self.errors.raise_recorded()
        if dst is not res:
            res.copy_(dst)
        return res


def _workspace(group) -> AllGatherWorkspace:
    return workspace(group, "all_gather", AllGatherWorkspace)


# -- the operator: torch.ops.weft.all_gather(x, group_name, method) -> (size * rows, ...) ----------------------------

@all_gather.define
def all_gather_op(x: torch.Tensor, group_name: str, method: str = "auto") -> torch.Tensor:
    return fresh(all_gather.eager(x, method=method, group=group_name), x)


@all_gather_op.register_fake
def _(x, group_name, method="auto"):
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    return x.new_empty((group_size(group_name) * x.shape[0], *x.shape[1:]))


@all_gather.traced
def _(x, out=None, method="auto", group=None):
    return into(out, torch.ops.weft.all_gather(x, group_name(group), method))


def _all_gather_backward(ctx, grad):
    # Autograd convention (torch.distributed.nn's, docs/design.md): all_gather and reduce_scatter are each other's
    # backward, over the same group.
    from .all_reduce import reduce_scatter
    return reduce_scatter(grad, group=ctx.group_name), None, None


def _all_gather_save(ctx, inputs, output):
    ctx.group_name = inputs[1]


all_gather_op.register_autograd(_all_gather_backward, setup_context=_all_gather_save)


# Signatures for the sm_90 compile check (weft.testing.compile).
COMPILE_CASES = [
    (all_gather_push_kernel, dict(x="*i32", gathered="*i32", out="*i32", flags="*i32", counter="*i64", heap="*i64",
                                  n="i32", chunk="i32", out_stride="i32", half_len="i32", sig="*i64", err="*i64",
                                  fp="i32"),
     dict(COPY_OUT=c, BLOCK=2048, VEC=v))
    for c in (False, True) for v in (1, 4)
] + [
    (all_gather_pull_kernel, dict(x="*i32", stage="*i32", out="*i32", flags="*i32", counter="*i64", heap="*i64",
                                  n="i32", chunk="i32", out_stride="i32", half_len="i32", sig="*i64", err="*i64",
                                  fp="i32"), dict(BLOCK=2048, VEC=v))
    for v in (1, 4)
]
