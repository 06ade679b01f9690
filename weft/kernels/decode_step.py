"""The persistent decode step: every layer of a dense Llama-3 / Qwen3 decoder at one rank in one launch.

decode_step(h, weights, ...) runs what the fused decode path (weft/models/decoder.py, WEFT_DECODE=fused) runs as
six kernels a layer (flash_decode's two among them): per layer the phases

    QKV      norm_qkv_rope's programs (RMSNorm, QKV projection, q/k norm, rotary, KV-cache write; decode.py)
    ATTN     flash_decode's split programs (flash_decode.py, the contiguous cache)
    MERGE    flash_decode's merge programs
    O        linear_residual's programs (the O projection, the residual add in its epilogue)
    GATE_UP  norm_gate_up_silu's programs (RMSNorm, gate/up projection, SiLU(gate) * up)
    DOWN     linear_residual's programs (the down projection, the residual add)

Each phase's tasks are exactly the programs of the standalone kernel's grid, run by the same device bodies
(decode.py's `_qkv_program`, `_linear_residual_program`, `_gate_up_program`; flash_decode.py's `_split_program`,
`_merge_program`) with the same launch settings and splits (the fused path's plans compute them), so the step does
the fused path's arithmetic (with one number of warps for every body: the fused path's agree on the shipped
settings): the same bits under the interpreter; on GPUs the bodies compiled into one kernel round the last bit of
some rotated keys differently (measured on 1x H200, both paths deterministic), a difference the KV cache carries
on. A split-K phase's last split sums the partials and runs the epilogue inside its task, as in the
standalone kernel.

Algorithm. The host builds once per signature an int32 task table in phase-major order (layer 0's QKV tasks,
layer 0's ATTN tasks, ..., layer L-1's DOWN tasks; task_table), each entry (layer * 6 + phase, task index in the
phase, the counters it counts itself done on, the counter it waits for and that counter's target). Program p of P
runs entries p, p + P, p + 2P, ... in that order. A task waits only for what it reads, and one counter says it
is there: a layer's counters are one a K split of each GEMV phase (the tasks that write its K range's columns of
the input count on it: the previous layer's DOWN tiles for QKV, the q heads' MERGE rows for O, O's tiles for
GATE_UP, GATE_UP's tiles for DOWN) and one a KV head for ATTN (the QKV tiles owning its group's heads) and for MERGE
(the head's ATTN programs). So a K split of O starts once its heads are merged while other heads still merge; no
phase waits for the whole phase before it. The wait is an acquire load by every thread, decode.persistent's
`wait_backoff_ns` of sleep between polls (a spinning program shares its SM with a working one), then a CTA barrier
(wl.wait, which times out and reports like weft's other waits under WEFT_WAIT_TIMEOUT_S). After the task (its
epilogue included) a CTA barrier orders every thread's stores, and a release add (gpu scope) on each counter it
counts on (one, or two where a tile's columns straddle two K ranges) counts it done. Counters are int32, zeroed on
the stream before each launch (a memset, which a CUDA graph captures with the launch). While a task waits it has
already asked for the first `prefetch_rows` rows of its weight slab in L2 (prefetch.global.L2; decode.persistent's
prefetch_rows, 0 for none).

Synchronisation. A counter reaches its target only after every task that counts on it has released it, each after
its own stores (and, for a last split, the epilogue's); the waiting task acquires it, so it sees them. Release/
acquire chains are transitive, and every GEMV tile is whole only after its splits read all of its input, so a
whole tile of any phase follows every task of the phase before the one it reads: a task of layer l + 1 that
writes a workspace (q, the attention partials and output, the split-K partials and tile counters, the SiLU
output) comes after every task of layer l that read it, and each workspace is reused layer after layer. The
residual stream is updated in place in `out` (O and DOWN read a tile's residual and write it in the same
program): DOWN's tile writes its columns only after its splits waited for every GATE_UP tile, which read the whole
stream; O's likewise after every QKV task. tests/test_decode_step.py runs the table in random orders its waits
allow (one program, the interpreter) and gets the phase-major order's bits: a missing wait would read a buffer
before it is written or after the next layer rewrote it. Loads of what another program of the launch wrote (the
residual stream, q, the KV rows just written, partials, the attention output) read past L1 (.cg, in the shared
bodies): an SM's L1 is not coherent, and the same addresses are rewritten every layer. Layer 0 reads `h`.

No deadlock. Every task depends only on tasks earlier in the table; each program runs its tasks in table order;
and all P programs are resident at once (P is at most what the SMs hold of the compiled kernel: registers,
shared memory, threads, read from the compiled kernel and the device; never more). So consider the earliest
task of the table not yet finished: every task it waits for is earlier, hence finished, so its wait ends; its
program is resident and has finished its own earlier tasks, so it runs this one now or next. It finishes, and
so, one after another, does every task. Under the interpreter (the cpu backend) programs run one after another, so a
second program could never run while the first waits: there P = 1, and one program running the table in order
finds every dependency already met.

Weights are addressed through an int64 table of each layer's tensors' addresses (8 a layer: input norm, QKV,
q norm, k norm, O, post-attention norm, gate/up, down), which the kernel turns into pointers (with a 16-byte
alignment hint, so that its weight loads stay vectorised): the model's own tensors, no copy and no stacking (a
stacked copy would double the weights' memory; views of one stacked tensor would need the model built around
it). The plan's key holds every address, so a table is only reused for the same tensors' memory (building the key
costs an eager call a few µs per weight tensor; a CUDA graph's replay none). The KV cache is one tensor (layers,
2, batch, max_len, kv_heads, head_dim), addressed by its strides.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

import weft.language as wl

from .. import tuning
from . import flash_decode as fd
from .common import Launch, Plan, _itself, plan, signature, world_or_raise
from .decode import (GemvPlan, _eps, _gate_up_program, _head_counts, _linear_residual_program, _operand, _qkv_program,
                     _same_device, _weight_at, _weight_operand, heads_per_program, MIN_BLOCK)
from .gemm import num_sms
from .registry import declare_op

# The phases of a layer, in table order.
QKV, ATTN, MERGE, O, GATE_UP, DOWN = range(6)
PHASES = tl.constexpr(6)
PHASE_NAMES = ("QKV", "ATTN", "MERGE", "O", "GATE_UP", "DOWN")
# A layer's weights, in `weights` order (8 a layer; q_norm and k_norm None without the q/k norm): the address
# table's slots.
LAYER_WEIGHTS = ("attn_norm", "qkv", "q_norm", "k_norm", "o", "mlp_norm", "gate_up", "down")
SLOTS = tl.constexpr(8)
# The projections among them: each may be stored either way (decode.py's LAYOUTS), the same in every layer.
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# A task's entry in the task table, int32 fields: its phase code (layer * 6 + phase) and index in the phase (the
# standalone kernel's program), the counters it counts itself done on (first, how many) and the counters it waits
# for (first, how many, the value each must reach).
CODE, INDEX, SIGNAL_FIRST, SIGNAL_COUNT, WAIT_FIRST, WAIT_COUNT, WAIT_TARGET = (tl.constexpr(j) for j in range(7))
FIELDS_A_TASK = tl.constexpr(7)
# Settings (weft.tuning's decode.persistent): programs per SM at most (the occupancy caps it as well), rows of a
# task's weight slab prefetched into L2 before it waits, and the sleep between a waiting task's polls (ns; 0: none),
# which leaves the SM's issue slots to the program beside it. Under the interpreter one program (module doc); the
# prefetch and the sleep are no-ops there, the prefetch's addresses still computed.
FIELDS = ("programs_per_sm", "prefetch_rows", "wait_backoff_ns")
CPU_SETTINGS = {"programs_per_sm": 1, "prefetch_rows": 16, "wait_backoff_ns": 0}
# What an SM holds when the device does not say (H100 / H200).
SM_REGISTERS, SM_SHARED, SM_THREADS, SM_BLOCKS = 65536, 233472, 2048, 32


# -- device side ------------------------------------------------------------------

@triton.jit
def _at(table, slot, like):
    """The pointer in slot `slot` of a layer's address table, of `like`'s element type, 16-byte aligned (the host
    checks it): the alignment keeps the loads through it vectorised."""
    return tl.multiple_of(tl.load(table + slot).to(tl.pointer_type(like.dtype.element_ty)), 16)


@triton.jit
def _prefetch(w, K, N, col0, width, k_first, k_rows, ROWS: tl.constexpr, LINES: tl.constexpr,
              K_MAJOR: tl.constexpr):
    """The first min(ROWS, k_rows) rows from k_first of the (K, N) weight w's columns [col0, col0 + width) fetched
    into L2, one address per 128-byte line (LINES a row); K_MAJOR (w stored (N, K), decode.py's `_weight_at`): the
    line holding each column's first K values of the range (LINES: the columns, padded)."""
    if K_MAJOR:
        c = tl.arange(0, LINES)
        wl.prefetch_l2(_weight_at(w, k_first, col0 + c, K, N, True), c < width)
    else:
        LINE: tl.constexpr = 1024 // w.dtype.element_ty.primitive_bitwidth  # elements a line
        r = tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, LINES)[None, :] * LINE
        wl.prefetch_l2(_weight_at(w, k_first + r, col0 + c, K, N, False), (r < k_rows) & (c < width))


@triton.jit
def _slab(i, tiles, K, KB, BPS, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """GEMV task i's (tile, split, row block), as the standalone grid's program ids (tile fastest), and its K
    range's first row and row count."""
    tile = i % tiles
    split = (i // tiles) % SPLIT
    mb = i // (tiles * SPLIT)
    k_first = split * BPS * BLOCK_K
    return tile, split, mb, k_first, tl.minimum(BPS * BLOCK_K, K - k_first)


@triton.jit
def decode_step_kernel(tasks, n_tasks, done, layers, h, out, cache, rows, positions, lengths, inv_freq,
                       q, part_out, part_lse, attn, g, q_partial, q_counter, o_partial, o_counter, gu_partial,
                       gu_counter, d_partial, d_counter, err, M, HIDDEN, INTER, eps, scale_log2, max_len, split_unit,
                       splits, limits, c_sl, c_skv, c_sb, c_sp, c_sh, q_tiles, q_kb, q_bps, o_tiles, o_kb, o_bps,
                       gu_tiles, gu_kb, gu_bps, d_tiles, d_kb, d_bps,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                       IEEE: tl.constexpr, Q_SPLIT: tl.constexpr, Q_BLOCK_M: tl.constexpr, Q_BLOCK_K: tl.constexpr,
                       Q_STAGES: tl.constexpr, Q_EVEN_K: tl.constexpr, Q_DOT: tl.constexpr,
                       Q_K_MAJOR: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr, O_SPLIT: tl.constexpr,
                       O_BLOCK_M: tl.constexpr, O_BLOCK_K: tl.constexpr, O_STAGES: tl.constexpr,
                       O_EVEN_K: tl.constexpr, O_DOT: tl.constexpr, O_K_MAJOR: tl.constexpr,
                       O_BLOCK_N: tl.constexpr, O_EVEN_N: tl.constexpr, GU_SPLIT: tl.constexpr,
                       GU_BLOCK_M: tl.constexpr, GU_BLOCK_K: tl.constexpr, GU_STAGES: tl.constexpr,
                       GU_EVEN_K: tl.constexpr, GU_DOT: tl.constexpr, GU_K_MAJOR: tl.constexpr,
                       GU_BLOCK_N: tl.constexpr, GU_EVEN_N: tl.constexpr, D_SPLIT: tl.constexpr,
                       D_BLOCK_M: tl.constexpr, D_BLOCK_K: tl.constexpr, D_STAGES: tl.constexpr,
                       D_EVEN_K: tl.constexpr, D_DOT: tl.constexpr, D_K_MAJOR: tl.constexpr,
                       D_BLOCK_N: tl.constexpr, D_EVEN_N: tl.constexpr, GROUP: tl.constexpr, A_HEADS: tl.constexpr,
                       CHUNKS: tl.constexpr, A_BLOCK_N: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                       PREFETCH_ROWS: tl.constexpr, Q_LINES: tl.constexpr, O_LINES: tl.constexpr,
                       GU_LINES: tl.constexpr, D_LINES: tl.constexpr, WAIT_BACKOFF_NS: tl.constexpr):
    """Program p runs entries p, p + P, ... of the task table `tasks` ((n_tasks, FIELDS_A_TASK) int32, task_table),
    each once its counter in `done` reaches its target, counting itself done on its own counters after.
    `layers`: (L, 8) int64 addresses (module doc). h (M, HIDDEN) the stream in; out the
    stream, updated in place from layer 0's O on. The rest: the fused path's kernels' arguments and settings (Q_:
    norm_qkv_rope's, O_ / D_: linear_residual's for O / down, GU_: norm_gate_up_silu's, A_ and the attention's:
    flash_decode's)."""
    D: tl.constexpr = 2 * HALF
    QKV_N: tl.constexpr = (HEADS + 2 * KV_HEADS) * D
    for t in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        entry = tasks + FIELDS_A_TASK * t
        code = tl.load(entry + CODE)
        i = tl.load(entry + INDEX)
        layer = code // PHASES
        phase = code % PHASES
        table = layers + layer.to(tl.int64) * SLOTS
        if PREFETCH_ROWS > 0:  # the first rows of this task's weight slab, before the wait
            if phase == 0:
                tile, split, mb, k_first, k_rows = _slab(i, q_tiles, HIDDEN, q_kb, q_bps, Q_SPLIT, Q_BLOCK_K)
                _prefetch(_at(table, 1, h), HIDDEN, QKV_N, tile * HEADS_P * D, HEADS_P * D, k_first, k_rows,
                          PREFETCH_ROWS, Q_LINES, Q_K_MAJOR)
            elif phase == 3:
                tile, split, mb, k_first, k_rows = _slab(i, o_tiles, HEADS * D, o_kb, o_bps, O_SPLIT, O_BLOCK_K)
                _prefetch(_at(table, 4, h), HEADS * D, HIDDEN, tile * 2 * O_BLOCK_N, 2 * O_BLOCK_N, k_first, k_rows,
                          PREFETCH_ROWS, O_LINES, O_K_MAJOR)
            elif phase == 4:
                tile, split, mb, k_first, k_rows = _slab(i, gu_tiles, HIDDEN, gu_kb, gu_bps, GU_SPLIT, GU_BLOCK_K)
                w = _at(table, 6, h)
                _prefetch(w, HIDDEN, 2 * INTER, tile * GU_BLOCK_N, GU_BLOCK_N, k_first, k_rows, PREFETCH_ROWS,
                          GU_LINES, GU_K_MAJOR)
                _prefetch(w, HIDDEN, 2 * INTER, INTER + tile * GU_BLOCK_N, GU_BLOCK_N, k_first, k_rows,
                          PREFETCH_ROWS, GU_LINES, GU_K_MAJOR)
            elif phase == 5:
                tile, split, mb, k_first, k_rows = _slab(i, d_tiles, INTER, d_kb, d_bps, D_SPLIT, D_BLOCK_K)
                _prefetch(_at(table, 7, h), INTER, HIDDEN, tile * 2 * D_BLOCK_N, 2 * D_BLOCK_N, k_first, k_rows,
                          PREFETCH_ROWS, D_LINES, D_K_MAJOR)
        # The counters of what this task reads, each at its producers' task count (none for layer 0's QKV).
        wl.wait(done + tl.load(entry + WAIT_FIRST), tl.load(entry + WAIT_COUNT), tl.load(entry + WAIT_TARGET),
                wl.CMP_GE, wl.SCOPE_GPU, op="decode_step", backoff_ns=WAIT_BACKOFF_NS)
        stream = out  # the residual stream: the caller's h until layer 0's O has written out
        if layer == 0:
            stream = h
        k_cache = cache + layer.to(tl.int64) * c_sl
        v_cache = k_cache + c_skv
        if phase == 0:
            tile, split, mb, _, _ = _slab(i, q_tiles, HIDDEN, q_kb, q_bps, Q_SPLIT, Q_BLOCK_K)
            _qkv_program(tile, split, mb, q_tiles, tl.cdiv(M, Q_BLOCK_M), stream, _at(table, 0, h), _at(table, 1, h),
                         q, k_cache, v_cache, rows, positions, inv_freq, _at(table, 2, h), _at(table, 3, h),
                         q_partial, q_counter, M, HIDDEN, q_kb, q_bps, eps, c_sb, c_sp, c_sh, HEADS, KV_HEADS, HALF,
                         QK_NORM, Q_SPLIT, Q_BLOCK_M, Q_BLOCK_K, Q_STAGES, Q_EVEN_K, IEEE, Q_DOT, Q_K_MAJOR, HALF_P,
                         HEADS_P)
        elif phase == 1:
            n0 = M * KV_HEADS * CHUNKS
            fd._split_program(i % n0, i // n0, q, k_cache, v_cache, lengths, lengths, part_out, part_lse, err,
                              scale_log2, max_len, split_unit, splits, KV_HEADS, HEADS, HEADS * D, D, c_sb, c_sp,
                              c_sh, c_sb, c_sp, c_sh, 0, 0, 0, 0, limits, GROUP, A_HEADS, CHUNKS, D, A_BLOCK_N, 0,
                              False)
        elif phase == 2:
            fd._merge_program(i, part_out, part_lse, lengths, attn, part_lse, max_len, split_unit, splits, HEADS, D,
                              SPLIT_BLOCK, False)
        elif phase == 3:
            tile, split, mb, _, _ = _slab(i, o_tiles, HEADS * D, o_kb, o_bps, O_SPLIT, O_BLOCK_K)
            _linear_residual_program(tile, split, mb, o_tiles, attn, _at(table, 4, h), stream, out, o_partial,
                                     o_counter, M, HEADS * D, HIDDEN, o_kb, o_bps, O_SPLIT, O_BLOCK_M, O_BLOCK_K,
                                     O_STAGES, O_EVEN_K, IEEE, O_DOT, O_K_MAJOR, O_BLOCK_N, O_EVEN_N)
        elif phase == 4:
            tile, split, mb, _, _ = _slab(i, gu_tiles, HIDDEN, gu_kb, gu_bps, GU_SPLIT, GU_BLOCK_K)
            _gate_up_program(tile, split, mb, gu_tiles, tl.cdiv(M, GU_BLOCK_M), out, _at(table, 5, h),
                             _at(table, 6, h), g, gu_partial, gu_counter, M, HIDDEN, INTER, gu_kb, gu_bps, eps,
                             GU_SPLIT, GU_BLOCK_M, GU_BLOCK_K, GU_STAGES, GU_EVEN_K, IEEE, GU_DOT, GU_K_MAJOR,
                             GU_BLOCK_N, GU_EVEN_N)
        else:
            tile, split, mb, _, _ = _slab(i, d_tiles, INTER, d_kb, d_bps, D_SPLIT, D_BLOCK_K)
            _linear_residual_program(tile, split, mb, d_tiles, g, _at(table, 7, h), out, out, d_partial, d_counter,
                                     M, INTER, HIDDEN, d_kb, d_bps, D_SPLIT, D_BLOCK_M, D_BLOCK_K, D_STAGES,
                                     D_EVEN_K, IEEE, D_DOT, D_K_MAJOR, D_BLOCK_N, D_EVEN_N)
        # Every thread's stores before the releases that count this task done on the counters of what it wrote.
        tl.debug_barrier()
        first = tl.load(entry + SIGNAL_FIRST)
        for j in range(tl.load(entry + SIGNAL_COUNT)):
            tl.atomic_add(done + first + j, 1, sem="release", scope="gpu")


# -- host side ------------------------------------------------------------------------

def settings(device: torch.device) -> dict:
    """decode.persistent's settings ({FIELDS: value}): weft.tuning's on GPUs, CPU_SETTINGS under the interpreter."""
    if device.type != "cuda":
        return dict(CPU_SETTINGS)
    found = tuning.value("decode.persistent", device)
    missing = [f for f in FIELDS if f not in found]
    unknown = [f for f in found if f not in FIELDS]
    if missing or unknown:
        raise tuning.TuningError(f"decode.persistent: fields {FIELDS} expected, missing {missing}, unknown {unknown}")
    return found


def resident_programs(kernel, num_warps: int, device: torch.device) -> int:
    """How many programs of the compiled `kernel` one SM holds at once: its registers (allocated per warp in
    units of 256), shared memory (and the 1 KiB the driver reserves a block) and threads against the SM's."""
    props = torch.cuda.get_device_properties(device)
    regs = getattr(props, "regs_per_multiprocessor", SM_REGISTERS)
    shared = getattr(props, "shared_memory_per_multiprocessor", SM_SHARED)
    threads = getattr(props, "max_threads_per_multi_processor", SM_THREADS)
    per_warp = -(-max(kernel.n_regs, 1) * 32 // 256) * 256
    by_regs = regs // (per_warp * num_warps)
    by_shared = shared // (kernel.metadata.shared + 1024)
    return max(0, min(by_regs, by_shared, threads // (32 * num_warps), SM_BLOCKS))


@declare_op()
def decode_step(h: torch.Tensor, weights: list[Optional[torch.Tensor]], inv_freq: torch.Tensor,
                positions: torch.Tensor, lengths: torch.Tensor, cache: torch.Tensor, heads: int, kv_heads: int,
                eps: float = 1e-6) -> torch.Tensor:
    """Every layer of a dense Llama-3 / Qwen3 decoder at one rank (TP = 1, no pipeline) for M tokens, one per
    sequence, in one persistent launch (module doc); returns the residual stream after the last layer (M,
    hidden): the final norm and the LM head are the caller's.

    h (M, hidden): the stream in (the embedding's output). weights: 8 a layer, layer after layer (LAYER_WEIGHTS):
    the input RMSNorm's weight (hidden,), the QKV projection (hidden, (heads + 2 kv_heads) head_dim) = [q | k | v],
    Qwen3's q and k norms' weights (head_dim,) (None, None in every layer for Llama), O (heads head_dim, hidden),
    the post-attention RMSNorm's weight (hidden,), gate/up (hidden, 2 I) = [gate | up], down (I, hidden).
    inv_freq (head_dim / 2,) fp32: the rotary frequencies. positions (M,) int64: token t's position in sequence t,
    lengths (M,) int32: positions + 1 (the sequence lengths after the step; neither checked against the other or
    the cache: that would need a host sync; a length outside [0, max_len] is recorded as flash_decode records it,
    and raised at the next call). cache (layers, 2, M, max_len, kv_heads, head_dim), contiguous: layer l's keys
    and values, sequence t in row t; the step's k and v are written into it.
    eps: every RMSNorm's. One dtype (bf16, fp16, fp32), head_dim 64, 128 or 256, everything contiguous on this
    rank's device, but that a projection may be stored K-contiguous (the transpose of a contiguous (N, K), as the
    fused ops take it), the same in every layer. The fused decode path's kernels' arithmetic (norm_qkv_rope,
    flash_decode, linear_residual, norm_gate_up_silu), which it replaces: their bits on the cpu backend, within
    rounding of them on GPUs (module doc)."""
    world = world_or_raise()
    _head_counts(heads, kv_heads)  # before the plan's key, where 2.0 would find the plan of 2
    found = plan(world, lambda: ("decode_step", signature(h), _weights_key(weights), signature(inv_freq),
                                 signature(positions), signature(lengths), signature(cache),
                                 cache.stride(), heads, kv_heads),
                 lambda: DecodeStepPlan(world, h, weights, inv_freq, positions, lengths, cache, heads, kv_heads, eps))
    return found.run(h, inv_freq, positions, lengths, cache, eps)


def _weights_key(weights) -> tuple:
    """The weights' part of the plan key: each tensor's signature, strides (a projection's layout) and address (the
    plan's address table holds them)."""
    return tuple(None if w is None else (signature(w), w.stride(), w.data_ptr()) for w in weights)


class _Gemv:
    """One projection's geometry in the step: the fused path's plan of it (GemvPlan: settings, splits, partials,
    tile counters) and its tile count."""

    def __init__(self, group, op, m, k, n, tiles, dtype, norm, k_major):
        self.p = p = GemvPlan(group, op, m, k, n, dtype, None, k_major)
        self.tiles = tiles(p)
        p.split_k(self.tiles, n, norm)
        self.tasks = self.tiles * p.split * p.m_blocks

    def constexprs(self, prefix: str, block_n: bool, even_n=None) -> dict:
        p = self.p
        out = {f"{prefix}_SPLIT": p.split, f"{prefix}_BLOCK_M": p.block_m, f"{prefix}_BLOCK_K": p.block_k,
               f"{prefix}_STAGES": p.stages, f"{prefix}_EVEN_K": p.even_k, f"{prefix}_DOT": p.dot,
               f"{prefix}_K_MAJOR": p.k_major}
        if block_n:
            out[f"{prefix}_BLOCK_N"] = p.block_n
            out[f"{prefix}_EVEN_N"] = even_n
        return out


def _gemv_tasks(g: _Gemv):
    """Each task of a GEMV phase (the standalone grid's order, _slab): (its column tile, its K split)."""
    i = np.arange(g.tasks)
    return i % g.tiles, (i // g.tiles) % g.p.split


def _splits_reading(g: _Gemv, first, end):
    """The K splits of GEMV phase `g` whose K ranges hold some of columns [first, end) of its input: (the first
    split, how many)."""
    rows = g.p.bps * g.p.block_k  # a split's K range
    lo = first // rows
    return lo, np.maximum(0, (end - 1) // rows + 1 - lo)


def task_table(layers: int, m: int, heads: int, kv_heads: int, d: int, chunks: int, splits: int, qkv: _Gemv,
               o_op: _Gemv, gu: _Gemv, down: _Gemv, hidden: int, inter: int):
    """The step's task table ((tasks, FIELDS_A_TASK) int32, phase-major: layer 0's QKV tasks, its ATTN tasks, ...,
    layer L-1's DOWN tasks) and how many counters it uses.

    A task waits for one counter, its input's: the counter of everything it reads, which the tasks that write
    those parts count up. A layer's counters, by the tasks that wait for them:
        QKV      a K split's (its K range of the stream: the previous layer's DOWN tiles holding those columns)
        ATTN     a KV head's (the q heads of its group and its k and v head: the QKV tiles that own them)
        MERGE    a KV head's (its (sequence, chunk, split) ATTN programs)
        O        a K split's (the q heads in its K range: their MERGE rows)
        GATE_UP  a K split's (O's tiles holding its K range's columns)
        DOWN     a K split's (GATE_UP's tiles holding its K range's columns)
    and a task counts itself done on the counter of each task group that reads what it wrote (a tile whose columns
    two K ranges share counts on both). The counter's target is how many tasks count on it. So no phase waits for
    the whole phase before it (a K split of O starts once its heads are merged, while others still merge), and a
    wait polls one word. Every task waited for is earlier in the table: the module doc's argument against
    deadlock."""
    group = heads // kv_heads
    heads_p = (heads + 2 * kv_heads) // qkv.tiles
    base, n = {}, 0
    for phase, count in ((QKV, qkv.p.split), (ATTN, kv_heads), (MERGE, kv_heads), (O, o_op.p.split),
                         (GATE_UP, gu.p.split), (DOWN, down.p.split)):
        base[phase], n = n, n + count
    per_layer = n
    signals = []  # per phase: (the task's first counter, relative to its layer's; how many)

    # QKV: tile t owns heads [heads_p t, +heads_p), all q, all k or all v (heads_p divides both counts); a group's
    # ATTN counter counts the tasks of each tile holding its q heads, its k head or its v head.
    tile, qkv_split = _gemv_tasks(qkv)
    head0, last = tile * heads_p, tile * heads_p + heads_p - 1
    g_first = np.where(head0 < heads, head0 // group, (head0 - heads) % kv_heads)
    g_last = np.where(head0 < heads, last // group, (last - heads) % kv_heads)
    signals.append((base[ATTN] + g_first, g_last - g_first + 1))
    # ATTN: program ((b kv_heads + kvh) chunks + c, split) is entry pid + (m kv_heads chunks) split.
    attn = np.arange(m * kv_heads * chunks * splits)
    attn_kvh = (attn % (m * kv_heads * chunks) // chunks) % kv_heads
    signals.append((base[MERGE] + attn_kvh, np.ones_like(attn)))
    # MERGE: row b heads + head writes the head's columns of O's input.
    merge = np.arange(m * heads)
    first, count = _splits_reading(o_op, merge % heads * d, merge % heads * d + d)
    signals.append((base[O] + first, count))
    # O, GATE_UP, DOWN: a tile's columns of the next phase's input (DOWN's: the next layer's QKV input).
    gemv_split = {QKV: qkv_split}
    for phase, g, width, n_cols, reader, reader_g, ahead in (
            (O, o_op, 2 * o_op.p.block_n, hidden, GATE_UP, gu, 0),
            (GATE_UP, gu, gu.p.block_n, inter, DOWN, down, 0),
            (DOWN, down, 2 * down.p.block_n, hidden, QKV, qkv, per_layer)):  # the next layer's QKV
        tile, gemv_split[phase] = _gemv_tasks(g)
        first, count = _splits_reading(reader_g, tile * width, np.minimum(n_cols, (tile + 1) * width))
        signals.append((base[reader] + ahead + first, count))
    # What each task waits for, relative to its layer's counters: a GEMV task its K split's, ATTN and MERGE their
    # KV head's.
    waits = [base[QKV] + gemv_split[QKV], base[ATTN] + attn_kvh, base[MERGE] + merge % heads // group,
             *(base[phase] + gemv_split[phase] for phase in (O, GATE_UP, DOWN))]
    # Each counter's target: how many tasks count on it (a QKV counter: the previous layer's DOWN tasks).
    target = np.zeros(per_layer, dtype=np.int64)
    for first, count in signals:
        for f, c in zip(np.broadcast_to(first, np.shape(count)) % per_layer, count):
            target[f:f + c] += 1
    layer_rows = np.concatenate([
        np.stack([np.full_like(w, phase), np.arange(len(w)), *np.broadcast_arrays(sig_first, sig_count), w,
                  np.ones_like(w), target[w % per_layer]], axis=1)
        for phase, ((sig_first, sig_count), w) in enumerate(zip(signals, waits))])
    code, signal, signal_count, wait, count = (CODE.value, SIGNAL_FIRST.value, SIGNAL_COUNT.value, WAIT_FIRST.value,
                                               WAIT_COUNT.value)
    table = []
    for layer in range(layers):
        t = layer_rows.copy()
        t[:, code] += layer * len(PHASE_NAMES)
        t[:, signal] += layer * per_layer
        t[:, wait] += layer * per_layer
        if layer == 0:  # layer 0's QKV reads h, which no task writes
            t[t[:, code] == QKV, wait] = 0
            t[t[:, code] == QKV, count] = 0
        if layer == layers - 1:  # the last DOWN's columns: no later layer reads them in this launch
            t[t[:, code] == layer * len(PHASE_NAMES) + DOWN, signal_count] = 0
        table.append(t)
    return np.concatenate(table).astype(np.int32), layers * per_layer


def _lines(g: "_Gemv", width: int, dtype: torch.dtype) -> int:
    """Prefetch addresses across a task's `width` columns of GEMV g's weight (_prefetch), as a power of two: one a
    128-byte line of a row, or one a column where the weight is K-contiguous."""
    return triton.next_power_of_2(width if g.p.k_major else triton.cdiv(width, 128 // dtype.itemsize))


class DecodeStepPlan(Plan):
    """decode_step of one signature (and one set of weight tensors): the task table, the workspaces, the
    counters, P and the launch."""

    def __init__(self, group, h, weights, inv_freq, positions, lengths, cache, heads, kv_heads, eps):
        super().__init__(group)
        device = group.device
        _operand("h", h, None, (None, None))
        m, hidden = h.shape
        dtype = h.dtype
        _head_counts(heads, kv_heads)
        if heads % kv_heads:
            raise ValueError(f"heads = {heads} is not a multiple of kv_heads = {kv_heads}")
        _operand("inv_freq", inv_freq, torch.float32, (None,))
        d = 2 * inv_freq.shape[0]
        if d not in fd.HEAD_DIMS:
            raise ValueError(f"inv_freq gives head_dim {d}; supported: {', '.join(map(str, fd.HEAD_DIMS))}")
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"cache must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dim() != 6 or cache.shape[1] != 2 or cache.shape[2] != m or cache.shape[4:] != (kv_heads, d):
            raise ValueError(f"cache must be (layers, 2, {m}, max_len, {kv_heads}, {d}) (h's {m} rows, kv_heads, "
                             f"head_dim), got {tuple(cache.shape)}")
        _operand("cache", cache, dtype, (None,) * 6)
        layers, max_len = cache.shape[0], cache.shape[3]
        if layers < 1 or max_len < 1:
            raise ValueError(f"cache holds {layers} layers of {max_len} positions: at least 1 of each")
        if not isinstance(weights, (list, tuple)) or not all(w is None or isinstance(w, torch.Tensor)
                                                             for w in weights):
            raise TypeError("weights must be a list of tensors (8 a layer, q_norm and k_norm may be None)")
        if len(weights) != 8 * layers:
            raise ValueError(f"weights holds {len(weights)} tensors: 8 a layer for the cache's {layers} layers "
                             f"({', '.join(LAYER_WEIGHTS)})")
        if m == 0 or hidden == 0:
            raise ValueError(f"h must have at least one row and column, got {tuple(h.shape)}")
        qk_norm = weights[2] is not None
        gate_up = weights[6]
        inter = gate_up.shape[1] // 2 if gate_up is not None and gate_up.dim() == 2 else 0
        if inter == 0:
            raise ValueError(f"weights[6] (layer 0's gate_up) must be ({hidden}, 2 I) with I >= 1")
        shapes = dict(attn_norm=(hidden,), qkv=(hidden, (heads + 2 * kv_heads) * d), q_norm=(d,), k_norm=(d,),
                      o=(heads * d, hidden), mlp_norm=(hidden,), gate_up=(hidden, 2 * inter), down=(inter, hidden))
        k_major = {}  # each projection's layout (decode.py's LAYOUTS), layer 0's: every layer's must be the same
        for j, w in enumerate(weights):
            what = LAYER_WEIGHTS[j % 8]
            name = f"weights[{j}] (layer {j // 8}'s {what})"
            if what in ("q_norm", "k_norm") and (w is None) != (not qk_norm):
                raise ValueError(f"{name}: give q_norm and k_norm in every layer, or in none (layer 0 "
                                 f"{'has' if qk_norm else 'has none'})")
            if w is None:
                continue
            if what in PROJECTIONS:
                stored = _weight_operand(name, w, dtype, shapes[what])
                if k_major.setdefault(what, stored) != stored:
                    raise ValueError(f"{name} is stored {'K' if stored else 'N'}-contiguous, layer 0's "
                                     f"{'K' if k_major[what] else 'N'}-contiguous: every layer's must be stored alike")
            else:
                _operand(name, w, dtype, shapes[what])
            _aligned(name, w)
            _same_device(device, **{name: w})
        for name, t, dt in (("positions", positions, torch.int64), ("lengths", lengths, torch.int32)):
            _operand(name, t, dt, (m,))
        _eps(eps)
        _same_device(device, h=h, inv_freq=inv_freq, positions=positions, lengths=lengths, cache=cache)
        s = settings(device)
        self.shape, self.dtype = (m, hidden), dtype

        # The projections as the fused path's plans make them (the same settings, so the same splits and bits).
        half = d // 2
        half_p = max(MIN_BLOCK, triton.next_power_of_2(half))
        qkv = _Gemv(group, "qkv", m, hidden, (heads + 2 * kv_heads) * d,
                    lambda p: (heads + 2 * kv_heads) // heads_per_program(p.block_n, half_p, heads, kv_heads),
                    dtype, True, k_major["qkv"])
        heads_p = (heads + 2 * kv_heads) // qkv.tiles
        o_op = _Gemv(group, "down" if heads * d > hidden else "o", m, heads * d, hidden,
                     lambda p: triton.cdiv(hidden, 2 * p.block_n), dtype, False, k_major["o"])
        gu = _Gemv(group, "gate_up", m, hidden, 2 * inter, lambda p: triton.cdiv(inter, p.block_n), dtype, True,
                   k_major["gate_up"])
        down = _Gemv(group, "down" if inter > hidden else "o", m, inter, hidden,
                     lambda p: triton.cdiv(hidden, 2 * p.block_n), dtype, False, k_major["down"])
        # Attention as flash_decode's plan makes it.
        group_heads = heads // kv_heads
        a_heads = min(max(16, triton.next_power_of_2(group_heads)), fd.MAX_HEADS_PER_PROGRAM)
        chunks = triton.cdiv(group_heads, a_heads)
        a_block_n = fd._block_n(d, device)
        splits, split_unit = fd._splits(m * kv_heads * chunks, max_len, a_block_n, device)
        self.errors = fd._errors(group)
        limits = min(max_len, fd.LIMIT)  # op 0 (flash_decode's record), no pages
        num_warps = max(x.p.num_warps for x in (qkv, o_op, gu, down))
        num_warps = max(num_warps, 4 if a_heads <= 32 else 8)

        # The task table and its counters (task_table), the address table.
        tasks, counters = task_table(layers, m, heads, kv_heads, d, chunks, splits, qkv, o_op, gu, down, hidden,
                                     inter)
        self.tasks = torch.from_numpy(tasks).to(device)
        self.n_tasks = self.tasks.shape[0]
        self.done = torch.zeros((counters,), dtype=torch.int32, device=device)
        table = []
        for j in range(layers):
            w = list(weights[8 * j:8 * j + 8])
            if not qk_norm:
                w[2] = w[3] = w[0]  # not read without QK_NORM
            table.append([t.data_ptr() for t in w])
        self.table = torch.tensor(table, dtype=torch.int64, device=device)
        # Workspaces, reused by every layer (module doc); token t's cache row (norm_qkv_rope's rows) is t, as
        # attention reads it.
        self.rows = torch.arange(m, dtype=torch.int64, device=device)
        self.q = torch.empty((m, heads, d), dtype=dtype, device=device)
        self.part_out, self.part_lse = fd._partial_buffers(m * heads, splits, d, device)
        self.attn = torch.empty((m, heads * d), dtype=dtype, device=device)
        self.g = torch.empty((m, inter), dtype=dtype, device=device)

        prefetch = s["prefetch_rows"]
        prefetch = triton.next_power_of_2(prefetch) if prefetch else 0
        ieee = dtype == torch.float32
        self.consts = (m, hidden, inter)
        self.tail = ((1.0 / math.sqrt(d)) * fd.LOG2E, max_len, split_unit, splits, limits, *cache.stride()[:5],
                     qkv.tiles, qkv.p.kb, qkv.p.bps, o_op.tiles, o_op.p.kb, o_op.p.bps, gu.tiles, gu.p.kb, gu.p.bps,
                     down.tiles, down.p.kb, down.p.bps)
        self.gemvs = (qkv, o_op, gu, down)
        constexprs = dict(HEADS=heads, KV_HEADS=kv_heads, HALF=half, QK_NORM=qk_norm, IEEE=ieee,
                          **qkv.constexprs("Q", False), HALF_P=half_p, HEADS_P=heads_p,
                          **o_op.constexprs("O", True, hidden % (2 * o_op.p.block_n) == 0),
                          **gu.constexprs("GU", True, inter % gu.p.block_n == 0),
                          **down.constexprs("D", True, hidden % (2 * down.p.block_n) == 0),
                          GROUP=group_heads, A_HEADS=a_heads, CHUNKS=chunks, A_BLOCK_N=a_block_n,
                          SPLIT_BLOCK=fd.SPLIT_BLOCK, PREFETCH_ROWS=prefetch,
                          Q_LINES=_lines(qkv, heads_p * d, dtype), O_LINES=_lines(o_op, 2 * o_op.p.block_n, dtype),
                          GU_LINES=_lines(gu, gu.p.block_n, dtype), D_LINES=_lines(down, 2 * down.p.block_n, dtype),
                          WAIT_BACKOFF_NS=s["wait_backoff_ns"])
        out = torch.empty_like(h)
        self.launch = Launch(decode_step_kernel, (1,),
                             self._args(h, out, cache, positions, lengths, inv_freq, eps, _itself),
                             constexprs, num_warps)
        if device.type == "cuda":
            per_sm = min(s["programs_per_sm"], resident_programs(self.launch.kernel, num_warps, device))
            if per_sm < 1:
                raise ValueError(f"decode_step's kernel does not fit an SM of {device} (registers "
                                 f"{self.launch.kernel.n_regs} a thread, shared memory "
                                 f"{self.launch.kernel.metadata.shared} bytes): no persistent launch possible")
            self.launch.grid = (min(self.n_tasks, num_sms(device) * per_sm), 1, 1)
        # else one program (module doc)
        self.programs = self.launch.grid[0]

    def _args(self, h, out, cache, positions, lengths, inv_freq, eps, a) -> tuple:
        (qkv, o_op, gu, down), m = self.gemvs, self.consts
        return (a(self.tasks), self.n_tasks, a(self.done), a(self.table), a(h), a(out),
                a(cache), a(self.rows), a(positions), a(lengths), a(inv_freq), a(self.q), a(self.part_out),
                a(self.part_lse), a(self.attn), a(self.g), a(qkv.p.partial), a(qkv.p.counter), a(o_op.p.partial),
                a(o_op.p.counter), a(gu.p.partial), a(gu.p.counter), a(down.p.partial), a(down.p.counter),
                a(self.errors.tensor), *m, eps, *self.tail)

    def run(self, h, inv_freq, positions, lengths, cache, eps):
        # A bad length an earlier call recorded raises before anything is launched (flash_decode's error word).
        self.errors.raise_recorded()
        out = torch.empty(self.shape, dtype=self.dtype, device=h.device)
        self.done.zero_()  # the phases' counters, on the stream before the launch (a memset node in a graph)
        self.launch(*self._args(h, out, cache, positions, lengths, inv_freq, _eps(eps), self.launch.address))
        return out


def _aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (its address goes into the step's table), got address "
                         f"{t.data_ptr():#x}")


# -- the operator (inference only: not differentiable) ----------------------------------------------------------
#   torch.ops.weft.decode_step(h, weights, inv_freq, positions, lengths, cache!, heads, kv_heads, eps) -> out
#                                                                     (the step's k and v written into cache)

@decode_step.define(mutates_args=("cache",))
def decode_step_op(h: torch.Tensor, weights: list[Optional[torch.Tensor]], inv_freq: torch.Tensor,
                   positions: torch.Tensor, lengths: torch.Tensor, cache: torch.Tensor, heads: int, kv_heads: int,
                   eps: float = 1e-6) -> torch.Tensor:
    return decode_step.eager(h, weights, inv_freq, positions, lengths, cache, heads, kv_heads, eps)


@decode_step_op.register_fake
def _(h, weights, inv_freq, positions, lengths, cache, heads, kv_heads, eps=1e-6):
    return h.new_empty(h.shape)


def _compile_cases():
    """Qwen3-8B's shapes at one rank (hidden 4096, 32 + 2 x 8 heads of 128, intermediate 12288) with the shipped
    settings' form at M = 1 (dot-free QKV and gate/up, tl.dot O and down, split-K everywhere) in bf16, with and
    without the q/k norm, the prefetch and the waits' sleep, and with QKV and down stored K-contiguous; and tl.dot
    everywhere at 8 rows (16 in a block), fp32."""
    out = []
    fma = dict(SPLIT=4, BLOCK_M=1, BLOCK_K=64, STAGES=2, EVEN_K=True, DOT=False, K_MAJOR=False)
    dot = dict(SPLIT=4, BLOCK_M=16, BLOCK_K=128, STAGES=3, EVEN_K=True, DOT=True, K_MAJOR=False)
    sig = dict(tasks="*i32", n_tasks="i32", done="*i32", layers="*i64", h=None, out=None,
               cache=None, rows="*i64", positions="*i64", lengths="*i32", inv_freq="*fp32", q=None, part_out="*fp32",
               part_lse="*fp32", attn=None, g=None, q_partial="*fp32", q_counter="*i32", o_partial="*fp32",
               o_counter="*i32", gu_partial="*fp32", gu_counter="*i32", d_partial="*fp32", d_counter="*i32",
               err="*i64", M="i32", HIDDEN="i32", INTER="i32", eps="fp32", scale_log2="fp32", max_len="i32",
               split_unit="i32", splits="i32", limits="i32", c_sl="i32", c_skv="i32", c_sb="i32", c_sp="i32",
               c_sh="i32", q_tiles="i32", q_kb="i32", q_bps="i32", o_tiles="i32", o_kb="i32", o_bps="i32",
               gu_tiles="i32", gu_kb="i32", gu_bps="i32", d_tiles="i32", d_kb="i32", d_bps="i32")
    for t, gemv, qk_norm, prefetch, k_major in (("*bf16", fma, True, 16, ()), ("*bf16", fma, False, 0, ()),
                                                ("*fp32", dot, True, 16, ()), ("*bf16", fma, True, 16, ("Q", "D"))):
        one = dict(sig, h=t, out=t, cache=t, q=t, attn=t, g=t)

        def op(prefix, block_n=None):
            c = {f"{prefix}_{k}": v for k, v in (dot if prefix in ("O", "D") else gemv).items()}
            c[f"{prefix}_K_MAJOR"] = prefix in k_major
            if block_n:
                c.update({f"{prefix}_BLOCK_N": block_n, f"{prefix}_EVEN_N": True})
            return c
        constexprs = dict(HEADS=32, KV_HEADS=8, HALF=64, QK_NORM=qk_norm, IEEE=t == "*fp32", **op("Q"), HALF_P=64,
                          HEADS_P=1, **op("O", 64), **op("GU", 64), **op("D", 64), GROUP=4, A_HEADS=16, CHUNKS=1,
                          A_BLOCK_N=64, SPLIT_BLOCK=fd.SPLIT_BLOCK, PREFETCH_ROWS=prefetch,
                          Q_LINES=128 if "Q" in k_major else 2, O_LINES=2, GU_LINES=1,
                          D_LINES=128 if "D" in k_major else 2, WAIT_BACKOFF_NS=200 if prefetch else 0)
        out.append((decode_step_kernel, one, constexprs,
                    dict(num_warps=4, divisible=("HIDDEN", "INTER", "c_sl", "c_skv", "c_sb", "c_sp", "c_sh"))))
    return out


COMPILE_CASES = _compile_cases()
