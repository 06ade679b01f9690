"""The EP ops' symmetric workspace (MoeWorkspace: the high-throughput and low-latency ops share it), and the
rows as their kernels move them (in whole int32 words).

Buffers are double-buffered by call parity, one epoch counter per kernel (each takes `wl.next_epoch` once
per call): a sender writes half e % 2 of rank q in call e only after its own call e - 1 ended, in which it
waited for a word every program of q wrote in q's call e - 1, after q's call e - 2 (the last reader of the
half) had ended. LL regions are only ever written with LL words, so a stale word carries an older epoch.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ..common import signature_words, signatures, workspace, zero_everywhere
from .routing import RoutingErrorWord

HT_MAX_PROGRAMS = 1024  # the workspace's push flags: [program][rank] (scripts/probe_ep_ht.py sweeps moe.ht_programs)


class MoeWorkspace:
    """The MoE family's symmetric workspace, one per group, made once whatever the call sizes: the LL dispatch and
    LL combine regions (int64 LL words, zeroed: epoch 0 is never awaited; 3/8 of workspace_bytes each), the
    high-throughput receive region (1/4), each in two halves; the count table's LL words, the push flags
    [program][rank], and one epoch counter per kernel (and one for the high-throughput ops' signature check);
    the signature words (common.signature_words) of each LL kernel and of the high-throughput ops; the LL ops'
    receive hooks not yet run.

    And the error word (a RoutingErrorWord), where the kernels record a bad topk_idx row (check_rows): every
    EP op raises it on entry (and dispatches again after their launches: under the interpreter, kernels have
    run by then, so the call that passed the row raises)."""

    def __init__(self, group):
        heap, w = group.heap, group.size
        total = group.workspace_bytes // 4096 * 4096
        self.ll_half_words = total * 3 // 8 // 16  # a multiple of 32 words, as the LL kernels assume
        self.ll_dispatch = heap.empty((2 * self.ll_half_words,), torch.int64)
        self.ll_combine = heap.empty((2 * self.ll_half_words,), torch.int64)
        self.ht_half_words = total // 4 // 8
        self.ht = heap.empty((2 * self.ht_half_words,), torch.int32)
        self.table = heap.empty((2 * w * (w + 1),), torch.int64)  # [sender][tokens to each rank | bad rows]
        self.flags = heap.empty((HT_MAX_PROGRAMS * w,), torch.int32)
        # ll dispatch, ll combine, count exchange, push, wait, and the high-throughput ops' signature epochs
        self.counters = heap.empty((6,), torch.int64)
        self.ll_pending = {}  # LL op -> its RecvHook not yet run
        self.errors = RoutingErrorWord(group)
        self.error = self.errors.tensor
        # The LL ops' signature words (the cross-rank signature check), one set per kernel, as the epochs they
        # carry come from its own counter, and the group's SignatureWord; no epoch counter to resynchronise after a
        # mismatch: every call takes one epoch per kernel on every member.
        self.sig_dispatch, self.sig_combine = signature_words(group, w), signature_words(group, w)
        self.signatures = signatures(group)
        self.signatures.register(self.sig_dispatch)
        self.signatures.register(self.sig_combine)
        # The high-throughput ops' signature words, one set for both: ep_dispatch signs in its count exchange and
        # ep_combine in its push back, each with an epoch of counter 5, so that a dispatch on one member and a
        # combine on another meet in the same words. Their epoch counters are resynchronised after a mismatch: a
        # dispatch and a combine take epochs of different counters.
        self.sig_ht = signature_words(group, w)
        for i in (2, 3, 4, 5):
            self.signatures.register(self.sig_ht, self.counter(i))
        zero_everywhere(group, self.ll_dispatch, self.ll_combine, self.table, self.flags, self.counters,
                        self.sig_dispatch, self.sig_combine, self.sig_ht)

    def raise_routing_error(self) -> None:
        self.errors.raise_recorded()

    def counter(self, i: int) -> torch.Tensor:
        return self.counters[i:i + 1]


def _workspace(group) -> MoeWorkspace:
    return workspace(group, "moe", MoeWorkspace)


def _too_big(what: str, need: int, have: int) -> ValueError:
    return ValueError(f"{what} needs {need} bytes of the MoE workspace, which has {have} (workspace_bytes: set "
                      "WEFT_WORKSPACE_BYTES or weft.init(workspace_bytes=...) larger)")


# -- rows as the EP kernels move them -------------------------------------------------------

_ELEM = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
