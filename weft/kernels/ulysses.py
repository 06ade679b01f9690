"""Ulysses sequence parallelism: the all-to-all between sequence-sharded and head-sharded attention tensors,
and its fusions with the QKV and O projections.

ulysses_all_to_all(x, scatter="heads"): x (S, H, D) on every rank, rank r holding tokens [r S, (r + 1) S)
of the sequence, becomes (W S, H / W, D), rank q holding heads [q H / W, (q + 1) H / W) of every token:
    out_q[r S + s, h] = x_r[s, q H / W + h].
scatter="seq" is the inverse, (W S, H / W, D) -> (S, H, D). packed=True takes q, k and v in one tensor
(S, 3, H, D) <-> (W S, 3, H / W, D).

Every op runs over a group (`group=`, default the world): W is its size and ranks are group ranks (the
kernels see only the group's heap), each group with its own workspace.

In both directions rank me sends rank q a block of S * P rows (P = 3 packed, else 1) of L = H / W * D
elements: heads: row (s, p) of x at heads [q H / W, ...), into rows [me S, (me + 1) S) of q's output, which
are contiguous; seq: rows [q S, (q + 1) S) of x, contiguous, into head columns [me H / W, ...) of every row
of q's output. The kernel is generic over that: per peer, rows at a source stride and block offset, to rows
at a destination stride and block offset; data moves as integer words (bit-exact, any dtype).

Push through one workspace per family (`UlyssesWorkspace`), as all_gather's push: program (p, i) pairs me
with q = (i - me) mod W, and q's program (p, i) pairs back. It writes its share of rows of my block for q
into slot [me] of q's data region (half epoch % 2), signals q, waits for q's block in my slot [q], and copies
it into my output at its place; the block for myself goes straight from x to out. Rows that do not fit a
slot (workspace / 2 / W) go through in passes, one launch and one epoch each. A single row larger than a
slot cannot, and then "auto" takes method="nccl" (an explicit "push" raises).

method="nccl" is torch.distributed.all_to_all_single with the permutes that make the blocks contiguous.

On a group that spans nodes (weft.runtime.topology) "auto" and "push" take the hierarchical all-to-all
(hierarchical.UlyssesAllToAll: this op on the node's group, then the rail's exchange over the network), bit for
bit the flat op's result; "nccl" stays all_to_all_single. The fused projections take their unfused path there
(torch.matmul and the hierarchical all-to-all): their kernels store into every member's buffer.

qkv_all_to_all(x, w_qkv, heads): x (S, hidden) @ w_qkv (hidden, 3 H D) then the heads all-to-all, fused:
a persistent GEMM whose output tiles (BLOCK_N columns dividing H / W * D, so every tile has one owner rank)
are stored straight into the owner's receive buffer (W S, 3 H / W D) (half epoch % 2; for a pass of rows
of x, W rows of it) and signalled one by
one (a flag per (sender, tile), set to the epoch); the owner's programs, after their own tiles, wait for
each incoming tile and copy it into the output. Program p of every rank computes tiles p, p + P, ... and
waits for exactly those tiles of its peers, so it waits only on program p elsewhere.

all_to_all_o_proj(attn, w_o): attn (W S, H / W, D) head-sharded -> the seq all-to-all -> (S, H D) @ w_o,
fused: work items are (row block, column group). Each program first pushes, for each of its items
(m, g), its share (rows g of row block m) of my head columns to every rank q, into q's receive buffer
(S, H D) (half epoch % 2), and signals it (a flag per (sender, item)); then, item by item, it computes the
output tiles (m, n) for n = g, g + G, ..., with the K loop walking the W head-column chunks in arrival
order me, me + 1, ..., waiting for chunk r's G flags of row block m just before using it. On the cpu
backend either G = 1 (program p waits only on program p elsewhere) or one program.

Halves by call parity, no extra handshake (the argument of all_gather's push): in every call of every op of
the family each pair of ranks exchanges a signal, so rank s writes half e % 2 of rank q in call e only after
its call e - 1 saw a signal of q's call e - 1, which q sent after its call e - 2, the last reader of that
half, completed. Each op keeps its own flags (a flag index always belongs to one sender), so a flag can
only hold an epoch of that op and sender; one epoch counter serves the family.

Both fused ops go through in passes of as many tokens as a half holds (one launch and epoch each). They
fall back to the unfused ones (torch.matmul + ulysses_all_to_all) where their constraints fail: one token's
output (QKV) or heads (O) beyond a half, and for QKV head columns (H / W * D) not a multiple of 16.
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning
from . import gemm, hierarchical
from .blocks import cast
from .common import (Launch, Plan, check_method, check_tensor, group_name, group_size, nccl_from, plan, resolve,
                     signature, signature_words, signatures, workspace, zero_everywhere)
from .registry import declare_op, fresh

METHODS = ("auto", "push", "nccl")
FUSED_METHODS = ("auto", "fused", "unfused")
SCATTERS = ("heads", "seq")
GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Program slots of the all-to-all flags (the most programs per peer the launch rule uses).
MAX_PROGRAMS = 64
# Flags per sender of qkv_all_to_all (one per output tile of the sender's GEMM) and of all_to_all_o_proj
# (one per work item): calls with more fall back to the unfused op.
MAX_TILES = 65536
MAX_ITEMS = 65536

# "auto" hands blocks of at least ulysses.nccl_above bytes per rank (weft.tuning) to all_to_all_single (NCCL),
# and takes the fused projections only where ulysses.auto_fused says they measured faster than matmul + the
# all-to-all (their GEMM is a plain Triton kernel, not the TMA one).


# -- device ---------------------------------------------------------------------

@triton.jit
def _at(rows, cols, VEC: tl.constexpr):
    """rows + cols (2-D), with the host's promise (VEC > 1) that each row's groups of VEC words start 16-byte
    aligned (the 2-D form of blocks.at: the compiler does not infer it through the row offsets)."""
    ptrs = rows + cols
    if VEC > 1:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [16, 16]), [1, VEC])
    return ptrs


@triton.jit
def _copy_rows(dst, dst_stride, src, src_stride, lo, hi, row_len, ROWS: tl.constexpr, COLS: tl.constexpr,
               VEC: tl.constexpr):
    """dst[i dst_stride + j] = src[i src_stride + j], rows i in [lo, hi), j in [0, row_len): 2-D tiles of
    ROWS x COLS words. The strides and row_len are multiples of VEC by construction (the callers multiply
    by VEC); whole column blocks are masked by row only, so the compiler sees 16-byte groups and
    vectorises; the ragged column tail is masked by element."""
    full = row_len // COLS
    for r in range(lo, hi, ROWS):
        rows = (r + tl.arange(0, ROWS)).to(tl.int64)
        rmask = (rows < hi)[:, None]
        s_rows = src + rows[:, None] * src_stride
        d_rows = dst + rows[:, None] * dst_stride
        for c in range(0, full):
            cols = (c * COLS + tl.arange(0, COLS))[None, :]
            tl.store(_at(d_rows, cols, VEC), tl.load(_at(s_rows, cols, VEC), mask=rmask), mask=rmask)
        if full * COLS < row_len:
            cols = (full * COLS + tl.arange(0, COLS))[None, :]
            mask = rmask & (cols < row_len)
            tl.store(d_rows + cols, tl.load(s_rows + cols, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["rows", "chunk", "row_v", "src_stride_v", "src_block_v", "dst_stride_v",
                               "dst_block_v", "slot_v", "half_v", "fp"])
def ulysses_all_to_all_kernel(x, buf, out, flags, counter, heap, rows, chunk, row_v, src_stride_v, src_block_v,
                              dst_stride_v, dst_block_v, slot_v, half_v, sig, err, fp, ROWS: tl.constexpr,
                              COLS: tl.constexpr, VEC: tl.constexpr):
    """Program (p, i): rows [p chunk, (p + 1) chunk) of my block for q = (i - me) mod W and of q's for me.

    The block for q starts at x + q src_block, rows src_stride apart; the block from q goes to out + q
    dst_block, rows dst_stride apart; rows are row_len words. All lengths come in units of VEC words. Nothing
    is written to `out` before the call's signature is checked (wl.check_signed).
    """
    p = tl.program_id(0)
    i = tl.program_id(1)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        q = (i - me + world) % world
        lo = p * chunk
        hi = tl.minimum(lo + chunk, rows)
        row_len = row_v * VEC
        src_stride = src_stride_v * VEC
        dst_stride = dst_stride_v * VEC
        src = x + q.to(tl.int64) * (src_block_v * VEC)
        half = buf + (epoch % 2) * (half_v * VEC)
        slot = slot_v * VEC
        f = flags + p * world + i
        if q != me:
            _copy_rows(wl.symm_at(half + me * slot, q, heap), row_len, src, src_stride, lo, hi, row_len, ROWS, COLS,
                       VEC)
            wl.notify(f, q, heap, epoch)
        if wl.check_signed(sig, epoch, fp, heap, err, op="ulysses_all_to_all"):
            if q == me:
                _copy_rows(out + me.to(tl.int64) * (dst_block_v * VEC), dst_stride, src, src_stride, lo, hi, row_len,
                           ROWS, COLS, VEC)
            else:
                token = wl.wait(f, 1, epoch, wl.CMP_GE, heap=heap, peer=q, op="ulysses_all_to_all")
                mine = wl.consume_token(half + q * slot, token)
                _copy_rows(out + q.to(tl.int64) * (dst_block_v * VEC), dst_stride, mine, row_len, lo, hi, row_len,
                           ROWS, COLS, VEC)


@triton.jit
def _tile_mm(a, b, off_m, off_n, M, N, K, sa0, sa1, sb0, sb1, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr):
    """fp32 a[off_m:+BM, :K] @ b[:K, off_n:+BN] (strided operands, masked edges)."""
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        rk = k * BK + tl.arange(0, BK)
        av = tl.load(a + rm[:, None].to(tl.int64) * sa0 + rk[None, :] * sa1,
                     mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        bv = tl.load(b + rk[:, None].to(tl.int64) * sb0 + rn[None, :] * sb1,
                     mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = gemm.dot(av, bv, acc)
    return acc


@triton.jit(do_not_specialize=["rows", "S", "half_len", "max_tiles", "fp"])
def qkv_all_to_all_kernel(x, w, out, buf, flags, counter, heap, rows, S, K, N, hd, lhd, sx0, sx1, sw0, sw1, half_len,
                          max_tiles, sig, err, fp, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y = x @ w (rows, N = 3 hd), tile by tile: a pass over `rows` of this rank's S tokens, `x` and `out`
    starting at the pass's first row. Tile columns [n0, n0 + BN) are part n0 // hd (q, k or v), heads of
    owner q = (n0 % hd) // lhd, column part lhd + n0 % hd - q lhd of the (W S, 3 lhd) output, rows me S +
    ...: mine straight into `out`; the others' into rows me rows + ... of their receive buffers (W rows,
    3 lhd), which they copy to their `out`. The call's signature is checked (wl.check_signed) before the
    program's first wait: on a mismatch the tiles of this rank's own heads may already be in `out`, no other."""
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    epoch = wl.next_epoch(counter)
    live = wl.signature_live(sig, heap)
    if live:
        wl.sign(sig, epoch, fp, heap)
    else:
        rows = rows * 0  # a tripped family: no tile, nothing pushed, nothing awaited
    half = buf + (epoch % 2) * half_len
    width = 3 * lhd  # a row of the head-sharded output
    num_n = N // BN
    tiles = tl.cdiv(rows, BM) * num_n
    rb = tl.arange(0, BM)
    cb = tl.arange(0, BN)
    for t in range(p, tiles, programs):
        mb = t // num_n
        n0 = (t % num_n) * BN
        acc = _tile_mm(x, w, mb * BM, n0, rows, N, K, sx0, sx1, sw0, sw1, BM, BN, BK)
        q = (n0 % hd) // lhd
        col = (n0 // hd) * lhd + n0 % hd - q * lhd
        r = mb * BM + rb
        mask = (r < rows)[:, None]
        val = cast(acc, out.dtype.element_ty)
        if q == me:
            tl.store(out + (me * S + r)[:, None].to(tl.int64) * width + (col + cb)[None, :], val, mask=mask)
        else:
            offs = (me * rows + r)[:, None].to(tl.int64) * width + (col + cb)[None, :]
            tl.store(wl.symm_at(half, q, heap) + offs, val, mask=mask)
            wl.notify(flags + me * max_tiles + t, q, heap, epoch)
    if live:
        if wl.check_signed(sig, epoch, fp, heap, err, op="qkv_all_to_all") == 0:
            tiles = tiles * 0  # another call on a peer: nothing received
    for t in range(p, tiles, programs):
        mb = t // num_n
        n0 = (t % num_n) * BN
        if (n0 % hd) // lhd == me:  # my heads: every other rank sends me its tile t
            col = (n0 // hd) * lhd + n0 % hd - me * lhd
            r = mb * BM + rb
            mask = (r < rows)[:, None]
            for step in range(1, world):
                src = (me + step) % world
                token = wl.wait(flags + src * max_tiles + t, 1, epoch, wl.CMP_GE, heap=heap, peer=src,
                                op="qkv_all_to_all")
                v = tl.load(wl.consume_token(half, token) + (src * rows + r)[:, None].to(tl.int64) * width
                            + (col + cb)[None, :], mask=mask)
                tl.store(out + (src * S + r)[:, None].to(tl.int64) * width + (col + cb)[None, :], v, mask=mask)


@triton.jit(do_not_specialize=["rows", "S", "half_len", "max_items", "groups", "fp"])
def all_to_all_o_proj_kernel(attn, w, out, buf, flags, counter, heap, rows, S, N, lhd, sw0, sw1, half_len,
                             max_items, groups, sig, err, fp, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                             COLS: tl.constexpr):
    """out (S, N) = A @ w, A (S, W lhd) the seq all-to-all of attn (W S, lhd): A[s, r lhd + j] = attn_r[me S +
    s, j]; a pass over `rows` of the S tokens, `attn` and `out` starting at the pass's first token (the
    receive buffer holds the pass's (rows, W lhd)). First every item (mb, g) of this program pushes rows [mb BM + g sub, ...) of my columns to every
    rank; then each computes the tiles (mb, n), n = g, g + groups, ..., waiting for chunk r's `groups` flags
    of row block mb before its K steps over chunk r. Pushing first means a program waits only on pushes
    issued before any wait: on another program of the peers (all resident on a GPU), or, with one program
    (the cpu backend's choice with several groups), on itself. The call's signature is checked
    (wl.check_signed) between the two: on a mismatch nothing is computed or written."""
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    epoch = wl.next_epoch(counter)
    live = wl.signature_live(sig, heap)
    if live:
        wl.sign(sig, epoch, fp, heap)
    else:
        rows = rows * 0  # a tripped family: no item, nothing pushed, nothing awaited
    half = buf + (epoch % 2) * half_len
    hd = world * lhd
    num_n = tl.cdiv(N, BN)
    items = tl.cdiv(rows, BM) * groups
    sub = tl.cdiv(BM, groups)
    for item in range(p, items, programs):
        mb = item // groups
        lo = mb * BM + (item % groups) * sub
        hi = tl.minimum(tl.minimum(lo + sub, mb * BM + BM), rows)
        for step in range(world):
            q = (me + step) % world
            _copy_rows(wl.symm_at(half + me * lhd, q, heap), hd, attn + q.to(tl.int64) * S * lhd, lhd, lo, hi, lhd,
                       ROWS, COLS, 1)
            wl.notify(flags + me * max_items + item, q, heap, epoch)
    if live:
        if wl.check_signed(sig, epoch, fp, heap, err, op="all_to_all_o_proj") == 0:
            items = items * 0  # another call on a peer: nothing received
    for item in range(p, items, programs):
        mb = item // groups
        for nb in range(item % groups, num_n, groups):
            acc = tl.zeros([BM, BN], tl.float32)
            for step in range(world):
                r = (me + step) % world
                token = wl.wait(flags + r * max_items + mb * groups, groups, epoch, wl.CMP_GE, heap=heap, peer=r,
                                op="all_to_all_o_proj")
                a = wl.consume_token(half, token) + r * lhd
                acc += _tile_mm(a, w + r.to(tl.int64) * lhd * sw0, mb * BM, nb * BN, rows, N, lhd, hd, 1, sw0, sw1,
                                BM, BN, BK)
            rs = mb * BM + tl.arange(0, BM)
            cols = nb * BN + tl.arange(0, BN)
            tl.store(out + rs[:, None].to(tl.int64) * N + cols[None, :], cast(acc, out.dtype.element_ty),
                     mask=(rs < rows)[:, None] & (cols < N)[None, :])


# -- workspace --------------------------------------------------------------------

class UlyssesWorkspace:
    """The family's workspace in a group: a data region in two halves (by call parity), the flags of each op,
    the epoch counter, the signature words and the group's SignatureWord."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        self.half_bytes = group.workspace_bytes // 2 // 256 * 256
        self.data = heap.empty((2 * self.half_bytes,), torch.uint8)
        self.a2a_flags = heap.empty((MAX_PROGRAMS * w,), torch.int32)
        self.qkv_flags = heap.empty((w * MAX_TILES,), torch.int32)
        self.o_flags = heap.empty((w * MAX_ITEMS,), torch.int32)
        self.counter = heap.empty((1,), torch.int64)
        self.sig = signature_words(group, w)
        self.errors = signatures(group)
        self.errors.register(self.sig, self.counter)
        zero_everywhere(group, self.a2a_flags, self.qkv_flags, self.o_flags, self.counter, self.sig)

    def data_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        return self.data.view(dtype), self.half_bytes // dtype.itemsize


def flag_bytes(size: int) -> int:
    """The bytes of a UlyssesWorkspace's flags in a group of `size` (beyond its data: a heap's room for them)."""
    return (MAX_PROGRAMS + MAX_TILES + MAX_ITEMS) * size * 4


def _workspace(group) -> UlyssesWorkspace:
    return workspace(group, "ulysses", UlyssesWorkspace)


# -- the all-to-all ----------------------------------------------------------------

@declare_op(tensors=("x",), collective=True)
def ulysses_all_to_all(x: torch.Tensor, scatter: str = "heads", packed: bool = False,
                       method: str = "auto", group=None) -> torch.Tensor:
    """Sequence-sharded <-> head-sharded attention tensors over the members of `group` (default: the world;
    W its size, ranks its group ranks). Collective over the group; every member calls with the same shape.

    scatter="heads": x (S, H, D) -> (W S, H / W, D); scatter="seq": x (W S, H / W, D) -> (S, H, D). With
    packed=True x carries q, k and v: (S, 3, H, D) <-> (W S, 3, H / W, D). Any dtype and layout; bit-exact.
    method: "push" (through the family's workspace, in passes when large), "nccl" (all_to_all_single with
    permutes), "auto" (push, or nccl for large blocks on GPUs and where a single row exceeds a workspace slot).
    On a group that spans nodes "push" and "auto" are the hierarchical all-to-all (the node's, with this
    method, then the rail's over the network; docs/nodes.md), the same bits.
    """
    g = resolve(group)
    found = plan(g, lambda: ("ulysses_all_to_all", signature(x), scatter, bool(packed), method),
                 lambda: AllToAllPlan(g, x, scatter, packed, method))
    return found.run(x)


def _a2a_shapes(x, scatter, packed, w):
    """(S, P, Hl, D, out shape): S tokens per rank, P = 3 packed or 1, Hl heads per rank after the heads
    scatter; w the group size."""
    if scatter not in SCATTERS:
        raise ValueError(f"scatter must be one of {', '.join(repr(s) for s in SCATTERS)}, got {scatter!r}")
    want = 4 if packed else 3
    if x.dim() != want or (packed and x.shape[1] != 3):
        form = "(seq, 3, heads, head_dim)" if packed else "(seq, heads, head_dim)"
        raise ValueError(f"x must be {form}{' (packed=True)' if packed else ''}, got shape {tuple(x.shape)}")
    p = 3 if packed else 1
    mid = (3,) if packed else ()
    if scatter == "heads":
        s, h, d = x.shape[0], x.shape[-2], x.shape[-1]
        if h % w:
            raise ValueError(f"x has {h} heads, not divisible by the group size {w}")
        return s, p, h // w, d, (w * s, *mid, h // w, d)
    rows, hl, d = x.shape[0], x.shape[-2], x.shape[-1]
    if rows % w:
        raise ValueError(f"x has {rows} tokens, not divisible by the group size {w} (scatter='seq' takes the "
                         "head-sharded (group size * seq, heads / group size, head_dim) layout)")
    return rows // w, p, hl, d, (rows // w, *mid, hl * w, d)


def _word(nbytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer word that divides a row's bytes and every base address."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if nbytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.int8


class AllToAllPlan(Plan):
    """A ulysses_all_to_all of one signature: no data, all_to_all_single, or the push kernel's passes."""

    def __init__(self, group, x, scatter, packed, method):
        super().__init__(group)
        check_tensor("x", x, group, contiguous=False)
        check_method(method, METHODS)
        w = group.size
        s, p, hl, d, self.shape = _a2a_shapes(x, scatter, packed, w)
        self.x_contig = x.is_contiguous()
        nbytes = x.numel() * x.element_size()
        row_bytes = hl * d * x.element_size()
        if nbytes == 0:
            self.run = self.run_empty
            return
        if group.topology.spans_nodes:
            h = hierarchical.hierarchy(group)
            if method != "nccl" and h is not None:  # the node's all-to-all, then the rail's: hierarchical.py
                self.run = hierarchical.UlyssesAllToAll(group, h, s, p, hl * d, self.shape, scatter, method,
                                                        x.dtype).run
                return
            method = "nccl"  # nodes of unequal member counts: no rails
        ws = _workspace(group) if method != "nccl" else None
        slot_bytes = ws.half_bytes // w // 16 * 16 if ws else 0
        if method == "push" and row_bytes > slot_bytes:
            raise ValueError(f"method='push' cannot take this call: a row of {row_bytes} bytes (heads / group size x "
                             f"head_dim) exceeds a workspace slot of {slot_bytes} bytes (raise WEFT_WORKSPACE_BYTES)")
        if method == "auto":
            big = nbytes // w >= nccl_from("ulysses.nccl_above", group)
            method = "nccl" if big or row_bytes > slot_bytes else "push"
        if method == "nccl":
            self.s, self.p, self.hl, self.d, self.scatter = s, p, hl, d, scatter
            self.run = self.run_nccl
            return
        self.prepare_push(group, x, ws, s, p, row_bytes, slot_bytes, scatter)
        self.run = self.run_push

    def prepare_push(self, group, x, ws, s, p, row_bytes, slot_bytes, scatter):
        """The push kernel's launches: one pass per slot-sized part of the rows."""
        w = group.size
        sample_x = x if self.x_contig else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        sample_out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        self.word = word = _word(row_bytes, sample_x, sample_out, ws.data)
        esize = word.itemsize
        vec = 16 // esize if row_bytes % 16 == 0 and sample_x.data_ptr() % 16 == 0 else 1
        row = row_bytes // esize  # words per row
        n = s * p  # rows per peer block
        if scatter == "heads":
            src_stride, src_block, dst_stride, dst_block = w * row, row, row, n * row
        else:
            src_stride, src_block, dst_stride, dst_block = row, n * row, w * row, row
        buf, half_len = ws.data_as(word)
        slot = slot_bytes // esize
        most = slot // row
        # The word follows alignment, but every length below is whole rows: it is each member's own business.
        fp = self.sign("ulysses_all_to_all", scatter=scatter, seq=s, packed=p, row_bytes=row_bytes,
                       dtype=str(x.dtype).removeprefix("torch."))
        self.errors = ws.errors
        heap = group.heap.descriptor
        gpu = group.device.type == "cuda"
        push = tuning.value("ulysses.push", group.device, w) if gpu else dict(block=1024)
        block = push["block"]
        cols = min(block, max(vec, 1 << (row.bit_length() - 1)))  # whole column blocks in every row where it can
        consts = dict(ROWS=block // cols, COLS=cols, VEC=vec)
        self.passes = []
        for lo in range(0, n, most):
            k = min(most, n - lo)
            per_peer = k * row_bytes
            programs = min(MAX_PROGRAMS, max(1, per_peer // push["program_bytes"]), k) if gpu else min(2, k)
            chunk = triton.cdiv(k, programs)

            def args(xw, ow, lo=lo, k=k, chunk=chunk):
                return (xw[lo * src_stride:], buf, ow[lo * dst_stride:], ws.a2a_flags, ws.counter, heap, k, chunk,
                        row // vec, src_stride // vec, src_block // vec, dst_stride // vec, dst_block // vec,
                        slot // vec, half_len // vec, ws.sig, ws.errors.tensor, fp)
            xw, ow = sample_x.reshape(-1).view(word), sample_out.view(-1).view(word)
            self.passes.append((Launch(ulysses_all_to_all_kernel, (programs, w), args(xw, ow), consts,
                                       8 if gpu else 4), args))

    def run_empty(self, x):
        return torch.empty(self.shape, dtype=x.dtype, device=x.device)

    def run_push(self, x):
        out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        xw = (x if self.x_contig else x.contiguous()).reshape(-1).view(self.word)
        ow = out.view(-1).view(self.word)
        for launch, args in self.passes:
            launch(*args(xw, ow))
            self.errors.raise_recorded()
        return out

    def run_nccl(self, x):
        """all_to_all_single on blocks made contiguous: heads: x (S, P, W, Hl, D) -> (W, S, P, Hl, D) before;
        seq: the received (W, S, P, Hl, D) -> (S, P, W, Hl, D) after."""
        w, s, p, hl, d = self.group.size, self.s, self.p, self.hl, self.d
        recv = torch.empty((w, s, p, hl, d), dtype=x.dtype, device=x.device)
        if self.scatter == "heads":
            send = x.reshape(s, p, w, hl, d).permute(2, 0, 1, 3, 4).contiguous()
            dist.all_to_all_single(recv, send, group=self.group.process_group)
            return recv.view(self.shape)
        dist.all_to_all_single(recv, x.contiguous(), group=self.group.process_group)
        return recv.permute(1, 2, 0, 3, 4).reshape(self.shape)


# -- the fusions with the projections ------------------------------------------------------

def _gemm_blocks(device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the plain Triton GEMM of the fused ops."""
    return (128, 128, 64, 8) if device.type == "cuda" else (16, 32, 32, 4)


def _programs(work: int, device: torch.device) -> int:
    return max(1, min(gemm.num_sms(device), work))


def _check_heads(heads, w) -> None:
    if isinstance(heads, bool) or not isinstance(heads, numbers.Integral) or heads <= 0:
        raise ValueError(f"heads must be a positive integer, got {heads!r}")
    if heads % w:
        raise ValueError(f"heads = {heads} is not divisible by the group size {w}")


@declare_op(collective=True)
def qkv_all_to_all(x: torch.Tensor, w_qkv: torch.Tensor, heads: int, method: str = "auto",
                   group=None) -> torch.Tensor:
    """The QKV projection of this rank's tokens, scattered by heads over the members of `group` (default: the
    world; W its size): (x @ w_qkv) seen as (S, 3, heads, D) then ulysses_all_to_all(packed=True). Returns
    (W S, 3, heads / W, D) in x's dtype. Collective over the group.

    x (S, hidden), w_qkv (hidden, 3 heads D) with columns [q heads | k heads | v heads]; bf16, fp16, fp32.
    method: "fused" (output tiles pushed to their head owner as they are computed, in passes of as many
    rows as half the workspace holds; needs heads / W * D a multiple of 16), "unfused" (torch.matmul, then
    ulysses_all_to_all), "auto" (fused where it can take the call and is measured faster: ulysses.auto_fused).
    On a group that spans nodes always the unfused path (the hierarchical all-to-all; "fused" raises).
    """
    g = resolve(group)
    # Strides are in the key: the kernel is specialised on them (a unit stride makes vector loads).
    found = plan(g, lambda: ("qkv_all_to_all", signature(x), x.stride(), signature(w_qkv), w_qkv.stride(), heads,
                             method),
                 lambda: QkvPlan(g, x, w_qkv, heads, method))
    return found.run(x, w_qkv)


class QkvPlan(Plan):
    """A qkv_all_to_all of one signature: matmul then the all-to-all, or the fused kernel's passes."""

    def __init__(self, group, x, w_qkv, heads, method):
        super().__init__(group)
        check_method(method, FUSED_METHODS)
        gemm.check_operands("x", x, "w_qkv", w_qkv, group.device, layout=False)
        w = group.size
        _check_heads(heads, w)
        s, k = x.shape
        n = w_qkv.shape[1]
        if n == 0 or n % (3 * heads):
            raise ValueError(f"w_qkv has {n} columns: expected 3 * heads * head_dim, a positive multiple of "
                             f"3 * {heads}")
        d = n // (3 * heads)
        lhd = heads // w * d
        self.shape = shape = (w * s, 3, heads // w, d)
        self.unfused_shape = (s, 3, heads, d)
        bm, bn, bk, warps = _gemm_blocks(group.device)
        bn = next((b for b in (bn, 64, 32, 16) if b <= bn and lhd % b == 0), None)
        spans = group.topology.spans_nodes
        if method == "auto":  # across nodes the unfused path: the kernel stores into every member's buffer
            fused = tuning.value("ulysses.auto_fused", group.device, w) and not spans
            method = "fused" if fused else "unfused"
        ws = _workspace(group) if method != "unfused" and s and not spans else None
        refusal, most = None, 0
        if spans:
            refusal = "the group spans nodes (its kernel stores into every member's buffer; across nodes the op is " \
                      "the matmul, then the hierarchical all-to-all)"
        elif bn is None:
            refusal = f"heads / group size * head_dim = {lhd} is not a multiple of 16"
        elif ws:
            # Rows per pass: the pass's output, W rows x 3 lhd per rank = rows x n, within a half; whole row
            # blocks where possible; at most MAX_TILES tiles.
            most = ws.half_bytes // (n * x.element_size())
            most = min(most // bm * bm if most >= bm else most, MAX_TILES // (n // bn) * bm)
            if most == 0:
                refusal = (f"a row of the QKV output ({n * x.element_size()} bytes) exceeds half the workspace "
                           f"({ws.half_bytes} bytes; raise WEFT_WORKSPACE_BYTES)")
        if method == "fused" and refusal:
            raise ValueError(f"method='fused' cannot take this call: {refusal}")
        if method == "unfused" or refusal or s == 0:
            self.run = self.run_unfused
            return

        buf, half_len = ws.data_as(x.dtype)
        heap = group.heap.descriptor
        width = 3 * lhd
        fp = self.sign("qkv_all_to_all", seq=s, hidden=k, heads=heads, head_dim=d,
                       dtype=str(x.dtype).removeprefix("torch."))
        self.errors = ws.errors

        def args(x, w_qkv, out, lo, rows):
            return (x[lo:], w_qkv, out.view(w * s, width)[lo:], buf, ws.qkv_flags, ws.counter, heap, rows, s, k, n,
                    heads * d, lhd, x.stride(0), x.stride(1), w_qkv.stride(0), w_qkv.stride(1), half_len, MAX_TILES,
                    ws.sig, ws.errors.tensor, fp)
        self.args = args
        sample = torch.empty(shape, dtype=x.dtype, device=x.device)
        self.passes = []
        for lo in range(0, s, most):
            rows = min(most, s - lo)
            programs = _programs(triton.cdiv(rows, bm) * (n // bn), group.device)
            self.passes.append((lo, rows, Launch(qkv_all_to_all_kernel, (programs,),
                                                 args(x, w_qkv, sample, lo, rows), dict(BM=bm, BN=bn, BK=bk), warps)))
        self.run = self.run_fused

    def run_unfused(self, x, w_qkv):
        return ulysses_all_to_all(torch.matmul(x, w_qkv).view(self.unfused_shape), packed=True, group=self.group)

    def run_fused(self, x, w_qkv):
        out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        for lo, rows, launch in self.passes:
            launch(*self.args(x, w_qkv, out, lo, rows))
            self.errors.raise_recorded()
        return out


@declare_op(collective=True)
def all_to_all_o_proj(attn: torch.Tensor, w_o: torch.Tensor, method: str = "auto", group=None) -> torch.Tensor:
    """The O projection of head-sharded attention over the members of `group` (default: the world; W its
    size): ulysses_all_to_all(attn, scatter="seq") seen as (S, H D), times w_o. Returns (S, hidden) in attn's
    dtype. Collective over the group.

    attn (W S, H / W, D) (this rank's heads of every token), w_o (H D, hidden); bf16, fp16, fp32.
    method: "fused" (each arriving row block of head columns feeds the GEMM tiles that wait for it; in
    passes of as many tokens as half the workspace holds), "unfused" (ulysses_all_to_all, then
    torch.matmul), "auto" (fused where it can take the call and is measured faster: ulysses.auto_fused).
    On a group that spans nodes always the unfused path (the hierarchical all-to-all; "fused" raises).
    """
    g = resolve(group)
    found = plan(g, lambda: ("all_to_all_o_proj", signature(attn), signature(w_o), w_o.stride(), method),
                 lambda: OProjPlan(g, attn, w_o, method))
    return found.run(attn, w_o)


class OProjPlan(Plan):
    """An all_to_all_o_proj of one signature: the all-to-all then matmul, or the fused kernel's passes."""

    def __init__(self, group, attn, w_o, method):
        super().__init__(group)
        check_method(method, FUSED_METHODS)
        check_tensor("attn", attn, group, dtypes=GEMM_DTYPES, contiguous=False)
        w = group.size
        if attn.dim() != 3:
            raise ValueError(f"attn must be (group size * seq, heads / group size, head_dim), got "
                             f"{tuple(attn.shape)}")
        if attn.shape[0] % w:
            raise ValueError(f"attn has {attn.shape[0]} tokens, not divisible by the group size {w}")
        s, hl, d = attn.shape[0] // w, attn.shape[1], attn.shape[2]
        check_tensor("w_o", w_o, group, dtypes=GEMM_DTYPES, contiguous=False)
        if w_o.dim() != 2 or w_o.shape[0] != w * hl * d:
            raise ValueError(f"w_o must be (heads * head_dim = {w * hl * d}, hidden), got {tuple(w_o.shape)}")
        if w_o.dtype != attn.dtype:
            raise TypeError(f"attn and w_o must have the same dtype, got {attn.dtype} and {w_o.dtype}")
        n = w_o.shape[1]
        lhd = hl * d
        self.s, self.n, self.w, self.lhd = s, n, w, lhd
        self.attn_contig = attn.is_contiguous()
        bm, bn, bk, warps = _gemm_blocks(group.device)
        if group.topology.spans_nodes:  # its kernel stores into every member's buffer: across nodes, unfused
            if method == "fused":
                raise ValueError("method='fused' cannot take this call: the group spans nodes (across nodes the op "
                                 "is the hierarchical all-to-all, then the matmul: method='unfused' or 'auto')")
            method = "unfused"
        if method == "auto":
            method = "fused" if tuning.value("ulysses.auto_fused", group.device, w) else "unfused"
        ws = _workspace(group) if method != "unfused" and s * n * lhd else None
        gpu = group.device.type == "cuda"
        # Tokens per pass: the pass's received (rows, W lhd) within a half; whole row blocks where possible.
        most = ws.half_bytes // (w * lhd * attn.element_size()) if ws else 0
        most = min(most // bm * bm if most >= bm else most, MAX_ITEMS // bm * bm)
        if method == "fused" and ws and most == 0:
            raise ValueError(f"method='fused' cannot take this call: a token's heads ({w * lhd * attn.element_size()} "
                             f"bytes) exceed half the workspace ({ws.half_bytes} bytes; raise WEFT_WORKSPACE_BYTES)")
        if method == "unfused" or not most:
            self.run = self.run_unfused
            return

        buf, half_len = ws.data_as(attn.dtype)
        heap = group.heap.descriptor
        cols = triton.next_power_of_2(lhd)
        copy_rows = max(1, (4096 if gpu else 1024) // cols)

        fp = self.sign("all_to_all_o_proj", seq=s, heads=w * hl, head_dim=d, hidden=n,
                       dtype=str(attn.dtype).removeprefix("torch."))
        self.errors = ws.errors

        def args(attn, w_o, out, lo, rows, groups):
            return (attn[lo:], w_o, out[lo:], buf, ws.o_flags, ws.counter, heap, rows, s, n, lhd, w_o.stride(0),
                    w_o.stride(1), half_len, MAX_ITEMS, groups, ws.sig, ws.errors.tensor, fp)
        self.args = args
        sample = (attn if self.attn_contig else attn.contiguous()).view(w * s, lhd)
        out_sample = torch.empty((s, n), dtype=attn.dtype, device=attn.device)
        self.passes = []
        for lo in range(0, s, most):
            rows = min(most, s - lo)
            num_m = triton.cdiv(rows, bm)
            # Column groups per row block: enough items to fill the GPU when row blocks are few (at most
            # MAX_ITEMS). The interpreter runs a grid's programs one after another, so a program may wait only
            # on the same program of its peers: there, several programs with one group each where there are
            # several row blocks, else one program with two groups (the GPU's arrangement, in one program).
            if gpu:
                groups = max(1, min(gemm.num_sms(group.device) // num_m, triton.cdiv(n, bn), bm, MAX_ITEMS // num_m))
                programs = _programs(num_m * groups, group.device)
            else:
                groups = 1 if num_m > 1 else min(2, triton.cdiv(n, bn))
                programs = min(2, num_m)
            self.passes.append((lo, rows, groups, Launch(all_to_all_o_proj_kernel, (programs,),
                                                         args(sample, w_o, out_sample, lo, rows, groups),
                                                         dict(BM=bm, BN=bn, BK=bk, ROWS=copy_rows, COLS=cols), warps)))
        self.run = self.run_fused

    def run_unfused(self, attn, w_o):
        gathered = ulysses_all_to_all(attn, scatter="seq", group=self.group)
        return torch.matmul(gathered.view(self.s, self.w * self.lhd), w_o)

    def run_fused(self, attn, w_o):
        out = torch.empty((self.s, self.n), dtype=attn.dtype, device=attn.device)
        a = (attn if self.attn_contig else attn.contiguous()).view(self.w * self.s, self.lhd)
        for lo, rows, groups, launch in self.passes:
            launch(*self.args(a, w_o, out, lo, rows, groups))
            self.errors.raise_recorded()
        return out


# Signatures for the sm_90 compile check (weft.testing.compile).
_A2A_SIG = dict(x=None, buf=None, out=None, flags="*i32", counter="*i64", heap="*i64", rows="i32", chunk="i32",
                row_v="i32", src_stride_v="i32", src_block_v="i32", dst_stride_v="i32", dst_block_v="i32",
                slot_v="i32", half_v="i32", sig="*i64", err="*i64", fp="i32")
# -- the operators ------------------------------------------------------------------------------------------
#   torch.ops.weft.ulysses_all_to_all(x, group_name, scatter, packed, method) -> the other sharding
#   torch.ops.weft.qkv_all_to_all(x, w_qkv, heads, group_name, method)        -> (W S, 3, heads / W, D)
#   torch.ops.weft.all_to_all_o_proj(attn, w_o, group_name, method)           -> (S, hidden)
# W: the size of the group named. The all-to-all is a permutation of the members' data: its backward is the
# all-to-all the other way, over the same group. The fused projections are inference ops (no autograd).

@ulysses_all_to_all.define
def ulysses_all_to_all_op(x: torch.Tensor, group_name: str, scatter: str = "heads", packed: bool = False,
                          method: str = "auto") -> torch.Tensor:
    return fresh(ulysses_all_to_all.eager(x, scatter, packed, method, group=group_name), x)


@ulysses_all_to_all_op.register_fake
def _(x, group_name, scatter="heads", packed=False, method="auto"):
    return x.new_empty(_a2a_shapes(x, scatter, packed, group_size(group_name))[-1])


@ulysses_all_to_all.traced
def _(x, scatter="heads", packed=False, method="auto", group=None):
    return torch.ops.weft.ulysses_all_to_all(x, group_name(group), scatter, packed, method)


def _a2a_setup(ctx, inputs, output):
    ctx.group_name, ctx.scatter, ctx.packed = inputs[1], inputs[2], inputs[3]


def _a2a_backward(ctx, grad):
    back = "seq" if ctx.scatter == "heads" else "heads"
    return ulysses_all_to_all(grad, back, ctx.packed, group=ctx.group_name), None, None, None, None


ulysses_all_to_all_op.register_autograd(_a2a_backward, setup_context=_a2a_setup)


@qkv_all_to_all.define
def qkv_all_to_all_op(x: torch.Tensor, w_qkv: torch.Tensor, heads: int, group_name: str,
                      method: str = "auto") -> torch.Tensor:
    return qkv_all_to_all.eager(x, w_qkv, heads, method, group=group_name)


@qkv_all_to_all_op.register_fake
def _(x, w_qkv, heads, group_name, method="auto"):
    w = group_size(group_name)
    if x.dim() != 2 or w_qkv.dim() != 2 or heads <= 0 or heads % w or w_qkv.shape[1] % (3 * heads):
        raise ValueError(f"x (S, K) {tuple(x.shape)} and w_qkv (K, 3 heads head_dim) {tuple(w_qkv.shape)} with "
                         f"heads = {heads} divisible by the group size {w}")
    return x.new_empty((w * x.shape[0], 3, heads // w, w_qkv.shape[1] // (3 * heads)))


@qkv_all_to_all.traced
def _(x, w_qkv, heads, method="auto", group=None):
    return torch.ops.weft.qkv_all_to_all(x, w_qkv, heads, group_name(group), method)


@all_to_all_o_proj.define
def all_to_all_o_proj_op(attn: torch.Tensor, w_o: torch.Tensor, group_name: str,
                         method: str = "auto") -> torch.Tensor:
    return all_to_all_o_proj.eager(attn, w_o, method, group=group_name)


@all_to_all_o_proj_op.register_fake
def _(attn, w_o, group_name, method="auto"):
    w = group_size(group_name)
    if attn.dim() != 3 or w_o.dim() != 2 or attn.shape[0] % w:
        raise ValueError(f"attn (W S, heads / W, head_dim) {tuple(attn.shape)} and w_o (heads head_dim, hidden) "
                         f"{tuple(w_o.shape)} at group size {w}")
    return attn.new_empty((attn.shape[0] // w, w_o.shape[1]))


@all_to_all_o_proj.traced
def _(attn, w_o, method="auto", group=None):
    return torch.ops.weft.all_to_all_o_proj(attn, w_o, group_name(group), method)


_QKV_SIG = dict(x=None, w=None, out=None, buf=None, flags="*i32", counter="*i64", heap="*i64", rows="i32", S="i32",
                K="i32", N="i32", hd="i32", lhd="i32", sx0="i32", sx1="i32", sw0="i32", sw1="i32", half_len="i32",
                max_tiles="i32", sig="*i64", err="*i64", fp="i32")
_O_SIG = dict(attn=None, w=None, out=None, buf=None, flags="*i32", counter="*i64", heap="*i64", rows="i32", S="i32",
              N="i32", lhd="i32", sw0="i32", sw1="i32", half_len="i32", max_items="i32", groups="i32", sig="*i64",
              err="*i64", fp="i32")
COMPILE_CASES = [
    (ulysses_all_to_all_kernel, {**_A2A_SIG, "x": t, "buf": t, "out": t}, dict(ROWS=r, COLS=2048 // r, VEC=v),
     dict(num_warps=8))
    for t, r, v in [("*i64", 8, 2), ("*i32", 4, 4), ("*i16", 1, 1), ("*i8", 2, 1)]
] + [
    (qkv_all_to_all_kernel, {**_QKV_SIG, "x": t, "w": t, "out": t, "buf": t}, dict(BM=128, BN=bn, BK=64),
     dict(num_warps=8, divisible=("K", "N", "hd", "lhd", "sx0", "sw0")))  # a model's sizes, as the JIT sees them
    for t, bn in [("*bf16", 128), ("*fp16", 64), ("*fp32", 128)]
] + [
    (all_to_all_o_proj_kernel, {**_O_SIG, "attn": t, "w": t, "out": t, "buf": t},
     dict(BM=128, BN=128, BK=64, ROWS=4096 // c, COLS=c), dict(num_warps=8, divisible=("N", "lhd", "sw0")))
    for t, c in [("*bf16", 512), ("*fp16", 1024), ("*fp32", 512)]
]
