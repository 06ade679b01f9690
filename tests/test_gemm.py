"""The persistent TMA GEMM (weft.kernels.gemm) against torch.matmul, on one rank."""
import pytest
import torch

import weft
from weft.kernels.gemm import GemmConfig, matmul

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(x, ref):
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    yield
    weft.finalize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(37, 72, 104), (64, 64, 64), (1, 8, 8), (70, 40, 24)])
def test_matmul_matches_torch(dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    for _ in range(2):  # repeated calls, fresh data
        a = torch.randn(m, k, generator=g).to(dtype)
        b = torch.randn(k, n, generator=g).to(dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        matmul(a, b, out=out)
        ref = a.float() @ b.float()
        assert rel_err(out, ref) < TOL[dtype]


def test_matmul_config_and_k_zero():
    a = torch.randn(40, 16)
    b = torch.randn(16, 48)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=3, num_stages=1, num_warps=4, flatten=True)
    assert rel_err(matmul(a, b, config=cfg), a @ b) < 1e-5
    assert torch.equal(matmul(torch.empty(5, 0), torch.empty(0, 8)), torch.zeros(5, 8))


@pytest.mark.parametrize("a,b,exc,words", [
    (torch.randn(4, 6), torch.randn(6, 8), ValueError, "columns"),          # 6 fp32 = 24 bytes per row
    (torch.randn(4, 8), torch.randn(4, 8), ValueError, "rows"),
    (torch.randn(4, 8), torch.randn(8, 8).half(), TypeError, "same dtype"),
    (torch.randn(4, 8).int(), torch.randn(8, 8), TypeError, "a has dtype"),
    (torch.randn(8, 4).t(), torch.randn(8, 8), ValueError, "contiguous"),
    (torch.randn(2, 4, 8), torch.randn(8, 8), ValueError, "2-D"),
    ([[1.0]], torch.randn(8, 8), TypeError, "a must be a torch.Tensor"),
])
def test_matmul_rejects_bad_operands(a, b, exc, words):
    with pytest.raises(exc, match=words):
        matmul(a, b)
