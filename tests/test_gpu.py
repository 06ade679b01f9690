"""GPU checks, run on every rank: `weft run -n N -m pytest tests/test_gpu.py -m gpu` (scripts/gpu_suite.sh)."""
import pytest
import torch
import torch.distributed as dist

import weft
from weft.testing.graphs import capture
from weft.testing.reference import all_gather_ref, reduce_scatter_ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    torch.manual_seed(1 + weft.rank())  # torch's default seed is the same in every process: inputs must differ
    yield weft.world()


def _gathered(x):
    w = weft.world()
    ref = torch.empty((w.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_ref(ref, x, w.group)
    return ref


@pytest.mark.parametrize("method", ["push", "pull", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 37, 4096, 1 << 16])
def test_all_gather_matches_nccl(method, dtype, rows):
    w = weft.world()
    for sym in (False, True):
        for it in range(3):
            x = (torch.randn(rows, 3, device=w.device) * 50).to(dtype)
            ref = _gathered(x)
            out = weft.empty(ref.shape, dtype) if sym else torch.empty_like(ref)
            out.view(torch.uint8).fill_(0xFF)  # poison
            weft.ops.all_gather(x, out=out, method=method)
            assert torch.equal(out, ref), (method, dtype, rows, sym, it)


def test_all_gather_cuda_graph_replay():
    w = weft.world()
    x = torch.randn(1000, device=w.device)
    out = torch.empty(w.world_size * 1000, device=w.device)
    weft.ops.all_gather(x, out=out, method="pull")  # creates the context outside capture
    weft.ops.all_gather(x, out=out, method="push")

    def calls():
        weft.ops.all_gather(x, out=out, method="pull")
        weft.ops.all_gather(x * 1, out=out, method="push")

    g = capture(calls)
    for _ in range(5):
        x.copy_(torch.randn(1000, device=w.device))
        out.fill_(float("nan"))
        g.replay()
        assert torch.equal(out, _gathered(x))


def test_all_gather_from_side_stream():
    w = weft.world()
    s = torch.cuda.Stream()
    for _ in range(3):
        x = torch.randn(4097, device=w.device)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out = weft.ops.all_gather(x)
        torch.cuda.current_stream().wait_stream(s)
        assert torch.equal(out, _gathered(x))


def test_primitives_ring_exchange_and_put_signal():
    import sys
    import os
    sys.path.insert(0, os.path.dirname(__file__))
    from primitive_kernels import exchange_kernel, put_signal_kernel, ring_kernel

    w = weft.world()
    heap = w.heap.descriptor
    r, n = w.rank, w.world_size
    block = 1024
    data = weft.zeros((2 * block,), torch.int32)
    flags = weft.zeros((2,), torch.int32)
    acks = weft.zeros((2,), torch.int32)
    table = weft.zeros((n,), torch.int32)
    bar = weft.zeros((1 + n,), torch.int32)
    nbytes = 100003
    dst = weft.zeros((nbytes,), torch.uint8)
    sigs = [weft.zeros((2 + n,), torch.int32) for _ in range(3)]
    weft.barrier()
    outs = []
    for epoch in range(1, 201):  # back to back, no host sync
        out = torch.empty(block, dtype=torch.int32, device=w.device)
        ring_kernel[(1,)](data, flags, acks, out, heap, 1000, epoch, BLOCK=block)
        outs.append(out)
    torch.cuda.synchronize()
    prev = (r - 1) % n
    for epoch, out in enumerate(outs, 1):
        assert torch.equal(out[:1000].cpu(), prev * 100000 + epoch * 1000 + torch.arange(1000, dtype=torch.int32))
    for epoch in range(1, 51):
        out = torch.empty(n, dtype=torch.int32, device=w.device)
        exchange_kernel[(1,)](table, bar, out, heap, epoch)
        assert torch.equal(out.cpu(), epoch * 10 + torch.arange(n, dtype=torch.int32))
    for mode in range(3):
        for epoch in range(1, 11):
            g = torch.Generator().manual_seed(1000 * epoch + r)
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(w.device)
            expect = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(1000 * epoch + prev))
            out = torch.empty(nbytes, dtype=torch.uint8, device=w.device)
            put_signal_kernel[(1,)](dst, src, sigs[mode], out, heap, nbytes, epoch, MODE=mode)
            assert torch.equal(out.cpu(), expect), (mode, epoch)


def test_notify_all_and_wait_on_many_flags():
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from primitive_kernels import fan_in_kernel

    w = weft.world()
    per_rank = 9  # W * 9 flags: more than one group of 32 lanes from 4 ranks on
    total = w.world_size * per_rank
    flags = weft.zeros((total,), torch.int32)
    table = weft.zeros((total,), torch.int32)
    weft.barrier()
    outs = []
    for epoch in range(1, 101):
        out = torch.empty(total, dtype=torch.int32, device=w.device)
        fan_in_kernel[(1,)](flags, table, out, w.heap.descriptor, per_rank, epoch, num_warps=4)
        weft.ops.device_barrier()
        outs.append(out)
    for epoch, out in enumerate(outs, 1):
        assert torch.equal(out.cpu(), epoch * 1000 + torch.arange(total, dtype=torch.int32)), epoch


def test_device_barrier_back_to_back():
    for _ in range(100):
        weft.ops.device_barrier()
    torch.cuda.synchronize()


# -- all_reduce, reduce_scatter, broadcast ---------------------------------------------------

# Against NCCL summing in fp32: weft sums in fp32 too and rounds once, so results differ by at most the
# last bit of the dtype (fp32: in the order of summation only).
REDUCE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-3),
              torch.float16: dict(rtol=2e-3, atol=1e-3)}


def _nccl_sum(x):
    ref = x.to(torch.float32, copy=True)  # all_reduce is in place
    dist.all_reduce(ref, group=weft.world().group)
    return ref.to(x.dtype)


def _nccl_reduce_scatter(x):
    w = weft.world()
    ref = torch.empty((x.shape[0] // w.world_size, *x.shape[1:]), device=x.device)
    reduce_scatter_ref(ref, x.float(), w.group)
    return ref.to(x.dtype)


def _poisoned(n, dtype, offset=0):
    """n elements of NaN, starting `offset` elements into their allocation (offset 1: not 16-byte aligned)."""
    return torch.full((n + offset,), float("nan"), dtype=dtype, device=weft.device())[offset:]


@pytest.mark.parametrize("method", ["one_shot", "two_shot", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 1000, 1001, 16384, 65537, 98304, (1 << 20) + 3])
def test_all_reduce_matches_nccl(method, dtype, numel):
    z = weft.empty((numel,), dtype)  # for in place in symmetric memory: two-shot's zero-copy path
    for call in range(3):
        offset = call % 2  # every other call unaligned: the unvectorised path
        x = torch.randn(numel + offset, device=weft.device()).to(dtype)[offset:]
        x_before = x.clone()
        ref = _nccl_sum(x)
        out = _poisoned(numel, dtype, offset)
        assert weft.ops.all_reduce(x, method=method, out=out) is out
        torch.testing.assert_close(out, ref, **REDUCE_TOL[dtype], msg=lambda m: f"{method} call {call}: {m}")
        assert torch.equal(x, x_before), "input was modified"
        y = x.clone()
        assert weft.ops.all_reduce(y, method=method, out=y) is y
        assert torch.equal(y, out), "in place differs from out of place"
        z.copy_(x)
        assert weft.ops.all_reduce(z, method=method, out=z) is z
        assert torch.equal(z, out), "in place in symmetric memory differs from out of place"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, tail", [(1, ()), (37, (3,)), (4096, (65,)), ((1 << 18) + 1, ())])
def test_reduce_scatter_matches_nccl(dtype, rows, tail):
    w = weft.world()
    for call in range(3):
        x = torch.randn(w.world_size * rows, *tail, device=w.device).to(dtype)
        x_before = x.clone()
        ref = _nccl_reduce_scatter(x)
        out = _poisoned(ref.numel(), dtype).view(ref.shape)
        assert weft.ops.reduce_scatter(x, out=out) is out
        torch.testing.assert_close(out, ref, **REDUCE_TOL[dtype], msg=lambda m: f"call {call}: {m}")
        assert torch.equal(x, x_before), "input was modified"
        y = x.clone()
        block = y[w.rank * rows:(w.rank + 1) * rows]  # NCCL-style in place: my own row block of x
        weft.ops.reduce_scatter(y, out=block)
        assert torch.equal(block, out), "in place differs from out of place"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64])
@pytest.mark.parametrize("numel", [1, 4099, (1 << 20) + 5])
def test_broadcast_from_every_root(dtype, numel):
    w = weft.world()
    for root in range(w.world_size):
        if dtype.is_floating_point:
            x = torch.randn(numel, device=w.device).to(dtype)
        else:
            x = torch.randint(-100, 100, (numel,), dtype=dtype, device=w.device)
        ref = x.clone()
        dist.broadcast(ref, src=root, group=w.group)
        if w.rank != root:
            x.view(torch.uint8).fill_(0xFF)  # poison
        assert weft.ops.broadcast(x, root=root) is x
        assert torch.equal(x, ref), (root, w.rank)


def test_all_reduce_and_reduce_scatter_cuda_graph_replay():
    w = weft.world()
    x = torch.randn(100_003, device=w.device)
    xr = torch.randn(w.world_size * 5003, 3, device=w.device)
    outs = {m: torch.empty_like(x) for m in ("one_shot", "two_shot")}
    out_rs = torch.empty(5003, 3, device=w.device)

    def calls():
        for m, out in outs.items():
            weft.ops.all_reduce(x, method=m, out=out)
        weft.ops.reduce_scatter(xr, out=out_rs)

    calls()  # creates the workspaces outside capture
    g = capture(calls)
    for replay in range(5):
        x.copy_(torch.randn_like(x))
        xr.copy_(torch.randn_like(xr))
        for out in (*outs.values(), out_rs):
            out.fill_(float("nan"))
        g.replay()
        ref = _nccl_sum(x)
        for m, out in outs.items():
            torch.testing.assert_close(out, ref, **REDUCE_TOL[torch.float32], msg=lambda e: f"{m} {replay}: {e}")
        torch.testing.assert_close(out_rs, _nccl_reduce_scatter(xr), **REDUCE_TOL[torch.float32])


def test_all_reduce_from_side_stream():
    s = torch.cuda.Stream()
    for method in ("one_shot", "two_shot"):
        for _ in range(3):
            x = torch.randn(4097, device=weft.device())
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                out = weft.ops.all_reduce(x, method=method)
            torch.cuda.current_stream().wait_stream(s)
            torch.testing.assert_close(out, _nccl_sum(x), **REDUCE_TOL[torch.float32])


def test_reductions_back_to_back_no_host_sync():
    """50 calls cycling one_shot, two_shot, reduce_scatter and broadcast (a different rank late each time),
    with no host synchronisation until the end. Rank r holds (r + 1) * base, base the same everywhere,
    so every result is known on every rank without another collective."""
    w = weft.world()
    n = 40_320  # divisible by every world size up to 8
    m = n // w.world_size
    total = w.world_size * (w.world_size + 1) / 2
    results = []
    weft.barrier()
    for call in range(50):
        base = torch.randn(n, device=w.device, generator=torch.Generator(w.device).manual_seed(call))
        x = base * (w.rank + 1)
        if call % w.world_size == w.rank:
            torch.cuda._sleep(100_000)  # this rank arrives late
        kind = call % 4
        if kind < 2:
            got = weft.ops.all_reduce(x, method=("one_shot", "two_shot")[kind])
            want = base * total
        elif kind == 2:
            got = weft.ops.reduce_scatter(x)
            want = base[w.rank * m:(w.rank + 1) * m] * total
        else:
            root = call % w.world_size
            got = weft.ops.broadcast(x, root=root)
            want = base * (root + 1)
        results.append((call, got, want))
    torch.cuda.synchronize()
    for call, got, want in results:
        torch.testing.assert_close(got, want, msg=lambda e: f"call {call}: {e}")


def test_changing_sizes_allocate_nothing_and_large_messages_pass():
    """Eager calls at sizes that change every call, plain and strided tensors, into the auto paths: after one
    warm-up call per family nothing is allocated from the heap and no host barrier is made; messages larger
    than a workspace half go through in passes (or to NCCL) and stay correct."""
    w = weft.world()
    sizes = [3, 4096, 1 << 20, 77, (40 << 20) + 5, 513, 1 << 16]
    for method in ("one_shot", "two_shot", "auto"):
        weft.ops.all_reduce(torch.ones(64, device=w.device), method=method)
    for method in ("push", "pull", "auto"):
        weft.ops.all_gather(torch.ones(64, device=w.device), method=method)
    weft.ops.broadcast(torch.ones(64, device=w.device))
    used, barriers = w.heap.used, w.barriers
    for n in sizes * 2:
        x = torch.randn(n, device=w.device, dtype=torch.bfloat16)
        ref = x.clone()
        dist.all_reduce(ref, group=w.group)
        for method in ("auto", "two_shot"):
            torch.testing.assert_close(weft.ops.all_reduce(x, method=method), ref, rtol=2e-2, atol=2e-2)
        assert torch.equal(weft.ops.all_gather(x), _gathered(x))
        strided = torch.randn(n, 2, device=w.device)[:, 0]
        assert torch.equal(weft.ops.all_gather(strided, method="push"), _gathered(strided.contiguous()))
        rows = torch.randn(w.world_size * n, device=w.device)
        want = torch.empty(n, device=w.device)
        reduce_scatter_ref(want, rows, w.group)
        torch.testing.assert_close(weft.ops.reduce_scatter(rows), want, rtol=1e-5, atol=1e-5)
        assert (w.heap.used, w.barriers) == (used, barriers), n
    big = torch.randn(48 << 20, device=w.device)  # 192 MiB: more than a workspace half, in passes
    ref = big.clone()
    dist.all_reduce(ref, group=w.group)
    torch.testing.assert_close(weft.ops.all_reduce(big, method="two_shot"), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(weft.ops.all_gather(big, method="push"), _gathered(big))
    assert (w.heap.used, w.barriers) == (used, barriers)
