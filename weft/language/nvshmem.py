"""The network primitives' NVSHMEM form: NVSHMEM's device library called from stock Triton, for GPUs whose
weft heaps are NVSHMEM's symmetric memory (torch's `symm_mem.set_backend("NVSHMEM")`: weft.init does it with
WEFT_RAIL=nvshmem on a world that spans nodes, docs/nodes.md).

`weft.language.shmem.putmem_signal_block` and `weft.language.signals.signal_wait_until` take `NVSHMEM=True` to
call these; the kernel is launched through torch's `requires_nvshmem` (it links libnvshmem_device.bc and runs
`nvshmemx_cumodule_init` on each new cubin). What scripts/probe_nvshmem.py found on H200s decides the form:
- NVSHMEM's own codes: weft's SIGNAL_SET (9) and CMP_GE (5) are NVSHMEM's (torch's wrapper docstrings give other
  numbers, with which the second call hangs);
- the block-scoped put with its signal (`nvshmemx_putmem_signal_block`: every thread of the program calls it with
  the same arguments, NVSHMEM treats it as one); no `nvshmemx_signal_op`, which is thread-scoped (an ADD from a
  128-thread program adds 128 times);
- byte counts as runtime values (a count the JIT specialises to the constant 1 is no tensor to convert);
- addresses are this PE's symmetric addresses (NVSHMEM translates them for the target PE), PEs are world ranks
  (`network_pe`).
Signal words are 64-bit (NVSHMEM's uint64_t signals): int64 tensors.
"""
import triton
import triton.language as tl
from triton.language import core

from .core import network_pe


@core.extern
def _putmem_signal_block(dst, src, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
    return core.extern_elementwise(
        "", "", [dst, src, nbytes, sig_addr, signal, sig_op, pe],
        {(core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("uint64"),
          core.dtype("int32"), core.dtype("int32")): ("nvshmemx_putmem_signal_block", core.dtype("int32"))},
        is_pure=False, _semantic=_semantic)


@core.extern
def _signal_wait_until(sig_addr, cmp, value, _semantic=None):
    return core.extern_elementwise(
        "", "", [sig_addr, cmp, value],
        {(core.dtype("int64"), core.dtype("int32"), core.dtype("uint64")): ("nvshmem_signal_wait_until",
                                                                            core.dtype("int32"))},
        is_pure=False, _semantic=_semantic)


@triton.jit
def putmem_signal_block(dst, src, nbytes, sig_addr, signal, sig_op: tl.constexpr, peer, heap):
    """`nbytes` from local `src` to `dst` (symmetric) on group rank `peer`, then `signal` into `sig_addr` (an int64
    signal word) there with `sig_op`, released after the data. Block-scoped: every thread calls it."""
    _putmem_signal_block(dst.to(tl.int64), src.to(tl.int64), nbytes.to(tl.int64), sig_addr.to(tl.int64),
                         signal.to(tl.int64).to(tl.uint64), tl.full([], sig_op, tl.int32), network_pe(peer, heap))


@triton.jit
def signal_wait_until(sig_addr, cmp: tl.constexpr, value):
    """Spin until the int64 signal word at `sig_addr` (mine) satisfies `cmp` against `value`; the loads after it
    see what was put before the signal. Returns NVSHMEM's status word (a token for `consume_token`)."""
    return _signal_wait_until(sig_addr.to(tl.int64), tl.full([], cmp, tl.int32), value.to(tl.int64).to(tl.uint64))
