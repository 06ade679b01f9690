"""GPU checks, run on every rank: `weft run -n N -m pytest tests/test_gpu.py -m gpu` (scripts/gpu_suite.sh)."""
import pytest
import torch

import weft
from weft.testing.reference import all_gather_ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
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
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            weft.ops.all_gather(x, out=out, method="pull")
            weft.ops.all_gather(x * 1, out=out, method="push")
    torch.cuda.current_stream().wait_stream(s)
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


def test_device_barrier_back_to_back():
    for _ in range(100):
        weft.ops.device_barrier()
    torch.cuda.synchronize()
