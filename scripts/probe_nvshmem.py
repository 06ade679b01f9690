"""Probe: NVSHMEM's GPU-side calls from stock Triton kernels through torch's NVSHMEM symmetric memory, on one GPU
(PE 0 to itself) or on N GPUs of one host (N PEs). Each experiment runs in its own process (its own N processes, with their
own process group) with a time limit, so a hang is reported and the next one runs.

    python scripts/probe_nvshmem.py [--pes N] [--timeout 60] [--budget 170] [--out results.json]
    python scripts/probe_nvshmem.py --compile-check    # no GPU: compile every kernel for sm_90

--pes 1 (the default): one process on GPU 0. Experiments (signals in symmetric memory as uint64 words, as NVSHMEM
requires):
- put:            torch's `nvshmem.put` of 4 KiB to self, checked.
- signal_op:      `nvshmemx_signal_op` (SET) to self with the signal's address as an int64, then read back.
- put_signal:     `putmem_signal_block` + `signal_wait_until` (GE epoch) in one kernel, one call.
- repeat_1000:    the same kernel 1000 times, the epoch a runtime argument (do_not_specialize), data checked.
- recompile:      the same kernel at other num_warps: new cubins, each of which needs nvshmemx_cumodule_init
                  (torch's post-compile hook).
- graph:          the put+signal+wait kernel captured in a CUDA graph with its epoch read from a device counter
                  (a replayed graph cannot pass a new epoch), replayed 100 times.
- signal_add:     `nvshmemx_signal_op` ADD from a 128-thread program: does the thread-scoped call add 128 times?
- cmp_codes:      waits with NVSHMEM's GE and LE codes on a signal already past them return at once.

--pes N (N >= 2): N processes started by this script (multiprocessing's spawn, one per GPU 0..N-1; no torchrun),
rank r on GPU r, NCCL process group of the N, NVSHMEM bootstrapped by torch on the first symmetric allocation.
Every payload is made in the kernel from (call, sender, receiver), so a block from another call or sender shows;
every call's received bytes are copied out and compared bit for bit with an NCCL all_gather of what was sent.
- init:           process group, symmetric allocations, rendezvous; nvshmem my_pe / n_pes against the ranks.
- ring_put:       `nvshmem.put` (+ quiet) of 4 KiB to the next PE, checked on the receiver after a barrier.
- put_signal:     `putmem_signal_block` to the next PE + `signal_wait_until` (GE epoch) on its own flag, one
                  kernel: once, then 1000 calls back to back, epochs never reset (2N slots by epoch: in a ring a PE
                  may run up to N - 1 calls ahead of the next), time per call.
- exchange:       the rail exchange's protocol (weft/kernels/hierarchical.py): each PE puts a block to every other
                  PE (N - 1 `putmem_signal_block`, one flag word per source), then waits for the N - 1 flags;
                  double-buffered by epoch parity, 1000 calls, one program.
- exchange_ctas:  the same with one program per destination (block-scoped calls from N - 1 CTAs).
- graph:          the exchange captured in a CUDA graph, its epoch read from a device counter, 100 replays.
- recompile:      the exchange with new cubins mid-run (num_warps, byte counts of other divisibility), PE 0 on a
                  num_warps the others do not use in one phase.
- peer_load:      direct loads from a peer's symmetric buffer: through the rendezvous handle's `get_buffer` and
                  `get_remote_tensor` (a plain Triton load), and through `nvshmem_ptr` called in the kernel.
If init does not pass, the rest are skipped; each experiment's limit is cut to what is left of --budget seconds,
and one with less than 10 s left is skipped.

Prints one line per experiment: ok / FAILED (the error) / HUNG (past the limit) / SKIPPED, and the times. A PE's
"reached:" lines tell how far it got.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.distributed._symmetric_memory._nvshmem_triton as nvshmem
import triton
import triton.language as tl
from triton.language import core

ENV = {
    # What NVSHMEM needs on one node through torch (found on 1 H100 / 2 H200s, torch 2.11, NVSHMEM 3.4.5). The
    # caller's environment wins: a variable set there is kept.
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_DISABLE_CUDA_VMM": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
# NVSHMEM's own numbering (nvshmemi_cmp_type, nvshmemi_amo_t in its headers). torch's wrapper docstrings give
# SIGNAL_SET 0, SIGNAL_ADD 5, CMP_GE 3: in NVSHMEM, 0 and 5 are not SET (every op but SET adds) and 3 is LE, which
# is what made "the first call works, the next ones hang" (the second call's signal added past the LE bound).
SIGNAL_SET, SIGNAL_ADD = 9, 10
CMP_LE, CMP_GE = 3, 5


# The same codes as constexprs, for the kernels below.
SET = tl.constexpr(SIGNAL_SET)
GE = tl.constexpr(CMP_GE)


# -- the one-PE kernels -------------------------------------------------------------------------------------------

@triton.jit
def put_kernel(dst, src, nelems, pe):
    nvshmem.put(dst, src, nelems, pe)


@triton.jit(do_not_specialize=["value"])
def signal_op_kernel(sig, value, op: tl.constexpr, pe):
    # The address as an integer: torch's wrapper declares it int64 (a pointer does not match its signature).
    nvshmem.signal_op(sig.to(tl.int64), value.to(tl.int64), op, pe)


@triton.jit(do_not_specialize=["epoch", "nbytes"])
def put_signal_wait_kernel(dst, src, nbytes, sig, epoch, pe):
    nvshmem.putmem_signal_block(dst, src, nbytes.to(tl.int64), sig, epoch, 9, pe)  # SET
    nvshmem.signal_wait_until(sig, 5, epoch)  # GE


@triton.jit(do_not_specialize=["value"])
def wait_kernel(sig, cmp: tl.constexpr, value):
    nvshmem.signal_wait_until(sig, cmp, value)


@triton.jit
def put_signal_wait_counter_kernel(dst, src, nbytes, sig, counter, pe):
    # The epoch from device memory: what a replayed graph needs. One thread bumps it; the block reads it
    # after a barrier (every thread must agree on the value the block-scoped put signals).
    epoch = tl.load(counter) + 1
    tl.debug_barrier()
    nvshmem.putmem_signal_block(dst, src, nbytes, sig, epoch, 9, pe)  # SET
    nvshmem.signal_wait_until(sig, 5, epoch)  # GE
    tl.debug_barrier()
    tl.store(counter, epoch)


# -- the N-PE kernels ---------------------------------------------------------------------------------------------
# A byte count Triton specialises as the constant 1 cannot go to torch's wrappers (they call `.to` on it): the
# probes use counts of 3 bytes or more.

@core.extern
def nvshmem_ptr(addr, pe, _semantic=None):
    """NVSHMEM's `nvshmem_ptr(addr, pe)`: the address of `addr`'s symmetric twin on `pe` for direct loads, 0 where
    none (torch's wrappers have no such call)."""
    return core.extern_elementwise(
        "", "", [addr, pe], {(core.dtype("int64"), core.dtype("int32")): ("nvshmem_ptr", core.dtype("int64"))},
        is_pure=False, _semantic=_semantic)


@triton.jit
def pe_info_kernel(out):
    tl.store(out, nvshmem.my_pe())
    tl.store(out + 1, nvshmem.n_pes())


@triton.jit
def put_quiet_kernel(dst, src, nelems, pe):
    nvshmem.put(dst, src, nelems, pe)
    nvshmem.quiet()  # delivered, not only sent, when the kernel ends


@triton.jit
def _payload(idx, epoch, sender, receiver):
    """Bytes that change with the call (epoch), the sender and the receiver."""
    # The pair joins idx before the large factor: both may be constants (PE 1 is), and their product would not fit.
    x = (idx + (sender * 256 + receiver) * 4099) * 1540483477 + epoch * 668265263  # int32, wrapping
    x = x ^ (x >> 15)
    return (x & 255).to(tl.uint8)


@triton.jit
def _write_payload(dst, record, nbytes, epoch, sender, receiver, BLOCK: tl.constexpr):
    """The payload into `dst` (what is put) and `record` (what the reference gathers)."""
    offs = tl.arange(0, BLOCK)
    for lo in range(0, nbytes, BLOCK):
        idx = lo + offs
        val = _payload(idx, epoch, sender, receiver)
        tl.store(dst + idx, val, mask=idx < nbytes)
        tl.store(record + idx, val, mask=idx < nbytes)


@triton.jit
def _copy(dst, src, nbytes, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for lo in range(0, nbytes, BLOCK):
        idx = lo + offs
        tl.store(dst + idx, tl.load(src + idx, mask=idx < nbytes), mask=idx < nbytes)


@triton.jit(do_not_specialize=["epoch"])
def ring_put_signal_kernel(stage, recv, flags, sent, out, nbytes, slot_bytes, epoch, rows, me, npes,
                           SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Call `epoch` of the ring: this PE's payload into slot epoch % SLOTS of the next PE's `recv` with flag SET to
    epoch, then a wait (GE epoch) on its own flag of that slot and the received bytes copied to row epoch - 1 of
    `out` (the sent ones to that row of `sent`)."""
    row = (epoch - 1) % rows
    slot = epoch % SLOTS
    nxt = (me + 1) % npes
    _write_payload(stage, sent + row * slot_bytes, nbytes, epoch, me, nxt, BLOCK)
    tl.debug_barrier()  # the block's stores before the block-scoped put reads them
    nvshmem.putmem_signal_block(recv + slot * slot_bytes, stage, nbytes, flags + slot, epoch, SET, nxt)
    nvshmem.signal_wait_until(flags + slot, GE, epoch)
    _copy(out + row * slot_bytes, recv + slot * slot_bytes, nbytes, BLOCK)


@triton.jit(do_not_specialize=["epoch"])
def exchange_kernel(stage, recv, flags, sent, out, counter, nbytes, slot_bytes, epoch, rows, me,
                    N: tl.constexpr, EPOCH_FROM_COUNTER: tl.constexpr, BLOCK: tl.constexpr):
    """Call `epoch` of the rail exchange's protocol among N PEs: PE `me` puts its block for q into slot `me` of
    half epoch % 2 of q's `recv`, with flag `me` on q SET to epoch; then waits (GE epoch) for flag s of every
    other PE s and copies slot s to `out`. Each program takes every num_programs-th destination (one program: all
    of them, as weft's network_exchange_kernel). Rows of `out` and `sent`: (N, slot_bytes) per call, row
    epoch - 1. EPOCH_FROM_COUNTER (one program only): the epoch is the device counter + 1, stored back at the
    end, for a replayed CUDA graph."""
    if EPOCH_FROM_COUNTER:
        epoch = tl.load(counter) + 1
        tl.debug_barrier()  # every thread read the counter before one stores it back
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    half = epoch % 2
    row = (epoch - 1) % rows
    for i in range(1 + pid, N, nprog):
        q = (me + i) % N
        _write_payload(stage + q * slot_bytes, sent + (row * N + q) * slot_bytes, nbytes, epoch, me, q, BLOCK)
    if pid == 0:  # its own block: straight to `out`
        _write_payload(out + (row * N + me) * slot_bytes, sent + (row * N + me) * slot_bytes, nbytes, epoch, me,
                       me, BLOCK)
    tl.debug_barrier()  # the block's stores before the block-scoped puts read them
    for i in range(1 + pid, N, nprog):
        q = (me + i) % N
        nvshmem.putmem_signal_block(recv + (half * N + me) * slot_bytes, stage + q * slot_bytes, nbytes,
                                    flags + me, epoch, SET, q)
    for i in range(1 + pid, N, nprog):
        s = (me + N - i) % N
        nvshmem.signal_wait_until(flags + s, GE, epoch)
        _copy(out + (row * N + s) * slot_bytes, recv + (half * N + s) * slot_bytes, nbytes, BLOCK)
    if EPOCH_FROM_COUNTER:
        tl.debug_barrier()
        tl.store(counter, epoch)


@triton.jit
def copy_kernel(dst, src, nbytes, BLOCK: tl.constexpr):
    """Plain loads (no NVSHMEM call): `src` may be a peer's buffer mapped here."""
    _copy(dst, src, nbytes, BLOCK)


@triton.jit
def ptr_load_kernel(buf, out, where, nbytes, pe, BLOCK: tl.constexpr):
    """`buf` on PE `pe` read through the address nvshmem_ptr gives (stored in `where`; 0: no direct access)."""
    remote = nvshmem_ptr(buf.to(tl.int64), pe)
    tl.store(where, remote)
    if remote != 0:
        _copy(out, remote.to(tl.pointer_type(tl.uint8)), nbytes, BLOCK)


NVSHMEM_KERNELS = dict(
    put=put_kernel, signal_op=signal_op_kernel, put_signal=put_signal_wait_kernel, wait=wait_kernel,
    put_signal_counter=put_signal_wait_counter_kernel, pe_info=pe_info_kernel, put_quiet=put_quiet_kernel,
    ring=ring_put_signal_kernel, exchange=exchange_kernel, ptr_load=ptr_load_kernel)


_LAUNCHABLE = {}


def _kernels():
    """The kernels that call NVSHMEM, wrapped by torch's `requires_nvshmem` (it links libnvshmem_device.bc and
    runs nvshmemx_cumodule_init on each new cubin; on a GPU machine only), and the plain copy kernel."""
    if not _LAUNCHABLE:
        _LAUNCHABLE.update({name: nvshmem.requires_nvshmem(fn) for name, fn in NVSHMEM_KERNELS.items()},
                           copy=copy_kernel)
    return _LAUNCHABLE


def _setup():
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    symm_mem.set_backend("NVSHMEM")
    return torch, symm_mem


def _buffers(torch, symm_mem, nbytes=4096):
    src = symm_mem.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = symm_mem.empty(nbytes, dtype=torch.uint8, device="cuda")
    sig = symm_mem.empty(8, dtype=torch.int64, device="cuda")  # uint64 signal words
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda"))
    dst.fill_(0)
    sig.zero_()
    torch.cuda.synchronize()
    return src, dst, sig


def exp_put():
    torch, symm_mem = _setup()
    k = _kernels()
    src, dst, _ = _buffers(torch, symm_mem)
    k["put"][(1,)](dst, src, src.numel(), 0)
    torch.cuda.synchronize()
    assert torch.equal(dst, src), "put: data differs"
    return {}


def exp_signal_op():
    torch, symm_mem = _setup()
    k = _kernels()
    _, _, sig = _buffers(torch, symm_mem)
    k["signal_op"][(1,)](sig, 7, SIGNAL_SET, 0, num_warps=1)
    torch.cuda.synchronize()
    assert int(sig[0]) == 7, f"signal_op SET: signal is {int(sig[0])}, not 7"
    return {}


def exp_signal_add():
    torch, symm_mem = _setup()
    k = _kernels()
    _, _, sig = _buffers(torch, symm_mem)
    k["signal_op"][(1,)](sig, 1, SIGNAL_ADD, 0, num_warps=4)
    torch.cuda.synchronize()
    # nvshmemx_signal_op is thread-scoped: Triton calls an extern once per thread, so 128 adds, not one.
    return {"signal after one ADD of 1 from a 128-thread program": int(sig[0])}


def exp_put_signal():
    torch, symm_mem = _setup()
    k = _kernels()
    src, dst, sig = _buffers(torch, symm_mem)
    k["put_signal"][(1,)](dst, src, src.numel(), sig, 1, 0)
    torch.cuda.synchronize()
    assert torch.equal(dst, src) and int(sig[0]) == 1, f"put_signal: signal {int(sig[0])}"
    return {}


_PE_PREFIX = ""  # "[PE r] " in an N-PE experiment's processes


def _stage(text):
    print(f"    {_PE_PREFIX}reached: {text}", flush=True)


def exp_put_repeat():
    torch, symm_mem = _setup()
    k = _kernels()
    src, dst, _ = _buffers(torch, symm_mem)
    for i in range(1000):
        k["put"][(1,)](dst, src, src.numel(), 0)
        if i < 3:
            torch.cuda.synchronize()
            _stage(f"put call {i + 1}")
    torch.cuda.synchronize()
    assert torch.equal(dst, src), "put: data differs"
    return {}


def exp_cmp_codes():
    # With the signal at 5: "GE 4" and "LE 6" must return at once (a wrong code would spin forever).
    torch, symm_mem = _setup()
    k = _kernels()
    _, _, sig = _buffers(torch, symm_mem)
    sig.fill_(5)
    torch.cuda.synchronize()
    k["wait"][(1,)](sig, CMP_GE, 4)
    torch.cuda.synchronize()
    _stage("GE 4 returned")
    k["wait"][(1,)](sig, CMP_LE, 6)
    torch.cuda.synchronize()
    return {}


def exp_put_signal_steps():
    torch, symm_mem = _setup()
    k = _kernels()
    src, dst, sig = _buffers(torch, symm_mem)
    kernel = k["put_signal"]
    for epoch in range(1, 11):
        kernel[(1,)](dst, src, src.numel(), sig, epoch, 0)
        torch.cuda.synchronize()
        _stage(f"call {epoch}, signal {int(sig[0])}")
    return {}


def exp_repeat_1000():
    torch, symm_mem = _setup()
    k = _kernels()
    src, dst, sig = _buffers(torch, symm_mem)
    kernel = k["put_signal"]
    kernel[(1,)](dst, src, src.numel(), sig, 1, 0)
    torch.cuda.synchronize()
    _stage("first call")
    t0 = time.perf_counter()
    for epoch in range(2, 1002):
        kernel[(1,)](dst, src, src.numel(), sig, epoch, 0)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 1000
    assert torch.equal(dst, src) and int(sig[0]) == 1001, f"repeat: signal {int(sig[0])}"
    return {"us per call (eager, host-bound)": round(dt * 1e6, 2)}


def exp_recompile():
    torch, symm_mem = _setup()
    k = _kernels()
    src, dst, sig = _buffers(torch, symm_mem)
    kernel = k["put_signal"]
    epoch = 0
    for warps, nbytes in ((1, 1), (2, 16), (4, 17), (8, 4096), (1, 17), (2, 1)):  # each num_warps: a new cubin
        epoch += 1
        dst.zero_()
        kernel[(1,)](dst, src, nbytes, sig, epoch, 0, num_warps=warps)
        _stage(f"num_warps {warps}, {nbytes} bytes")
        torch.cuda.synchronize()
        assert torch.equal(dst[:nbytes], src[:nbytes]), f"recompile: {nbytes} bytes differ"
        assert int(sig[0]) == epoch, f"recompile: signal {int(sig[0])} after epoch {epoch}"
    return {}


def exp_graph():
    torch, symm_mem = _setup()
    k = _kernels()
    src, dst, sig = _buffers(torch, symm_mem)
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    kernel = k["put_signal_counter"]
    kernel[(1,)](dst, src, src.numel(), sig, counter, 0)  # compile (and run once) outside capture
    torch.cuda.synchronize()
    _stage(f"eager call, counter {int(counter[0])}")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            kernel[(1,)](dst, src, src.numel(), sig, counter, 0)
    torch.cuda.synchronize()
    _stage("captured")
    graph.replay()
    torch.cuda.synchronize()
    _stage(f"one replay, counter {int(counter[0])}")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    assert int(counter[0]) == 102 and int(sig[0]) == 102, f"graph: counter {int(counter[0])}, signal {int(sig[0])}"
    assert torch.equal(dst, src)
    return {"us per replay": round(start.elapsed_time(end) * 1000 / 100, 2)}


EXPERIMENTS = {name[4:]: fn for name, fn in globals().items() if name.startswith("exp_")}


# -- N PEs ----------------------------------------------------------------------------------------------------------

BLOCK_BYTES = 4096  # each put's payload
COPY_BLOCK = 1024  # bytes a program moves per step of its loops


class Pe:
    """This PE in an N-PE experiment: its rank (its GPU, and its NVSHMEM PE) and the kernels."""

    def __init__(self, rank: int, npes: int):
        self.rank, self.npes = rank, npes
        self.nxt, self.prv = (rank + 1) % npes, (rank - 1) % npes
        torch.cuda.set_device(rank)
        t0 = time.perf_counter()
        dist.init_process_group("nccl", rank=rank, world_size=npes, device_id=torch.device("cuda", rank))
        self.init_s = time.perf_counter() - t0
        symm_mem.set_backend("NVSHMEM")
        self.k = _kernels()

    def symmetric(self, *shape, dtype=None):
        """A zeroed symmetric tensor (collective: every PE allocates the same, in the same order)."""
        return symm_mem.empty(*shape, dtype=dtype or torch.uint8, device="cuda").zero_()

    def local(self, *shape, dtype=None):
        return torch.zeros(*shape, dtype=dtype or torch.uint8, device="cuda")

    def ready(self):
        """Every PE's buffers are zeroed before any peer writes into them."""
        torch.cuda.synchronize()
        dist.barrier()

    def gathered(self, t):
        """(npes, *t.shape): every PE's `t`, by NCCL (the reference)."""
        out = torch.empty((self.npes, *t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous())
        return out


def _blocks_differ(got, want, what):
    """None where `got` equals `want` (both (calls, sources, bytes)), else which blocks differ."""
    if torch.equal(got, want):
        return None
    bad = (got != want).flatten(2).any(-1).nonzero().tolist()
    return f"{what}: {len(bad)} blocks differ, first (call, source) {bad[:4]}"


def _timed(pe, calls, launch):
    """launch(i) for i in range(calls) back to back: (µs per call on the host clock, µs per call between CUDA
    events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    for i in range(calls):
        launch(i)
    end.record()
    torch.cuda.synchronize()
    host = (time.perf_counter() - t0) / calls
    return round(host * 1e6, 2), round(start.elapsed_time(end) * 1000 / calls, 2)


def pes_init(pe):
    t0 = time.perf_counter()
    buf = pe.symmetric(BLOCK_BYTES)
    alloc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:  # reported, not required: only peer_load uses the handle
        handle = symm_mem.rendezvous(buf, dist.group.WORLD)
        rendezvous = {"rendezvous s": round(time.perf_counter() - t0, 2),
                      "peers the handle maps": [bool(p) for p in handle.buffer_ptrs]}
    except Exception as e:  # noqa: BLE001 - reported
        rendezvous = {"rendezvous": f"FAILED {type(e).__name__}: {e}"[:300]}
    info = pe.local(2, dtype=torch.int32)
    pe.k["pe_info"][(1,)](info)
    torch.cuda.synchronize()
    _stage(f"my_pe, n_pes {info.tolist()}")
    every = pe.gathered(info).tolist()
    assert every[pe.rank] == [pe.rank, pe.npes], f"my_pe, n_pes {every[pe.rank]}: not rank {pe.rank} of {pe.npes}"
    return {"init_process_group s": round(pe.init_s, 2), "first symmetric allocation s": round(alloc_s, 2),
            **rendezvous, "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}


def pes_ring_put(pe):
    src, dst = pe.symmetric(BLOCK_BYTES), pe.symmetric(BLOCK_BYTES)
    gen = torch.Generator(device="cuda").manual_seed(1000 + pe.rank)
    src.copy_(torch.randint(0, 256, (BLOCK_BYTES,), generator=gen, dtype=torch.uint8, device="cuda"))
    pe.ready()
    pe.k["put_quiet"][(1,)](dst, src, BLOCK_BYTES, pe.nxt)
    torch.cuda.synchronize()
    dist.barrier()
    _stage("put, barrier")
    every = pe.gathered(src)
    assert torch.equal(dst, every[pe.prv]), f"{int((dst != every[pe.prv]).sum())} bytes differ from PE {pe.prv}'s"
    return {}


def pes_put_signal(pe):
    n = pe.npes
    slots = 2 * n  # more than the N - 1 calls a PE may run ahead of the next in a ring
    calls = 1001  # one, then 1000
    stage, recv = pe.symmetric(BLOCK_BYTES), pe.symmetric(slots, BLOCK_BYTES)
    flags = pe.symmetric(slots, dtype=torch.int64)  # uint64 signal words
    sent, out = pe.local(calls, BLOCK_BYTES), pe.local(calls, BLOCK_BYTES)
    pe.ready()

    def launch(epoch):
        pe.k["ring"][(1,)](stage, recv, flags, sent, out, BLOCK_BYTES, BLOCK_BYTES, epoch, calls, pe.rank, n,
                           SLOTS=slots, BLOCK=COPY_BLOCK)

    launch(1)
    torch.cuda.synchronize()
    _stage(f"first call, flag {int(flags[1 % slots])}")
    host_us, device_us = _timed(pe, calls - 1, lambda i: launch(i + 2))
    _stage("1000 calls")
    every = pe.gathered(sent)
    flag = int(flags[calls % slots])
    problem = _blocks_differ(out.view(calls, 1, -1), every[pe.prv].view(calls, 1, -1), f"from PE {pe.prv}")
    assert problem is None, problem
    assert flag == calls, f"flag of the last call's slot is {flag}, not {calls}"
    return {"us per call (host)": host_us, "us per call (events)": device_us}


def _exchange_buffers(pe, calls):
    n = pe.npes
    bufs = dict(stage=pe.symmetric(n, BLOCK_BYTES), recv=pe.symmetric(2, n, BLOCK_BYTES),
                flags=pe.symmetric(n, dtype=torch.int64), sent=pe.local(calls, n, BLOCK_BYTES),
                out=pe.local(calls, n, BLOCK_BYTES), counter=pe.local(1, dtype=torch.int32))
    pe.ready()
    return bufs


def _exchange_call(pe, b, programs, epoch, calls, nbytes=BLOCK_BYTES, from_counter=False, **options):
    pe.k["exchange"][(programs,)](b["stage"], b["recv"], b["flags"], b["sent"], b["out"], b["counter"], nbytes,
                                  BLOCK_BYTES, epoch, calls, pe.rank, N=pe.npes, EPOCH_FROM_COUNTER=from_counter,
                                  BLOCK=COPY_BLOCK, **options)


def _exchange_check(pe, b, calls, nbytes=None):
    """Every call's blocks against the all_gather of what each PE sent (first `nbytes[call]` bytes of each)."""
    every = pe.gathered(b["sent"])  # (sender, call, receiver, bytes)
    want = every[:, :, pe.rank].transpose(0, 1)  # (call, sender, bytes)
    got = b["out"]
    if nbytes is not None:
        mask = torch.arange(BLOCK_BYTES, device="cuda") < torch.tensor(nbytes, device="cuda")[:, None]
        want, got = want * mask[:, None], got * mask[:, None]
    return _blocks_differ(got, want, "received")


def _exchange(pe, programs):
    calls = 1000
    b = _exchange_buffers(pe, calls)
    _exchange_call(pe, b, programs, 1, calls)
    torch.cuda.synchronize()
    _stage(f"first call, flags {b['flags'].tolist()}")
    host_us, device_us = _timed(pe, calls - 1, lambda i: _exchange_call(pe, b, programs, i + 2, calls))
    _stage(f"{calls} calls")
    problem = _exchange_check(pe, b, calls)
    assert problem is None, problem
    flags = b["flags"].tolist()
    assert all(f == calls for i, f in enumerate(flags) if i != pe.rank), f"flags {flags} after {calls} calls"
    return {"programs": programs, "us per call (host)": host_us, "us per call (events)": device_us}


def pes_exchange(pe):
    return _exchange(pe, 1)


def pes_exchange_ctas(pe):
    return _exchange(pe, pe.npes - 1)


def pes_graph(pe):
    replays = 100
    calls = replays + 2  # an eager call, one replay, then the timed replays
    b = _exchange_buffers(pe, calls)
    _exchange_call(pe, b, 1, 0, calls, from_counter=True)  # compiles, and runs epoch 1
    torch.cuda.synchronize()
    _stage(f"eager call, counter {int(b['counter'])}")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            _exchange_call(pe, b, 1, 0, calls, from_counter=True)
    torch.cuda.synchronize()
    _stage("captured")
    graph.replay()
    torch.cuda.synchronize()
    _stage(f"one replay, counter {int(b['counter'])}")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    problem = _exchange_check(pe, b, calls)
    counter = int(b["counter"])
    assert problem is None, problem
    assert counter == calls, f"counter {counter} after {calls} calls"
    return {"us per replay": round(start.elapsed_time(end) * 1000 / replays, 2)}


def pes_recompile(pe):
    # (num_warps, bytes): each new pair is a new cubin (byte counts specialise by divisibility by 16); PE 0 runs
    # one phase at a num_warps no other PE compiles, so it compiles while its peers wait in their kernels.
    phases = [(4, BLOCK_BYTES), (1, 3), (8 if pe.rank == 0 else 4, 17), (2, 16), (4, BLOCK_BYTES)]
    per_phase = 3
    calls = len(phases) * per_phase
    b = _exchange_buffers(pe, calls)
    nbytes, epoch = [], 0
    for warps, count in phases:
        for _ in range(per_phase):
            epoch += 1
            nbytes.append(count)
            _exchange_call(pe, b, 1, epoch, calls, nbytes=count, num_warps=warps)
        torch.cuda.synchronize()
        _stage(f"num_warps {warps}, {count} bytes")
    problem = _exchange_check(pe, b, calls, nbytes)
    assert problem is None, problem
    return {}


def pes_peer_load(pe):
    buf = pe.symmetric(BLOCK_BYTES)
    gen = torch.Generator(device="cuda").manual_seed(2000 + pe.rank)
    buf.copy_(torch.randint(0, 256, (BLOCK_BYTES,), generator=gen, dtype=torch.uint8, device="cuda"))
    every = pe.gathered(buf)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    pe.ready()
    found = {}

    def check(name, load):
        got = pe.local(BLOCK_BYTES)
        try:
            note = load(got)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported
            found[name] = f"FAILED {type(e).__name__}: {e}"[:300]
            return
        wrong = int((got != every[pe.nxt]).sum())
        found[name] = note or ("ok" if wrong == 0 else f"FAILED: {wrong} bytes differ from PE {pe.nxt}'s")

    for method in ("get_buffer", "get_remote_tensor"):  # host-made views of the peer's buffer, read by plain loads
        if not hasattr(handle, method):
            found[method] = "not in this torch"
            continue

        def load(got, method=method):
            peer = getattr(handle, method)(pe.nxt, (BLOCK_BYTES,), torch.uint8)
            pe.k["copy"][(1,)](got, peer, BLOCK_BYTES, BLOCK=COPY_BLOCK)

        check(method, load)

    def through_nvshmem_ptr(got):
        where = pe.local(1, dtype=torch.int64)
        pe.k["ptr_load"][(1,)](buf, got, where, BLOCK_BYTES, pe.nxt, BLOCK=COPY_BLOCK)
        torch.cuda.synchronize()
        return None if int(where) else "nvshmem_ptr gives 0 (no direct access to this peer)"

    check("nvshmem_ptr", through_nvshmem_ptr)
    _stage(f"{found}")
    dist.barrier()  # no PE leaves while a peer may still read its buffer
    assert not any(v.startswith("FAILED") for v in found.values()), found
    return found


PES_EXPERIMENTS = {name[4:]: fn for name, fn in globals().items() if name.startswith("pes_")}


# -- running them -----------------------------------------------------------------------------------------------

FAILED_GRACE_S = 5.0  # after one PE fails, how long the others get to report before they count as hung


def _finish(queue):
    # Leave without NVSHMEM's and the process group's teardown (a hang there is not the experiment's).
    queue.close()
    queue.join_thread()
    os._exit(0)


def _failure(e):
    return {"error": f"{type(e).__name__}: {e}"[:800], "trace": traceback.format_exc()[-1500:]}


def _child(name, queue):
    try:
        queue.put((0, "ok", EXPERIMENTS[name]()))
    except BaseException as e:  # noqa: BLE001 - the probe reports whatever happened
        queue.put((0, "FAILED", _failure(e)))
    _finish(queue)


def _pe_child(name, rank, npes, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(npes),
                      LOCAL_RANK=str(rank))
    globals()["_PE_PREFIX"] = f"[PE {rank}] "
    try:
        queue.put((rank, "ok", PES_EXPERIMENTS[name](Pe(rank, npes))))
    except BaseException as e:  # noqa: BLE001 - the probe reports whatever happened
        queue.put((rank, "FAILED", _failure(e)))
    _finish(queue)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(name, npes, limit):
    """One experiment in fresh processes (one per PE): {rank: (status, extra)} and the seconds it took."""
    import queue as queues

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if npes == 1:
        procs = [ctx.Process(target=_child, args=(name, queue))]
    else:
        port = _free_port()
        procs = [ctx.Process(target=_pe_child, args=(name, r, npes, port, queue)) for r in range(npes)]
    t0 = time.perf_counter()
    for proc in procs:
        proc.start()
    deadline, got = t0 + limit, {}
    while len(got) < npes and time.perf_counter() < deadline:
        try:
            rank, status, extra = queue.get(timeout=0.5)
        except queues.Empty:
            if all(proc.exitcode is not None for proc in procs):
                break  # all gone: nothing more will come
            continue
        got[rank] = (status, extra)
        if status == "FAILED":
            deadline = min(deadline, time.perf_counter() + FAILED_GRACE_S)
    while True:  # what came in while the last get waited
        try:
            rank, status, extra = queue.get(timeout=0.1)
        except queues.Empty:
            break
        got[rank] = (status, extra)
    for rank, proc in enumerate(procs):
        if proc.is_alive() and rank not in got:
            proc.kill()
            proc.join()
            got[rank] = ("HUNG", {"limit_s": round(deadline - t0, 1)})
        elif proc.is_alive():  # reported, then stuck on its way out
            proc.kill()
            proc.join()
        else:
            proc.join()
            got.setdefault(rank, ("FAILED", {"error": f"process exited {proc.exitcode} without a result"}))
    return got, round(time.perf_counter() - t0, 1)


def _summary(got, seconds, npes):
    """The experiment's record: ok only where every PE is; FAILED where one failed (its peers then hang or fail
    after it); else HUNG."""
    statuses = {status for status, _ in got.values()}
    status = "FAILED" if "FAILED" in statuses else "HUNG" if "HUNG" in statuses else "ok"
    if npes == 1:
        return dict(status=status, **got[0][1], seconds=seconds)
    return {"status": status, "seconds": seconds,
            "pes": {str(r): dict(status=s, **extra) for r, (s, extra) in sorted(got.items())}}


def _show(name, record):
    if "pes" not in record:
        shown = {k: v for k, v in record.items() if k not in ("status", "trace")}
        print(f"{name:14s} {record['status']:7s} {shown}", flush=True)
        if "trace" in record:
            print(record["trace"], flush=True)
        return
    pes = record["pes"]
    oks = [pe for pe in pes.values() if pe["status"] == "ok"]
    first = {k: v for k, v in oks[0].items() if k != "status"} if oks else {}
    print(f"{name:14s} {record['status']:7s} {record['seconds']} s, {len(oks)} of {len(pes)} PEs ok {first}",
          flush=True)
    for rank, pe in pes.items():
        if pe["status"] == "HUNG":
            print(f"{'':22s} PE {rank}: HUNG, killed after {pe['limit_s']} s", flush=True)
        elif pe["status"] != "ok":
            print(f"{'':22s} PE {rank}: {pe['status']} {pe['error']}", flush=True)
    traces = [pe["trace"] for pe in pes.values() if "trace" in pe]
    if traces:
        print(traces[0], flush=True)


# -- the compile check (no GPU) -----------------------------------------------------------------------------------

COMPILE_CASES = [
    # (kernel, signature, constexprs, num_warps)
    (put_kernel, dict(dst="*u8", src="*u8", nelems="i32", pe="i32"), {}, 4),
    (signal_op_kernel, dict(sig="*i64", value="i32", op="constexpr", pe="i32"), {"op": SIGNAL_SET}, 4),
    (put_signal_wait_kernel, dict(dst="*u8", src="*u8", nbytes="i32", sig="*i64", epoch="i32", pe="i32"), {},
     4),
    (wait_kernel, dict(sig="*i64", cmp="constexpr", value="i32"), {"cmp": CMP_GE}, 4),
    (put_signal_wait_counter_kernel,
     dict(dst="*u8", src="*u8", nbytes="i32", sig="*i64", counter="*i64", pe="i32"), {}, 4),
    (pe_info_kernel, dict(out="*i32"), {}, 4),
    (put_quiet_kernel, dict(dst="*u8", src="*u8", nelems="i32", pe="i32"), {}, 4),
    # The JIT makes an integer argument of 1 a constant: PE 1 as the target, or as `me`.
    (put_quiet_kernel, dict(dst="*u8", src="*u8", nelems="i32", pe="constexpr"), {"pe": 1}, 4),
    (ring_put_signal_kernel,
     dict(stage="*u8", recv="*u8", flags="*i64", sent="*u8", out="*u8", nbytes="i32", slot_bytes="i32",
                epoch="i32", rows="i32", me="i32", npes="i32", SLOTS="constexpr", BLOCK="constexpr"),
     {"SLOTS": 8, "BLOCK": COPY_BLOCK}, 4),
    (ring_put_signal_kernel,
     dict(stage="*u8", recv="*u8", flags="*i64", sent="*u8", out="*u8", nbytes="i32", slot_bytes="i32",
                epoch="i32", rows="i32", me="constexpr", npes="i32", SLOTS="constexpr", BLOCK="constexpr"),
     {"me": 1, "SLOTS": 4, "BLOCK": COPY_BLOCK}, 4),
    *[(exchange_kernel,
       dict(stage="*u8", recv="*u8", flags="*i64", sent="*u8", out="*u8", counter="*i32", nbytes="i32",
                  slot_bytes="i32", epoch="i32", rows="i32", me="i32", N="constexpr",
                  EPOCH_FROM_COUNTER="constexpr", BLOCK="constexpr"),
       {"N": 4, "EPOCH_FROM_COUNTER": from_counter, "BLOCK": COPY_BLOCK}, warps)
      for from_counter, warps in ((False, 4), (True, 4), (False, 1))],
    (exchange_kernel,
     dict(stage="*u8", recv="*u8", flags="*i64", sent="*u8", out="*u8", counter="*i32", nbytes="i32",
                slot_bytes="i32", epoch="i32", rows="i32", me="constexpr", N="constexpr",
                EPOCH_FROM_COUNTER="constexpr", BLOCK="constexpr"),
     {"me": 1, "N": 2, "EPOCH_FROM_COUNTER": False, "BLOCK": COPY_BLOCK}, 8),
    (copy_kernel, dict(dst="*u8", src="*u8", nbytes="i32", BLOCK="constexpr"), {"BLOCK": COPY_BLOCK}, 4),
    *[(ptr_load_kernel, dict(buf="*u8", out="*u8", where="*i64", nbytes="i32", pe=pe, BLOCK="constexpr"),
       {"BLOCK": COPY_BLOCK, **consts}, 4) for pe, consts in (("i32", {}), ("constexpr", {"pe": 1}))],
]


def compile_check(arch: int = 90) -> int:
    """Compile every kernel for sm_`arch` without a GPU, to a relocatable cubin (ptxas -c): the NVSHMEM calls stay
    unresolved externs, since libnvshmem_device.bc (linked in on the GPU machine) is not here. Returns the number
    of kernels that failed."""
    import importlib
    import re

    import torch.utils._triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # torch defines its NVSHMEM wrappers only where Triton finds a GPU.
    torch.utils._triton.has_triton = lambda: True
    importlib.reload(nvshmem)
    failed = 0
    for fn, signature, constexprs, warps in COMPILE_CASES:
        consts = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
        label = f"{fn.__name__} {constexprs or ''} num_warps={warps}"
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                                      target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": warps, "ptx_options": "-c"})
        except Exception as e:  # noqa: BLE001 - reported
            failed += 1
            print(f"FAILED {label}: {type(e).__name__}: {e}"[:2000], flush=True)
            continue
        externs = sorted(set(re.findall(r"\.extern \.func\s*(?:\([^)]*\))?\s*(\w+)", compiled.asm["ptx"])))
        print(f"ok     {label}: {len(compiled.asm['cubin'])} bytes, externs {externs}", flush=True)
    return failed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pes", type=int, default=1, help="PEs (GPUs of this host): 1 runs the one-GPU experiments")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per experiment before it counts as hung")
    p.add_argument("--budget", type=float, default=170.0,
                   help="seconds for the whole run: each experiment's limit is cut to what is left, and one with "
                        "less than 10 s left is skipped")
    p.add_argument("--only", help="comma-separated experiment names")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--compile-check", action="store_true",
                   help="no GPU needed: compile every kernel for sm_90 (NVSHMEM calls left unresolved) and exit")
    args = p.parse_args()
    if args.compile_check:
        raise SystemExit(1 if compile_check(90) else 0)
    if args.pes < 1:
        p.error(f"--pes must be 1 or more, not {args.pes}")
    experiments = EXPERIMENTS if args.pes == 1 else PES_EXPERIMENTS
    if args.timeout <= 0 or args.budget <= 0:
        p.error("--timeout and --budget must be positive")
    names = args.only.split(",") if args.only else list(experiments)
    unknown = [n for n in names if n not in experiments]
    if unknown:
        p.error(f"--only: no experiment {unknown} at --pes {args.pes} (there are {list(experiments)})")
    visible = torch.cuda.device_count()
    if visible < args.pes:
        p.error(f"--pes {args.pes} needs {args.pes} GPUs; {visible} visible")

    for key, value in ENV.items():  # before the experiments' processes start (and import torch)
        os.environ.setdefault(key, value)
    start = time.perf_counter()
    results = {}
    for name in names:
        left = args.budget - (time.perf_counter() - start)
        if args.pes > 1 and name != "init" and results.get("init", {}).get("status", "ok") != "ok":
            results[name] = {"status": "SKIPPED", "reason": "init did not pass"}
        elif left < 10:
            results[name] = {"status": "SKIPPED", "reason": f"--budget {args.budget} s spent"}
        else:
            got, seconds = _run(name, args.pes, min(args.timeout, left))
            results[name] = _summary(got, seconds, args.pes)
        if results[name]["status"] == "SKIPPED":
            print(f"{name:14s} SKIPPED {results[name]['reason']}", flush=True)
        else:
            _show(name, results[name])
        if args.out:  # after every experiment: a run cut short still leaves what it found
            with open(args.out, "w") as f:
                json.dump({"pes": args.pes, "env": {k: os.environ[k] for k in ENV},
                           "results": results} if args.pes > 1 else results, f, indent=1)


if __name__ == "__main__":
    main()
