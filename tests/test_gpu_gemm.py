"""GPU checks of the overlapped GEMMs (and linear_residual_ar, the decode GEMV with gemm_ar's all-reduce), run on
every rank:
`weft run -n N -m pytest tests/test_gpu_gemm.py -m gpu` (scripts/gpu_suite.sh)."""
import pytest
import torch
import torch.distributed as dist

import weft
from weft.kernels import gemm
from weft.kernels.gemm import matmul
from weft.testing.graphs import capture
from weft.testing.reference import all_gather_ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    torch.manual_seed(1234 + weft.rank())  # different inputs on every rank
    yield weft.world()


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def _partials_sum(a, b):
    """fp32 sum over ranks of a_r @ b_r (every rank's operands all-gathered)."""
    w = weft.world()
    a_all = torch.empty((w.world_size * a.shape[0], a.shape[1]), dtype=a.dtype, device=a.device)
    b_all = torch.empty((w.world_size * b.shape[0], b.shape[1]), dtype=b.dtype, device=b.device)
    all_gather_ref(a_all, a.contiguous(), w.group)
    all_gather_ref(b_all, b.contiguous(), w.group)
    acc = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    for r in range(w.world_size):
        acc += a_all.chunk(w.world_size)[r].float() @ b_all.chunk(w.world_size)[r].float()
    return acc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 520), (4096, 4096, 4096), (64, 136, 64)])
def test_matmul_matches_cublas(dtype, m, n, k):
    a = torch.randn(m, k, device=weft.device()).to(dtype)
    b = torch.randn(k, n, device=weft.device()).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=weft.device())
    matmul(a, b, out=out)
    assert _rel(out, a.float() @ b.float()) < 1e-2


@pytest.mark.parametrize("method", ["overlap", "baseline"])
@pytest.mark.parametrize("m,n,k", [(1024, 1792, 4096), (37, 200, 264), (512, 256, 128)])
def test_ag_gemm_matches_reference(method, m, n, k):
    w = weft.world()
    for it in range(3):
        a = torch.randn(m, k, device=w.device).to(torch.bfloat16)
        b = (torch.randn(k, n, device=w.device) / k ** 0.5).to(torch.bfloat16)
        a_all = torch.empty((w.world_size * m, k), dtype=a.dtype, device=w.device)
        all_gather_ref(a_all, a, w.group)
        out = torch.full((w.world_size * m, n), float("nan"), dtype=a.dtype, device=w.device)
        got, gathered = weft.ops.ag_gemm(a, b, method=method, out=out, return_gathered=True)
        assert torch.equal(gathered, a_all), (method, m, it)
        assert _rel(got, a_all.float() @ b.float()) < 1e-2, (method, m, n, k, it)


@pytest.mark.parametrize("method", ["overlap", "baseline", "overlap, weft chunk GEMMs"])
@pytest.mark.parametrize("m,n,k", [(8192, 1024, 512), (8 * 37, 136, 200), (8192, 4608, 1024)])
def test_gemm_rs_matches_reference(method, m, n, k):
    """"overlap" runs the chunk GEMMs on cuBLAS where few tiles fill the GPU badly (on 2 ranks: the second
    shape; on 4: the second and third), else on weft's GEMM; with a config passed in, always on weft's."""
    w = weft.world()
    m = m // 8 * w.world_size if m % 8 == 0 else 37 * w.world_size
    config = gemm.gpu_configs(weft.world().device)["medium"] if method.endswith("weft chunk GEMMs") else None
    for it in range(3):
        a = torch.randn(m, k, device=w.device).to(torch.bfloat16)
        b = (torch.randn(k, n, device=w.device) / k ** 0.5).to(torch.bfloat16)
        ref = _partials_sum(a, b).chunk(w.world_size)[w.rank]
        out = torch.full(ref.shape, float("nan"), dtype=a.dtype, device=w.device)
        got = weft.ops.gemm_rs(a, b, method=method.split(",")[0], out=out, config=config)
        assert _rel(got, ref) < 1e-2, (method, m, n, k, it)


@pytest.mark.parametrize("method", ["fused", "baseline"])
@pytest.mark.parametrize("m", [1, 8, 32, 128, 300])
def test_gemm_ar_matches_reference(method, m):
    w = weft.world()
    n, k = 5120, 3200
    for it in range(3):
        a = torch.randn(m, k, device=w.device).to(torch.bfloat16)
        b = (torch.randn(k, n, device=w.device) / k ** 0.5).to(torch.bfloat16)
        ref = _partials_sum(a, b)
        out = torch.full((m, n), float("nan"), dtype=a.dtype, device=w.device)
        got = weft.ops.gemm_ar(a, b, method=method, out=out)
        assert _rel(got, ref) < 1e-2, (method, m, it)


def test_overlapped_gemms_cuda_graph_replay_back_to_back():
    """Capture ag_gemm, gemm_rs and gemm_ar together; replay with fresh inputs, no host sync between replays."""
    w = weft.world()
    a1 = torch.randn(256, 512, device=w.device).to(torch.bfloat16)
    b1 = (torch.randn(512, 384, device=w.device) / 512 ** 0.5).to(torch.bfloat16)
    a2 = torch.randn(64 * w.world_size, 256, device=w.device).to(torch.bfloat16)
    b2 = (torch.randn(256, 512, device=w.device) / 256 ** 0.5).to(torch.bfloat16)
    a3 = torch.randn(8, 640, device=w.device).to(torch.bfloat16)
    b3 = (torch.randn(640, 5120, device=w.device) / 640 ** 0.5).to(torch.bfloat16)
    o1 = torch.empty(w.world_size * 256, 384, dtype=torch.bfloat16, device=w.device)
    o2 = torch.empty(64, 512, dtype=torch.bfloat16, device=w.device)
    o3 = torch.empty(8, 5120, dtype=torch.bfloat16, device=w.device)

    def step():
        weft.ops.ag_gemm(a1, b1, method="overlap", out=o1)
        weft.ops.gemm_rs(a2, b2, method="overlap", out=o2)
        weft.ops.gemm_ar(a3, b3, method="fused", out=o3)

    step()  # contexts are created outside capture
    g = capture(step)
    for it in range(4):
        for t in (a1, a2, a3):
            t.copy_(torch.randn(t.shape, device=w.device))
        for o in (o1, o2, o3):
            o.fill_(float("nan"))
        g.replay()
        g.replay()  # twice: the second proves the epochs advance inside the graph
        a_all = torch.empty((w.world_size * 256, 512), dtype=a1.dtype, device=w.device)
        all_gather_ref(a_all, a1, w.group)
        assert _rel(o1, a_all.float() @ b1.float()) < 1e-2, it
        assert _rel(o2, _partials_sum(a2, b2).chunk(w.world_size)[w.rank]) < 1e-2, it
        assert _rel(o3, _partials_sum(a3, b3)) < 1e-2, it
    dist.barrier(group=w.group)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_linear_residual_ar_matches_reference_and_replays(m):
    """linear_residual_ar (the decode step's O and down projections at TP > 1) against residual + the fp32 sum of
    every rank's a @ b, at Qwen3-8B's two-GPU O and down shapes: the same bits on every rank, eager and replayed
    from a CUDA graph on new inputs, its calls interleaved with gemm_ar's (they share the workspace's epochs)."""
    w = weft.world()
    shapes = [(4096 // w.world_size, 4096), (12288 // w.world_size, 4096)]  # (K shard, N): O, down
    ops = []
    for k, n in shapes:
        a = torch.randn(m, k, device=w.device).to(torch.bfloat16)
        b = (torch.randn(k, n, device=w.device) / k ** 0.5).to(torch.bfloat16)
        res = torch.randn(m, n, device=w.device).to(torch.bfloat16)
        dist.broadcast(res, 0, group=w.group)  # the residual stream is the same on every rank
        ops.append((a, b, res))

    def check(outs, what):
        for (a, b, res), got in zip(ops, outs):
            want = (_partials_sum(a, b).to(torch.bfloat16).float() + res.float()).to(torch.bfloat16)
            assert _rel(got, want) < 1e-2, (what, m, tuple(b.shape))
            every = [torch.empty_like(got) for _ in range(w.world_size)]
            dist.all_gather(every, got, group=w.group)
            assert all(torch.equal(e, got) for e in every), (what, "ranks got different bits")

    def step():
        out = [weft.ops.linear_residual_ar(a, b, res) for a, b, res in ops]
        weft.ops.gemm_ar(ops[0][0], ops[0][1], method="fused")
        return out

    for it in range(3):
        check(step(), f"eager {it}")
    outs = []
    g = capture(lambda: outs.extend(step()))
    for it in range(3):
        for a, b, res in ops:
            a.copy_(torch.randn(a.shape, device=w.device))
        g.replay()
        torch.cuda.synchronize()
        check(outs, f"replay {it}")
