"""send / recv on GPUs: `weft run -n 2 -m pytest tests/test_gpu_p2p.py -m gpu`. The route WEFT_P2P_KERNEL picks
(unset: per message, the kernel up to p2p.kernel_max_bytes) and weft's device kernel whatever it says (`forced_route`), bit-exact
from one chunk to messages spread over every program of the kernel in several chunks each, many times over (on
2x H100 the kernel once delivered only the first chunk of a four-chunk message: a race shows in some calls only);
a batch exchange both ways; send / recv captured in a CUDA graph and replayed on new data; a batch over both routes;
blocking sends of temporaries freed at once. M2N (m2n_dispatch / m2n_combine) from the first half of the ranks to the
rest at top-1, 2 and 8 against torch, eager and replayed from a CUDA graph on new inputs."""
import pytest
import torch
import torch.distributed as dist

import weft
from weft import tuning
from weft.kernels import p2p
from weft.runtime import settings
from weft.testing.graphs import capture
from weft.testing.reference import m2n_combine_ref

pytestmark = pytest.mark.gpu

# The last two: four chunks of the kernel's slots in one program at the old slot size; a message of 64 MiB that
# every program's part carries in more than one chunk at 2 GPUs' slots.
SHAPES = [(8,), (3, 5), (1000, 333), (2, 111, 4096), (8, 4096, 1024)]


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    yield weft.world()


def _message(shape, it):
    gen = torch.Generator(device="cuda").manual_seed(it)
    return torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)


def _exchange(shape, it):
    """Rank 0 sends, rank 1 receives into a NaN-poisoned tensor; the mismatched elements on rank 1."""
    me = weft.rank()
    x = _message(shape, it)
    if me == 0:
        weft.ops.send(x * 1, 1)
        return 0
    y = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    weft.ops.recv(y, 0)
    torch.cuda.synchronize()
    return int((y.view(torch.int16) != x.view(torch.int16)).sum())


def _all_intact():
    if weft.world_size() < 2:
        pytest.skip("needs 2 GPUs")
    if weft.rank() > 1:
        weft.barrier()
        return
    bad = [_exchange(shape, it) for shape in SHAPES for it in range(2)]
    weft.barrier()
    assert sum(bad) == 0, bad


def test_send_recv_bit_exact():
    _all_intact()


def test_send_recv_kernel_bit_exact():
    with p2p.forced_route(kernel=True):
        ws = p2p._workspace(weft.runtime.world.resolve(None))
        parts = [p2p.part_chunks(2 * 8 * 4096 * 1024, pid, ws) for pid in range(ws.programs)]
        assert ws.programs == 1 or min(parts) > 1, (ws.programs, ws.slot_bytes, parts)
        for _ in range(10):
            _all_intact()


def test_kernel_batch_exchange_and_graph_replay():
    if weft.world_size() < 2:
        pytest.skip("needs 2 GPUs")
    me = weft.rank()
    if me > 1:
        weft.barrier()
        return
    peer = 1 - me
    with p2p.forced_route(kernel=True):
        for n in (1, 4099, 3 << 20, 33 << 20):  # elements of bf16
            x = _message((n,), 10 * n + me)
            y = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
            for work in weft.ops.batch_isend_irecv([weft.ops.P2POp(weft.ops.isend, x, peer),
                                                    weft.ops.P2POp(weft.ops.irecv, y, peer)]):
                work.wait()
            assert torch.equal(y.view(torch.int16), _message((n,), 10 * n + peer).view(torch.int16)), n
        x = torch.empty(5 << 20, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)

        def step():
            if me == 0:
                weft.ops.send(x, 1)
                weft.ops.recv(y, 1)
            else:
                weft.ops.recv(y, 0)
                weft.ops.send(x, 0)
        graph = capture(step, warmups=1)
        for it in range(5):
            x.copy_(_message(x.shape, 100 * it + me))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), _message(x.shape, 100 * it + peer).view(torch.int16)), it
    weft.barrier()


def test_mixed_routes_batch_and_freed_temporaries():
    """One batch whose messages take both routes (the kernel's up to p2p.kernel_max_bytes, the process group's
    above); then blocking sends of temporaries freed at once, their memory rewritten by the next allocation on the
    caller's stream: the receiver still gets the bytes sent (a blocking call's stream join, no record_stream)."""
    if weft.world_size() < 2:
        pytest.skip("needs 2 GPUs")
    me = weft.rank()
    if me > 1:
        weft.barrier()
        return
    peer = 1 - me
    limit = tuning.value("p2p.kernel_max_bytes", torch.device("cuda"), weft.world_size())
    if limit != float("inf") and settings.get("WEFT_P2P_KERNEL") is None:
        sizes = (limit // 4, limit // 2 + 3)  # bf16 elements: under the threshold, over it
        for it in range(3):
            xs = [_message((n,), 7 * it + n + me) for n in sizes]
            ys = [torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda") for n in sizes]
            ops = [weft.ops.P2POp(weft.ops.isend, x, peer) for x in xs] + \
                [weft.ops.P2POp(weft.ops.irecv, y, peer) for y in ys]
            for work in weft.ops.batch_isend_irecv(ops):
                work.wait()
            for n, y in zip(sizes, ys):
                assert torch.equal(y.view(torch.int16), _message((n,), 7 * it + n + peer).view(torch.int16)), (it, n)
    for kernel in (True, False):
        with p2p.forced_route(kernel=kernel):
            for it in range(20):
                if me == 0:
                    weft.ops.send(_message((4096,), 1000 + it), 1)
                    torch.full((4096,), 7.0, dtype=torch.bfloat16, device="cuda")  # the freed memory, rewritten
                else:
                    y = torch.empty(4096, dtype=torch.bfloat16, device="cuda")
                    weft.ops.recv(y, 0)
                    assert torch.equal(y.view(torch.int16), _message((4096,), 1000 + it).view(torch.int16)), \
                        (kernel, it)
    weft.barrier()


@pytest.mark.parametrize("k", [1, 2, 8])
def test_m2n_against_torch_and_graph_replay(k):
    """M2N between the first half of the ranks and the rest: recv bit-exact, the combine within a rounding of the
    reference (the GPU may fuse the multiply-adds), calls eager and replayed from a CUDA graph on new inputs."""
    w = weft.world()
    if w.world_size < 2:
        pytest.skip("needs 2 GPUs")
    m = w.world_size // 2
    n = w.world_size - m
    senders, receivers = list(range(m)), list(range(m, w.world_size))
    sender = w.rank < m
    hidden, max_tokens = 7168 + 64, 96
    tokens = max_tokens - 5 if sender else 0
    x = torch.empty((tokens, hidden), dtype=torch.bfloat16, device="cuda")
    dest = torch.empty((tokens, k), dtype=torch.int64, device="cuda")
    weights = torch.empty((tokens, k), dtype=torch.float32, device="cuda")

    def fill(it):
        gen = torch.Generator(device="cuda").manual_seed(100 * it + w.rank)
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        dest.copy_(torch.randint(-1, n, dest.shape, device="cuda", generator=gen))
        weights.copy_(torch.rand(weights.shape, device="cuda", generator=gen))

    def step():
        recv, counts, handle = weft.ops.m2n_dispatch(x, dest, senders, receivers, max_tokens)
        y = (recv.float() * (w.rank + 1) + 0.5).to(torch.bfloat16) if not sender else None
        out = weft.ops.m2n_combine(y, weights if sender else None, handle)
        return recv, counts, out

    def check(recv, counts, out):
        torch.cuda.synchronize()
        every = [None] * w.world_size
        dist.all_gather_object(every, (x.cpu(), dest.cpu()), group=w.group)
        if sender:
            processed = lambda row, d: (row.float() * (m + d + 1) + 0.5).to(torch.bfloat16)  # noqa: E731
            want = m2n_combine_ref(x.cpu(), dest.cpu(), weights.cpu(), processed)
            torch.testing.assert_close(out.cpu(), want, rtol=1e-2, atol=1e-2)
        else:
            r = w.rank - m
            for s in range(m):
                xs, ds = every[s]
                rows = [xs[t] for t in range(ds.shape[0]) for j in range(k) if ds[t, j] == r]
                assert int(counts[s]) == len(rows)
                if rows:
                    assert torch.equal(recv[s, :len(rows)].cpu().view(torch.int16),
                                       torch.stack(rows).view(torch.int16))

    for it in range(3):  # eager
        fill(it)
        check(*step())
    fill(0)
    outputs = []
    graph = capture(lambda: outputs.extend(step()))
    for it in range(3, 6):  # replayed on new inputs
        fill(it)
        graph.replay()
        check(*outputs)
    weft.barrier()
