"""Probe: NVSHMEM device calls from stock Triton through torch's NVSHMEM symmetric memory, on a single H100 or H200 (PE 0 to
itself). Each experiment runs in its own process with a time limit, so a hang is reported and the next one runs.

    python scripts/probe_nvshmem.py [--timeout 60] [--out results.json]

Experiments (all on one GPU, signals in symmetric memory as uint64 words as NVSHMEM requires):
- put:            torch's `nvshmem.put` of 4 KiB to self, checked.
- signal_op:      `nvshmemx_signal_op` (SET) to self with the signal's address as an int64, then read back.
- put_signal:     `putmem_signal_block` + `signal_wait_until` (GE epoch) in one kernel, one call.
- repeat_1000:    the same kernel 1000 times, the epoch a runtime argument (do_not_specialize), data checked.
- recompile:      the same kernel at byte counts that Triton specialises differently (1, 16, 17): new cubins,
                  each of which needs nvshmemx_cumodule_init (torch's post-compile hook).
- graph:          the put+signal+wait kernel captured in a CUDA graph with its epoch read from a device counter
                  (a replayed graph cannot pass a new epoch), replayed 100 times.
- signal_add:     `nvshmemx_signal_op` ADD from a 128-thread program: does the thread-scoped call add 128 times?
- cmp_codes:      waits with NVSHMEM's GE and LE codes on a signal already past them return at once.
Prints one line per experiment: ok / FAILED (the error) / HUNG (past the limit), and the time per call where timed.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
import traceback

ENV = {
    # What NVSHMEM needs on one node through torch (found on 1 H100 / 2 H200s, torch 2.11, NVSHMEM 3.4.5).
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


def _kernels():
    import triton
    import triton.language as tl
    globals()["tl"] = tl  # Triton resolves `tl.constexpr` annotations in the module's globals
    import torch.distributed._symmetric_memory._nvshmem_triton as nvshmem
    from torch.distributed._symmetric_memory._nvshmem_triton import requires_nvshmem

    @requires_nvshmem
    @triton.jit
    def put_kernel(dst, src, nelems, pe):
        nvshmem.put(dst, src, nelems, pe)

    @requires_nvshmem
    @triton.jit(do_not_specialize=["value"])
    def signal_op_kernel(sig, value, op: tl.constexpr, pe):
        # The address as an integer: torch's wrapper declares it int64 (a pointer does not match its signature).
        nvshmem.signal_op(sig.to(tl.int64), value.to(tl.int64), op, pe)

    @requires_nvshmem
    @triton.jit(do_not_specialize=["epoch", "nbytes"])
    def put_signal_wait_kernel(dst, src, nbytes, sig, epoch, pe):
        nvshmem.putmem_signal_block(dst, src, nbytes.to(tl.int64), sig, epoch, 9, pe)  # SET
        nvshmem.signal_wait_until(sig, 5, epoch)  # GE

    @requires_nvshmem
    @triton.jit(do_not_specialize=["value"])
    def wait_kernel(sig, cmp: tl.constexpr, value):
        nvshmem.signal_wait_until(sig, cmp, value)

    @requires_nvshmem
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

    return dict(put=put_kernel, signal_op=signal_op_kernel, put_signal=put_signal_wait_kernel, wait=wait_kernel,
                put_signal_counter=put_signal_wait_counter_kernel)


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


def _stage(text):
    print(f"    reached: {text}", flush=True)


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


def _child(name, queue):
    os.environ.update(ENV)
    try:
        extra = EXPERIMENTS[name]()
        queue.put(("ok", extra))
    except BaseException as e:  # noqa: BLE001 - the probe reports whatever happened
        queue.put(("FAILED", {"error": f"{type(e).__name__}: {e}"[:800], "trace": traceback.format_exc()[-1500:]}))
    # Leave without NVSHMEM's and the process group's teardown (a hang there is not the experiment's).
    queue.close()
    queue.join_thread()
    os._exit(0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per experiment before it counts as hung")
    p.add_argument("--only", help="comma-separated experiment names")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(EXPERIMENTS)
    ctx = mp.get_context("spawn")
    results = {}
    for name in names:
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(name, queue))
        t0 = time.perf_counter()
        proc.start()
        proc.join(args.timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
        try:
            status, extra = queue.get(timeout=2)
        except Exception:  # noqa: BLE001 - nothing came back
            status, extra = None, {}
        if status is None and proc.exitcode == -9:
            status, extra = "HUNG", {"limit_s": args.timeout}
        elif status is None:
            status, extra = "FAILED", {"error": f"process exited {proc.exitcode} without a result"}
        extra["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = dict(status=status, **extra)
        shown = {k: v for k, v in extra.items() if k != "trace"}
        print(f"{name:12s} {status:7s} {shown}", flush=True)
        if status == "FAILED" and "trace" in extra:
            print(extra["trace"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
