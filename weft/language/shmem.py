"""OpenSHMEM-style data movement, named as in NVSHMEM's `libshmem_device`.

These are the network primitives: with `signal_op` and `signal_wait_until`, the only way a kernel reaches a
rank on another node (weft.runtime.topology). On the cpu backend every rank's heap, of every simulated node, is
mapped into every process (one shared file, the simulated network), so a put is a vectorised copy through
`network_at`, and the non-blocking forms are the blocking ones (stores complete at `quiet`). On GPUs the
node's peers are mapped the same way; another node's are not: there `putmem_signal_block` and
`signal_wait_until` take `NVSHMEM=True`, their NVSHMEM form (weft.language.nvshmem), on heaps of NVSHMEM's
symmetric memory (WEFT_RAIL=nvshmem); otherwise the hierarchical ops cross nodes through the process group.
Sizes are in bytes, as in SHMEM. `copy_bytes` is the program's local copy under the puts and gets (whole blocks
unmasked, then a masked tail), for kernels' own byte copies too.
"""
import triton
import triton.language as tl

from . import nvshmem
from .core import network_at
from .signals import quiet, signal_op


@triton.jit
def copy_bytes(dst, src, nbytes, BLOCK: tl.constexpr = 1024):
    """Copy `nbytes` from `src` to `dst` in this program (the copy under every put and get, and a kernel's own
    local copies): whole BLOCKs unmasked (vector loads and stores where the pointers' alignment is known), then
    the masked tail."""
    d = dst.to(tl.pointer_type(tl.int8), bitcast=True)
    s = src.to(tl.pointer_type(tl.int8), bitcast=True)
    offs = tl.arange(0, BLOCK)
    whole = nbytes // BLOCK * BLOCK
    for lo in range(0, whole, BLOCK):
        tl.store(d + lo + offs, tl.load(s + lo + offs))
    tail = whole + offs
    tl.store(d + tail, tl.load(s + tail, mask=tail < nbytes), mask=tail < nbytes)


@triton.jit
def putmem_block(dst, src, nbytes, peer, heap, BLOCK: tl.constexpr = 1024):
    """Copy `nbytes` from local `src` to `dst` (symmetric) on rank `peer`."""
    copy_bytes(network_at(dst, peer, heap), src, nbytes, BLOCK)
    quiet()


@triton.jit
def putmem_nbi_block(dst, src, nbytes, peer, heap, BLOCK: tl.constexpr = 1024):
    copy_bytes(network_at(dst, peer, heap), src, nbytes, BLOCK)


@triton.jit
def getmem_block(dst, src, nbytes, peer, heap, BLOCK: tl.constexpr = 1024):
    """Copy `nbytes` from `src` (symmetric) on rank `peer` to local `dst`."""
    copy_bytes(dst, network_at(src, peer, heap), nbytes, BLOCK)


@triton.jit
def putmem_signal_block(dst, src, nbytes, sig_addr, signal, sig_op: tl.constexpr, peer, heap,
                        BLOCK: tl.constexpr = 1024, NVSHMEM: tl.constexpr = False):
    """Put, then signal `peer` (release): the signal is seen only after the data. NVSHMEM: NVSHMEM's block-scoped
    put with signal (int64 signal words, `src` symmetric too where the transport is a network)."""
    if NVSHMEM:
        nvshmem.putmem_signal_block(dst, src, nbytes, sig_addr, signal, sig_op, peer, heap)
    else:
        copy_bytes(network_at(dst, peer, heap), src, nbytes, BLOCK)
        signal_op(sig_addr, signal, sig_op, peer, heap)


putmem_signal_nbi_block = putmem_signal_block
