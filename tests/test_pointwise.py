"""The fused pointwise kernels (weft/kernels/pointwise.py) on a cpu rank against the torch code they replace:
rms_norm, qk_norm_rope and silu_mul against transformers' formulas; silu_mul over each expert's valid rows
(counts) and fused with the fp8 quantization, and fp8_rows, bit for bit against weft.testing.reference's torch
forms; bad arguments refused before anything runs."""
from weft.testing import run_ranks

TIMEOUT = 120


def _round_as_torch():
    """The fused kernels under the interpreter against the torch code they replace (transformers' formulas), fp32
    and bf16, with rows that leave a program's block ragged."""
    import torch
    import torch.nn.functional as F

    from weft.kernels.pointwise import qk_norm_rope, rms_norm, silu_mul

    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        def randn(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        def hf_norm(x, w, eps=1e-6):  # LlamaRMSNorm.forward
            h = x.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

        x, res, w = randn(19, 48), randn(19, 48), randn(48)
        out, stream = rms_norm(x, w, 1e-6, res)
        assert torch.equal(stream, x + res), dtype
        torch.testing.assert_close(out, hf_norm(x + res, w), rtol=tol, atol=tol)
        torch.testing.assert_close(rms_norm(x, w, 1e-6), hf_norm(x, w), rtol=tol, atol=tol)
        # Rows where the epsilon decides: zeros (0, not NaN), values whose squares underflow, and values whose
        # mean square is below eps (the result is about x / sqrt(eps), not x / rms(x)).
        z = torch.stack([torch.zeros(48), torch.full((48,), 1e-30), 1e-4 * torch.randn(48, generator=g)]).to(dtype)
        got = rms_norm(z, w, 1e-6)
        assert torch.equal(got[0], torch.zeros_like(got[0])), dtype
        torch.testing.assert_close(got, hf_norm(z, w), rtol=tol, atol=tol * 1e-3)
        h = randn(19, 2, 40)  # (..., 2 n): rows of [gate | up]
        gate, up = h.reshape(19, 80).chunk(2, dim=-1)
        torch.testing.assert_close(silu_mul(h.reshape(19, 80)), F.silu(gate) * up, rtol=tol, atol=tol)

        heads, kv, d, tokens = 3, 1, 16, 5
        qkv = randn(tokens + 2, (heads + 2 * kv) * d)  # rows past `tokens` are not read
        inv_freq = 1.0 / 100.0 ** (torch.arange(0, d, 2).float() / d)
        rows, positions = torch.tensor([1, 1, 0, 2, 2]), torch.tensor([3, 4, 0, 7, 8])
        qw, kw = randn(d), randn(d)
        k_cache, v_cache = torch.zeros(3, 9, kv, d, dtype=dtype), torch.zeros(3, 9, kv, d, dtype=dtype)
        q = qk_norm_rope(qkv, tokens, heads, kv, inv_freq, rows, positions, k_cache, v_cache, qw, kw)
        angles = positions[:, None].float() * inv_freq
        cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype)[:, None] for f in (torch.cos, torch.sin))

        def rotate(t):  # transformers' apply_rotary_pos_emb
            return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

        q_ref, k_ref, v_ref = qkv[:tokens].split([heads * d, kv * d, kv * d], -1)
        torch.testing.assert_close(q, rotate(hf_norm(q_ref.view(tokens, heads, d), qw)), rtol=tol, atol=tol)
        torch.testing.assert_close(k_cache[rows, positions], rotate(hf_norm(k_ref.view(tokens, kv, d), kw)),
                                   rtol=tol, atol=tol)
        assert torch.equal(v_cache[rows, positions], v_ref.view(tokens, kv, d))
        assert k_cache.count_nonzero() == tokens * kv * d  # nothing written elsewhere
        q = qk_norm_rope(qkv, tokens, heads, kv, inv_freq, rows, positions, k_cache, v_cache)  # no q/k norm
        torch.testing.assert_close(q, rotate(q_ref.view(tokens, heads, d)), rtol=tol, atol=tol)
    return True


def test_pointwise_kernels_round_as_torch():
    assert run_ranks(_round_as_torch, 1, timeout=TIMEOUT)[0]


def _same_bits(got, want, what):
    import torch

    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} against {tuple(want.shape)}"
    g, w = (t.contiguous().view(torch.uint8) if t.element_size() == 1 else t for t in (got, want))
    assert torch.equal(g, w), f"{what}: {int((g != w).sum())} elements differ"


def _same_bits_or_nan(got, want, what):
    """NaN exactly where want is NaN (its NaN bits are the platform's: x86 makes inf / inf negative), the same
    bits everywhere else."""
    import torch

    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan), f"{what}: NaN at {int((got.float().isnan() != nan).sum())} " \
        "places torch has none, or none where torch has"
    _same_bits(got[~nan], want[~nan], what)


def _nan_rows(seed):
    """NaN and inf as torch gives them: fp8_rows (a group of 128 with NaN is all NaN, scale NaN; with inf,
    scale inf and q 0 but NaN at the inf), silu_mul (silu(-inf) NaN, silu(0) * inf NaN) and its fp8 form."""
    import torch
    import torch.nn.functional as F

    import weft
    from weft.testing.reference import fp8_rows_ref

    g = torch.Generator().manual_seed(seed)
    nan, inf = float("nan"), float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 256, generator=g).to(dtype)
        x[0, 5], x[1, 130], x[2, 7], x[3, 3], x[3, 200] = nan, inf, -inf, inf, nan
        for got, want, part in zip(weft.ops.fp8_rows(x), fp8_rows_ref(x), ("q", "scales")):
            _same_bits_or_nan(got, want, f"fp8_rows {part} {dtype}")
        h = torch.randn(6, 2 * 128, generator=g).to(dtype)
        h[0, 3], h[1, 128 + 4], h[2, 5], h[3, 6], h[4, 7], h[4, 128 + 7], h[5, 128 + 8] = nan, nan, inf, -inf, 0, inf, -inf
        gate, up = h.chunk(2, dim=-1)
        y = weft.ops.silu_mul(h)
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # NaN and inf where torch's are, exactly
        torch.testing.assert_close(y, F.silu(gate) * up, rtol=tol, atol=tol, equal_nan=True)
        assert y.isnan().sum() == 4 and y.isinf().sum() == 2, dtype
        for got, want, part in zip(weft.ops.silu_mul(h, fp8=True), fp8_rows_ref(y), ("q", "scales")):
            _same_bits_or_nan(got, want, f"silu_mul fp8 {part} {dtype}")
    return True


def _rows_kernels(seed):
    """silu_mul and fp8_rows on fresh inputs, each plan called twice: the whole tensor, an expert's first
    counts[e] rows only (0, some, all), fp8 (rows of zeros, of huge values and of values in e4m3's subnormal
    range, which the interpreter rounds by hand), views that are not contiguous, empty shapes."""
    import torch
    import torch.nn.functional as F

    import weft
    from weft.testing.reference import fp8_rows_ref

    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for call in range(2):
            e, cap, n = 3, 5, 256
            h = (torch.randn(e, cap, 2 * n, generator=g) * 4).to(dtype)
            h[0, 1, :n] = 0.0  # a row of zeros out of the SiLU: its scale is the floor, 1e-4 / 448
            h[1, 0, n:] = 1e-3  # tiny products: e4m3 subnormals after the scale
            counts = torch.tensor([cap, 2, 0] if call == 0 else [1, cap, 3], dtype=torch.int32)
            whole = weft.ops.silu_mul(h)
            gate, up = h.chunk(2, dim=-1)
            torch.testing.assert_close(whole, F.silu(gate) * up, rtol=tol, atol=tol)
            part = weft.ops.silu_mul(h, counts)
            q, s = weft.ops.silu_mul(h, counts, fp8=True)
            xq, xs = weft.ops.fp8_rows(h, counts)
            assert q.dtype == xq.dtype == torch.float8_e4m3fn and s.shape == (e, cap, n // 128)
            for i in range(e):
                c = int(counts[i])
                _same_bits(part[i, :c], whole[i, :c], f"silu_mul counts {dtype} expert {i}")
                rq, rs = fp8_rows_ref(whole[i, :c])
                _same_bits(q[i, :c], rq, f"silu_mul fp8 {dtype} expert {i}")
                _same_bits(s[i, :c], rs, f"silu_mul fp8 scales {dtype} expert {i}")
                rq, rs = fp8_rows_ref(h[i, :c])
                _same_bits(xq[i, :c], rq, f"fp8_rows counts {dtype} expert {i}")
                _same_bits(xs[i, :c], rs, f"fp8_rows scales {dtype} expert {i}")
            big = torch.randn(7, 384, generator=g).to(dtype) * 1e4
            for got, want in zip(weft.ops.fp8_rows(big), fp8_rows_ref(big)):
                _same_bits(got, want, f"fp8_rows {dtype}")
            strided = h.transpose(0, 1)  # (cap, e, 2 n), not contiguous
            _same_bits(weft.ops.silu_mul(strided), whole.transpose(0, 1), f"silu_mul of a view {dtype}")
            for got, want in zip(weft.ops.fp8_rows(strided[..., :n]), fp8_rows_ref(strided[..., :n])):
                _same_bits(got, want, f"fp8_rows of a view {dtype}")
    assert weft.ops.silu_mul(torch.randn(0, 8)).shape == (0, 4)
    assert weft.ops.silu_mul(torch.randn(2, 0, 256), torch.ones(2, dtype=torch.int32), fp8=True)[1].shape == (2, 0, 1)
    assert weft.ops.fp8_rows(torch.randn(3, 0))[0].shape == (3, 0)
    return True


def test_silu_mul_and_fp8_rows():
    assert run_ranks(_rows_kernels, 1, 5, timeout=TIMEOUT)[0]


def test_nan_and_inf_as_torch():
    assert run_ranks(_nan_rows, 1, 6, timeout=TIMEOUT)[0]


def _rejects():
    import torch

    import weft
    from weft.testing.checks import rejects

    h = torch.randn(2, 3, 256)
    ones = torch.ones(2, dtype=torch.int32)
    rejects(lambda: weft.ops.silu_mul(h[..., :255]), ValueError, "even", [h])
    rejects(lambda: weft.ops.silu_mul(h[..., :192], fp8=True), ValueError, "multiple of 128", [h])
    rejects(lambda: weft.ops.silu_mul(h, fp8=1), TypeError, "fp8", [h])
    rejects(lambda: weft.ops.silu_mul(h.int()), TypeError, "h", [h])
    rejects(lambda: weft.ops.silu_mul(h, ones.long()), TypeError, "counts", [h])
    rejects(lambda: weft.ops.silu_mul(h, torch.ones(3, dtype=torch.int32)), ValueError, "counts", [h])
    rejects(lambda: weft.ops.silu_mul(h[0], ones), ValueError, "counts", [h])
    rejects(lambda: weft.ops.fp8_rows(h[..., :100]), ValueError, "multiple of 128", [h])
    rejects(lambda: weft.ops.fp8_rows(torch.tensor(1.0)), ValueError, "dimension", [h])
    return True


def test_bad_input_rejected():
    assert run_ranks(_rejects, 1, timeout=TIMEOUT)[0]
