"""GEMM-AllReduce: out = sum over ranks r of a_r @ b_r, on every rank, in one kernel.

The row-parallel linear layer of tensor parallelism at decode time: every rank
holds a (M, K_local) slice of the activations and the matching (K_local, N)
rows of the weight, and every rank needs the summed (M, N). M is small (1 to
~128 tokens), so the GEMM is bound by reading b from HBM and the all-reduce by
latency; fusing them saves a launch, a synchronisation and the round trip of
the partial product through HBM that cuBLAS + a separate all-reduce pay.

One program per output tile (row block x column block). Program t of every
rank:
1. computes its fp32 partial tile of a_me @ b_me (K loop pipelined);
2. pushes it into slot [me] of tile t of every rank's symmetric `stage`
   (remote stores), then sets flag arrived[me] of tile t on every rank to
   the epoch;
3. waits until its own W arrived flags of tile t reach the epoch, and sums
   the W slots of tile t in rank order 0, 1, ..., W - 1 in fp32 into `out`.
Every rank sums the same staged values in the same order, so every rank gets
the same bits. Program t only ever waits on program t of its peers, never on
another program of its own grid (the interpreter runs them one after another).

Staged partials are fp32 while the push is small (M <= STAGE_FP32_MAX_M):
one rounding, at the end, as in an fp32 GEMM. Above that they are rounded to
the input dtype, halving the bytes that cross NVLink; that is the rounding the
baseline (matmul in the input dtype, then all_reduce) makes anyway, and the sum
still runs in fp32. fp32 inputs use tf32 products on the GPU (as
weft.kernels.gemm does).

Every call runs over a group (default the world): "ranks" below are its
members, W its size, and the workspace is the group's own. On a group of one
there is nothing to reduce: the op is a plain GEMM (a GEMV at
decode's M), which cuBLAS runs at ~99 % of the weight bytes' HBM floor where
this kernel, tiled for the fused push, reached ~75 % (1 H100, Qwen3-8B's O and
down projections). "auto" and "baseline" are torch.matmul there; "fused" still
runs the kernel when asked.

On a group that spans nodes, "auto" and "fused" run the node's gemm_ar (this kernel over the node's members)
then the rail's all_reduce of the node sums (`hierarchical.GemmAr`, docs/nodes.md); "baseline" is torch.matmul
then the hierarchical all_reduce.

One workspace serves every shape (`GemmArWorkspace`): the stage in two halves
used by call parity, per tile slot int32 flags arrived[W], and the epoch
counter (`wl.next_epoch`: every call takes the next epoch, the same in all its
programs; never reset, so the op replays inside CUDA graphs). Why rank r may
write half e % 2 on rank q in call e, whatever the shapes of the calls before:
r's call e - 1 ended before its call e started, and in it r's program 0 waited
for q's arrival of call e - 1, which q sent after its call e - 2, the last
reader of half e % 2, had finished. Conversely, flags are compared with >=: a
peer can be at most one call ahead (to reach e + 2 it would need my arrival of
e + 1, sent after my reads of e), and an arrival of e + 1 implies that the
peer's push of e (same half as my reads) came before it, while its push of
e + 1 lands in the other half.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning
from . import hierarchical
from .all_reduce import all_reduce
from .blocks import cast
from .common import (Launch, Plan, check_method, check_out, check_tensor, group_name, matmul_operands,
                     overlaps, plan, resolve, signature, signature_words, signatures, workspace,
                     zero_everywhere)
from .registry import declare_op, into
from .gemm import dot

METHODS = ("auto", "fused", "baseline")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Stage fp32 partials up to this many rows (at N = 5120 and 8 ranks: 160 KiB to each peer), else the input dtype.
STAGE_FP32_MAX_M = 8
# "auto" uses the fused kernel up to gemm_ar.fused_max_m rows (weft.tuning), else cuBLAS + all_reduce: the
# fused kernel pushes every partial to every peer, so its traffic grows as (W - 1) * M * N, and its GEMM is
# the untuned one.


# -- device helpers -------------------------------------------------------------

@triton.jit
def _partial_tile(a, b, offs_m, offs_n, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 a[offs_m, :] @ b[:, offs_n] (rows >= M and columns >= N read as zero).

    b is the big operand: whole K blocks stream through a NUM_STAGES-deep
    pipeline, with no mask on b when N is a multiple of BLOCK_N (EVEN_N) so its
    loads stay 16-byte vectors; a ragged last K block (not EVEN_K) is masked.
    """
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m[:, None] < M
    col_ok = offs_n[None, :] < N
    a_ptrs = a + offs_m[:, None] * K + offs_k[None, :]
    b_ptrs = b + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in tl.range(K // BLOCK_K, num_stages=NUM_STAGES):
        a_blk = tl.load(a_ptrs, mask=row_ok, other=0.0)
        if EVEN_N:
            b_blk = tl.load(b_ptrs)
        else:
            b_blk = tl.load(b_ptrs, mask=col_ok, other=0.0)
        acc = dot(a_blk, b_blk, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    if not EVEN_K:
        k_ok = offs_k < K % BLOCK_K
        a_blk = tl.load(a_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        b_blk = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        acc = dot(a_blk, b_blk, acc)
    return acc


@triton.jit
def _tile_at(base, in_tile, ALIGNED: tl.constexpr):
    """`base + in_tile`, with the host's promise (ALIGNED) that rows of the tile start 16-byte aligned, so
    accesses become 16-byte vectors. Pointers computed by symm_at or consume_token carry no alignment, and
    a hint on a pointer received as an argument is lost: apply it here, where the tile's pointers are made."""
    ptrs = base + in_tile
    if ALIGNED:
        ptrs = tl.multiple_of(ptrs, [16, 16])
    return ptrs


# -- kernel ---------------------------------------------------------------------

@triton.jit(do_not_specialize=["half_len", "fp"])
def gemm_ar_kernel(a, b, stage, out, flags, counter, heap, M, N, K, half_len, sig, err, fp, WORLD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                   EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr):
    """out tile t = sum over ranks of (a @ b) tile t: compute, push to every rank, wait, sum.

    `stage` holds 2 halves (call parity, `half_len` elements apart) of WORLD slots of M x N, one slot
    per source rank, in the stage dtype; `flags` holds arrived[WORLD] per tile. The call's signature is
    checked before the wait (wl.check_signed): a mismatch writes no output.
    """
    t = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (t // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (t % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    me = wl.rank(heap)
    epoch = wl.next_epoch(counter)
    if wl.signature_live(sig, heap):
        wl.sign(sig, epoch, fp, heap)
        arrived = flags + t * WORLD

        acc = _partial_tile(a, b, offs_m, offs_n, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_N, EVEN_K)

        # Push my partial into slot [me] of this epoch's half on every rank (myself included: my own share is read
        # back rounded like the others'). Each rank starts with itself and goes round, so all do not hit rank 0
        # first.
        in_tile = offs_m[:, None] * N + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        slots = stage + (epoch % 2) * half_len
        mine = cast(acc, stage.dtype.element_ty)
        for i in tl.static_range(WORLD):
            peer = (me + i) % WORLD
            tl.store(_tile_at(wl.symm_at(slots + me * (M * N), peer, heap), in_tile, ALIGNED), mine, mask=mask)
        wl.notify_all(arrived + me, heap, epoch)

        # Sum the WORLD partials of this tile in rank order (the same bits on every rank). The loop is unrolled,
        # so all WORLD loads are in flight before the adds need them.
        if wl.check_signed(sig, epoch, fp, heap, err, op="gemm_ar"):
            token = wl.wait(arrived, WORLD, epoch, wl.CMP_GE, heap=heap, op="gemm_ar")
            slots = wl.consume_token(slots, token)
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for q in tl.static_range(WORLD):
                total += tl.load(_tile_at(slots + q * (M * N), in_tile, ALIGNED), mask=mask, other=0.0).to(tl.float32)
            tl.store(out + in_tile, cast(total, out.dtype.element_ty), mask=mask)


# -- configs --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GemmArConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


# GPU configs by the largest M a row serves (the last row's: any M): gemm_ar.configs in weft.tuning.
# The interpreter's cost grows with the number of tl ops, not their size; small tiles keep tests' shapes small.
CPU_CONFIG = GemmArConfig(block_m=16, block_n=32, block_k=32, num_stages=1, num_warps=4)


@tuning.memo
def config_for(m: int, device: torch.device, group_size: int) -> GemmArConfig:
    if device.type != "cuda":
        return CPU_CONFIG
    rows = tuning.value("gemm_ar.configs", device, group_size)
    return next(GemmArConfig(**cfg) for max_m, cfg in rows if max_m is None or m <= max_m)


def fused_max_m(group) -> int:
    """The most rows "auto" gives the fused kernel (gemm_ar.fused_max_m, by group size)."""
    return tuning.value("gemm_ar.fused_max_m", group.device, group.size)


def stage_dtype(m: int, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if m <= STAGE_FP32_MAX_M else dtype


# -- host side ------------------------------------------------------------------

# Tile slots of the workspace's flags: the most output tiles a fused call may have.
MAX_TILES = 4096
# linear_residual_ar's LL words take 1 / LL_SHARE of the workspace's bytes beside it (both halves): at the default
# 128 MiB, 2M words a half, the group's members' rows x columns (W x M x N) of a call.
LL_SHARE = 4


class GemmArWorkspace:
    """The stage (two halves by call parity, as bytes: viewed in each call's stage dtype), flags arrived[W]
    per tile slot, the epoch counter, the signature words and the group's SignatureWord; one for every shape,
    one per group. And linear_residual_ar's LL words (decode.py): two halves by call parity of ll_half int64
    words, zero at first, only ever written with LL words (wl.pack_ll), so no word there can carry a later
    call's epoch before that call writes it (the raw stage could: its data may look like any tag)."""

    def __init__(self, group):
        heap = group.heap
        self.half_bytes = group.workspace_bytes // 2 // 256 * 256
        self.stage = heap.empty((2 * self.half_bytes,), torch.uint8)
        self.flags = heap.empty((MAX_TILES * group.size,), torch.int32)
        self.counter = heap.empty((1,), torch.int64)
        self.ll_half = group.workspace_bytes // LL_SHARE // 2 // 8 // 32 * 32  # int64 words a half
        self.ll = heap.empty((2 * self.ll_half,), torch.int64)
        self.sig = signature_words(group, group.size)
        self.errors = signatures(group)
        self.errors.register(self.sig, self.counter)
        zero_everywhere(group, self.flags, self.counter, self.sig, self.ll)


def _check_operands(a, b_shard, out, group) -> None:
    for name, t in (("a", a), ("b_shard", b_shard)):
        check_tensor(name, t, group, dtypes=DTYPES, contiguous=False)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if a.dtype != b_shard.dtype:
        raise TypeError(f"a and b_shard must have the same dtype, got {a.dtype} and {b_shard.dtype}")
    if a.shape[1] != b_shard.shape[0]:
        raise ValueError(f"a has {a.shape[1]} columns but b_shard has {b_shard.shape[0]} rows")
    if out is not None:
        check_out(out, (a.shape[0], b_shard.shape[1]), a.dtype, group)


def fused_refusal(group, a, b_shard, out) -> str | None:
    """Why the fused kernel cannot take this call, or None."""
    (m, _), n = a.shape, b_shard.shape[1]
    cfg = config_for(m, group.device, group.size)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    stage_bytes = group.size * m * n * stage_dtype(m, a.dtype).itemsize
    if not (a.is_contiguous() and b_shard.is_contiguous() and (out is None or out.is_contiguous())):
        return "a, b_shard and out must be contiguous"
    if tiles > MAX_TILES:
        return f"the output has {tiles} tiles, more than MAX_TILES = {MAX_TILES}"
    if stage_bytes > group.workspace_bytes // 2 // 256 * 256:
        return (f"the staged partials take {stage_bytes} bytes, more than half the workspace "
                f"({group.workspace_bytes} bytes: raise WEFT_WORKSPACE_BYTES)")
    return None


@declare_op(tensors=("a", "b_shard", "out"), collective=True)
def gemm_ar(a: torch.Tensor, b_shard: torch.Tensor, method: str = "auto",
            out: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """all_reduce over the members of `group` (default: the world) of a @ b_shard: the row-parallel linear
    layer of tensor parallelism.

    a: (M, K_local), b_shard: (K_local, N), same dtype (bf16, fp16, fp32), any layout; returns (M, N) in
    that dtype, the same bits on every member (fp32 accumulation). method: "fused" (one kernel: GEMM, push,
    sum; contiguous operands whose partials fit the workspace), "baseline" (torch.matmul, then weft's
    all_reduce; on a group of one torch.matmul alone), "auto" (on a group of one torch.matmul; else fused up
    to gemm_ar.fused_max_m rows where it can take the call). `out`: any (M, N) tensor of the dtype not
    overlapping the operands. Collective: every member calls it with the same shapes, dtype and method.
    """
    g = resolve(group)
    # The key holds no out_kind: nothing here depends on whether out is symmetric, and asking would make a
    # group of one's heap.
    found = plan(g, lambda: ("gemm_ar", signature(a), signature(b_shard), method,
                             None if out is None else signature(out)),
                 lambda: GemmArPlan(g, a, b_shard, method, out))
    return found.run(a, b_shard, out)


class GemmArPlan(Plan):
    """A gemm_ar of one signature: nothing to compute (an empty output), torch.matmul alone (a group of one),
    torch.matmul + all_reduce, or the fused kernel's launch with its workspace views."""

    def __init__(self, group, a, b_shard, method, out):
        super().__init__(group)
        _check_operands(a, b_shard, out, group)
        check_method(method, METHODS)
        (m, k), n = a.shape, b_shard.shape[1]
        self.shape = (m, n)
        self.dtype, self.device = a.dtype, a.device  # not a itself: a plan keeps no caller tensor
        self.check(a, b_shard, out)  # before the workspace is made
        refusal = fused_refusal(group, a, b_shard, out)
        if method == "fused" and refusal:
            raise ValueError(f"method='fused' cannot take this call: {refusal}")
        spanning = hierarchical.hierarchy(group) if group.topology.spans_nodes else None
        if spanning is None and group.topology.spans_nodes and method == "fused":
            raise ValueError("method='fused' cannot take a group whose nodes hold different numbers of its members "
                             "(the kernel reaches only its own node): use 'baseline'")
        if method == "auto" and spanning is None:
            method = "fused" if m <= fused_max_m(group) and refusal is None and group.size > 1 else "baseline"
        if m == 0 or n == 0:
            self.run = self.run_empty
        elif spanning is not None and method != "baseline":
            # Across nodes: the node's gemm_ar ("auto" or "fused" there), then the rail's all_reduce
            # (weft/kernels/hierarchical.py); "baseline" is torch.matmul then the hierarchical all_reduce.
            self.run = hierarchical.GemmAr(group, spanning, method, self.check).run
        elif method == "baseline" and group.size == 1:  # nothing to reduce: cuBLAS alone, no copy after it
            self.run = self.run_matmul
        elif method == "baseline":
            self.run = self.run_baseline
        else:
            self.prepare_fused(group, a, b_shard, out)
            self.run = self.run_fused

    @staticmethod
    def check(a, b_shard, out):
        if out is not None and any(overlaps(out, t) for t in (a, b_shard) if t.numel()):
            raise ValueError("out overlaps a or b_shard: pass a separate tensor")

    def result(self, out):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device) if out is None else out

    def run_empty(self, a, b_shard, out):
        self.check(a, b_shard, out)
        return self.result(out)

    def run_matmul(self, a, b_shard, out):
        self.check(a, b_shard, out)
        return torch.matmul(a, b_shard) if out is None else torch.matmul(a, b_shard, out=out)

    def run_baseline(self, a, b_shard, out):
        self.check(a, b_shard, out)
        return all_reduce.eager(torch.matmul(a, b_shard), out=self.result(out), group=self.group)

    def prepare_fused(self, group, a, b_shard, out):
        (m, k), n = a.shape, b_shard.shape[1]
        ws = workspace(group, "gemm_ar", GemmArWorkspace)
        cfg = config_for(m, a.device, group.size)
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        sdtype = stage_dtype(m, a.dtype)
        stage = ws.stage.view(sdtype)
        self.half_len = ws.half_bytes // sdtype.itemsize
        heap = group.heap.descriptor
        self.fp = self.sign("gemm_ar", m=m, n=n, k=k, dtype=str(a.dtype).removeprefix("torch."))
        self.errors = ws.errors
        self.launch = Launch(gemm_ar_kernel, (tiles,),
                             (a, b_shard, stage, self.result(out), ws.flags, ws.counter, heap, m, n, k, self.half_len,
                              ws.sig, ws.errors.tensor, self.fp),
                             dict(WORLD=group.size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                  NUM_STAGES=cfg.num_stages, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
                                  ALIGNED=n * sdtype.itemsize % 16 == 0), cfg.num_warps)
        self.mnk = (m, n, k)
        # On GPUs the workspace's addresses are taken once, the caller's per call.
        self.fixed = tuple(map(self.launch.address, (stage, ws.flags, ws.counter, heap, ws.sig, ws.errors.tensor)))

    def run_fused(self, a, b_shard, out):
        self.check(a, b_shard, out)
        res = self.result(out)
        address, f = self.launch.address, self.fixed
        self.launch(address(a), address(b_shard), f[0], address(res), f[1], f[2], f[3], *self.mnk, self.half_len,
                    f[4], f[5], self.fp)
        self.errors.raise_recorded()
        return res


# -- the operator: torch.ops.weft.gemm_ar(a, b_shard, group_name, method) -> (M, N). Autograd: all_reduce(grad) @
# b_shardᵀ for a, aᵀ @ all_reduce(grad) for b_shard, over the same group.

@gemm_ar.define
def gemm_ar_op(a: torch.Tensor, b_shard: torch.Tensor, group_name: str, method: str = "auto") -> torch.Tensor:
    return gemm_ar.eager(a, b_shard, method=method, group=group_name)


@gemm_ar_op.register_fake
def _(a, b_shard, group_name, method="auto"):
    matmul_operands("a", a, "b_shard", b_shard)
    return a.new_empty((a.shape[0], b_shard.shape[1]))


@gemm_ar.traced
def _(a, b_shard, method="auto", out=None, group=None):
    return into(out, torch.ops.weft.gemm_ar(a, b_shard, group_name(group), method))


def _gemm_ar_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.group_name = inputs[2]  # the backward's all_reduce runs over the forward's group


def _gemm_ar_backward(ctx, grad):
    a, b_shard = ctx.saved_tensors
    grad = all_reduce(grad, group=ctx.group_name)
    grad_a = grad @ b_shard.t() if ctx.needs_input_grad[0] else None
    grad_b = a.t() @ grad if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


gemm_ar_op.register_autograd(_gemm_ar_backward, setup_context=_gemm_ar_setup)


# Signatures for the compile check (weft.testing.compile): every GPU config, bf16/fp16, stage in fp32 (small M)
# or the input dtype, even and ragged edges at 8 ranks, and 2 ranks.
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}
_SHIPPED_CONFIGS = list(dict.fromkeys((max_m, GemmArConfig(**cfg)) for rows in tuning.shipped("gemm_ar.configs")
                                      for max_m, cfg in rows))
COMPILE_CASES = [
    (gemm_ar_kernel,
     dict(a=t, b=t, stage="*fp32" if max_m == 16 else t, out=t, flags="*i32", counter="*i64", heap="*i64", M="i32",
          N="i32", K="i32", half_len="i32", sig="*i64", err="*i64", fp="i32"),
     dict(WORLD=wd, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, NUM_STAGES=c.num_stages,
          EVEN_N=even, EVEN_K=even, ALIGNED=even),
     dict(num_warps=c.num_warps, divisible=("N", "K") if even else ()))  # as the JIT specialises a real call
    for t in _PTR.values() for max_m, c in _SHIPPED_CONFIGS for wd, even in ((8, True), (8, False), (2, True))
]
