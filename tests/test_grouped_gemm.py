"""The grouped GEMM (weft.ops.grouped_gemm) on cpu ranks against torch: bf16 / fp16 / fp32 by TMA and by pointer
loads, fp8 e4m3 with block scales; rows past each expert's count poisoned with NaN, which must not leak; bad
arguments refused before anything runs."""
import pytest

from weft.testing import run_ranks

TIMEOUT = 120


def _check_grouped(x, wt, counts, out, dtype):
    import torch

    for e in range(x.shape[0]):
        n = int(counts[e])
        ref = (x[e, :n].float() @ wt[e].float()).to(dtype)
        torch.testing.assert_close(out[e, :n], ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-2)


def _grouped_gemm(seed):
    """Both kernels on fresh inputs, two calls per plan: the TMA kernel (experts of 37 rows: row blocks of 16
    reach into the next expert; empty, partial and full experts; NaN in the rows past each count, which must
    not leak), and the pointer kernel where TMA cannot take the shape (K not whole BLOCK_Ks, N rows not whole
    16 bytes, x not 16-byte aligned)."""
    import torch

    import weft
    from weft.kernels.moe.grouped_gemm import CPU_CONFIG, tma_refusal

    g = torch.Generator().manual_seed(seed + weft.rank())
    cases = [(torch.bfloat16, 5, 37, 64, 40, True, 0), (torch.float32, 3, 20, 32, 36, True, 0),
             (torch.bfloat16, 4, 37, 48, 40, False, 0), (torch.bfloat16, 3, 9, 32, 37, False, 0),
             (torch.float32, 2, 8, 32, 16, False, 1)]
    for dtype, experts, cap, k, n, tma, shift in cases:
        for call in range(2):
            buf = torch.randn(experts * cap * k + shift, generator=g).to(dtype)
            x = buf[shift:].view(experts, cap, k)
            wt = torch.randn(experts, k, n, generator=g).to(dtype)
            counts = torch.randint(0, cap + 1, (experts,), generator=g, dtype=torch.int32)
            counts[0], counts[-1] = (0, cap) if call == 0 else (cap, 1)
            for e in range(experts):
                x[e, int(counts[e]):] = float("nan")
            assert (tma_refusal(x, wt, CPU_CONFIG.block_k) is None) == tma
            _check_grouped(x, wt, counts, weft.ops.grouped_gemm(x, wt, counts), dtype)
    return True


@pytest.mark.parametrize("w", [1, 2, 4])
def test_grouped_gemm(w):
    assert all(run_ranks(_grouped_gemm, w, 7, timeout=TIMEOUT))


def _grouped_gemm_configs():
    """The TMA kernel under other tilings: one row block per group, and a block of rows larger than an expert."""
    import torch

    import weft
    from weft.kernels.gemm import GemmConfig

    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 24, 64, generator=g).to(torch.bfloat16)
    wt = torch.randn(3, 64, 48, generator=g).to(torch.bfloat16)
    counts = torch.tensor([24, 0, 7], dtype=torch.int32)
    for cfg in (GemmConfig(16, 16, 16, 1, 1, 4, False), GemmConfig(32, 32, 32, 4, 1, 4, False)):
        _check_grouped(x, wt, counts, weft.ops.grouped_gemm(x, wt, counts, config=cfg), torch.bfloat16)
    return True


def test_grouped_gemm_configs():
    assert run_ranks(_grouped_gemm_configs, 1, timeout=TIMEOUT)[0]


# -- fp8 ------------------------------------------------------------------------------------------

def _fp8_reference(x, sx, w, sw, counts):
    """out[e, :n] = (x * its row scales) @ (w * its block scales), in fp64 from the fp8 values."""
    e, _, k = x.shape
    n = w.shape[2]
    xd = x.double() * sx.double().repeat_interleave(128, dim=2)
    wd = w.double() * sw.double().repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :k, :n]
    return [xd[i, :int(counts[i])] @ wd[i] for i in range(e)]


def _fp8_grouped_gemm(seed):
    """fp8 operands with block scales (fp8_rows / fp8_blocks, as the LL dispatch quantizes), against the fp64
    product of the dequantized values: N past one 128-column scale block and not a multiple of the tile; the
    weights' scales as a transposed view (DeepSeek-V3 stores them (N / 128, K / 128)); x starting off 16 bytes
    (copied for TMA); tilings whose K slices are a quarter and the whole of a scale block; NaN past the counts;
    and the quantization itself against its definition."""
    import torch

    import weft
    from weft.kernels.gemm import GemmConfig

    g = torch.Generator().manual_seed(seed + weft.rank())
    cases = [(3, 20, 256, 136, 0, None, False), (4, 9, 128, 40, 1, None, True),
             (2, 33, 384, 64, 0, GemmConfig(16, 32, 128, 1, 1, 4, False), False),
             (1, 5, 128, 300, 0, GemmConfig(32, 64, 64, 2, 1, 4, False, 2), True)]
    for experts, cap, k, n, shift, cfg, transposed_scales in cases:
        for call in range(2):
            xb = torch.randn(experts, cap, k, generator=g).to(torch.bfloat16) * 3
            wb = (torch.randn(experts, k, n, generator=g) / k ** 0.5).to(torch.bfloat16)
            q, sx = weft.ops.fp8_rows(xb)
            # Quantization as defined: per 128 channels of a row, scale = max(amax, 1e-4) / 448, q = x / scale.
            blocks = xb.float().reshape(experts, cap, k // 128, 128)
            assert torch.equal(sx, blocks.abs().amax(-1).clamp(min=1e-4) / 448)
            assert torch.equal(q.view(torch.uint8), (blocks / sx[..., None]).to(torch.float8_e4m3fn)
                               .reshape(q.shape).view(torch.uint8))
            buf = torch.empty(q.numel() + shift, dtype=torch.uint8)
            x = buf[shift:].view(torch.float8_e4m3fn).view(q.shape)
            x.copy_(q)
            w, sw = weft.ops.fp8_blocks(wb)
            assert w.transpose(1, 2).is_contiguous() and sw.shape == (experts, k // 128, -(-n // 128))
            if transposed_scales:
                sw = sw.transpose(1, 2).contiguous().transpose(1, 2)
            counts = torch.randint(0, cap + 1, (experts,), generator=g, dtype=torch.int32)
            counts[0], counts[-1] = (0, cap) if call == 0 else (cap, 1)
            for e in range(experts):
                x[e, int(counts[e]):] = float("nan")  # rows past the count: NaN bytes and scales
                sx[e, int(counts[e]):] = float("nan")
            out = weft.ops.grouped_gemm(x, w, counts, config=cfg, x_scales=sx, w_scales=sw)
            assert out.dtype == torch.bfloat16 and out.shape == (experts, cap, n)
            for e, ref in enumerate(_fp8_reference(x, sx, w, sw, counts)):
                torch.testing.assert_close(out[e, :ref.shape[0]].double(), ref, rtol=1e-2, atol=1e-2,
                                           msg=f"case {experts, cap, k, n} call {call} expert {e}")
            # The quantized product stays near the bf16 one (e4m3: 3 mantissa bits each side).
            dense = [(xb[e, :int(counts[e])].float() @ wb[e].float()) for e in range(experts)]
            for e, ref in enumerate(dense):
                err = (out[e, :ref.shape[0]].float() - ref).norm() / ref.norm().clamp(min=1e-6)
                assert ref.numel() == 0 or err < 0.1, f"expert {e}: relative error {float(err)} against bf16"
    return True


@pytest.mark.parametrize("w", [1, 2])
def test_fp8_grouped_gemm(w):
    assert all(run_ranks(_fp8_grouped_gemm, w, 5, timeout=TIMEOUT))


# -- bad arguments ------------------------------------------------------------------------------

def _rejects():
    import torch

    import weft
    from weft.kernels.gemm import GemmConfig
    from weft.testing.checks import rejects

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 128, generator=g).to(torch.bfloat16)
    wt = torch.randn(2, 128, 16, generator=g).to(torch.bfloat16)
    ones = torch.ones(2, dtype=torch.int32)
    guarded = [x, wt]
    rejects(lambda: weft.ops.grouped_gemm(x, wt, torch.zeros(3, dtype=torch.int32)), ValueError, "counts", guarded)
    rejects(lambda: weft.ops.grouped_gemm(x, wt, ones, config=(64, 128)), TypeError, "config", guarded)
    rejects(lambda: weft.ops.grouped_gemm(x, wt.float(), ones), TypeError, "dtype", guarded)
    rejects(lambda: weft.ops.grouped_gemm(x, wt, ones, x_scales=torch.ones(2, 8, 1)), ValueError, "fp8", guarded)
    q, sx = weft.ops.fp8_rows(x)
    w8, sw = weft.ops.fp8_blocks(wt)
    guarded = [q, sx, w8, sw]
    rejects(lambda: weft.ops.grouped_gemm(q, w8, ones, w_scales=sw), ValueError, "x_scales", guarded)
    rejects(lambda: weft.ops.grouped_gemm(q, w8, ones, x_scales=sx), ValueError, "w_scales", guarded)
    rejects(lambda: weft.ops.grouped_gemm(q, w8.contiguous(), ones, x_scales=sx, w_scales=sw), ValueError,
            "K dimension contiguous", guarded)
    rejects(lambda: weft.ops.grouped_gemm(q, w8, ones, x_scales=sx[:, :4], w_scales=sw), ValueError, "x_scales",
            guarded)
    rejects(lambda: weft.ops.grouped_gemm(q, w8, ones, x_scales=sx.double(), w_scales=sw), TypeError, "x_scales",
            guarded)
    rejects(lambda: weft.ops.grouped_gemm(q, w8, ones, x_scales=sx, w_scales=sw[:, :, :0]), ValueError, "w_scales",
            guarded)
    rejects(lambda: weft.ops.grouped_gemm(q, w8, ones, GemmConfig(16, 32, 48, 1, 1, 4, False), sx, sw), ValueError,
            "block_k", guarded)
    rejects(lambda: weft.ops.grouped_gemm(q, w8, ones, GemmConfig(16, 48, 32, 1, 1, 4, False), sx, sw), ValueError,
            "block_n", guarded)
    q64 = q[:, :, :64].contiguous()
    rejects(lambda: weft.ops.grouped_gemm(q64, w8[:, :64], ones, x_scales=sx[..., :1].contiguous(), w_scales=sw),
            ValueError, "multiple of 128", [q64])
    rejects(lambda: weft.ops.fp8_rows(x[..., :100]), ValueError, "multiple of 128", [x])
    return True


def test_bad_input_rejected():
    assert run_ranks(_rejects, 1, timeout=TIMEOUT)[0]
