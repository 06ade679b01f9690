"""The fused decode kernels (weft/kernels/decode.py) and the decode path built on them (WEFT_DECODE=fused), on cpu
ranks:

- norm_qkv_rope, linear_residual and norm_gate_up_silu against torch's own ops (transformers' RMSNorm, rotary
  and SiLU formulas) on fresh random inputs, fp32 and bf16, row counts and widths that leave every block ragged,
  shapes that take the split-K path and shapes that do not, each plan called twice (the split-K counters are
  zeroed for the next call), outputs that start poisoned; bad arguments refused, naming them;
"""
import pytest

from weft.testing import run_ranks

TIMEOUT = 240


def _hf_norm(x, w, eps):
    """transformers' LlamaRMSNorm: in fp32, rounded to x's dtype, times the weight."""
    import torch

    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _fused_ops(seed):
    import torch
    import torch.nn.functional as F

    import weft
    from weft.kernels import decode

    g = torch.Generator().manual_seed(seed)
    eps = 1e-5
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        # (M, K, N): a K of one block (no split), K and N ragged against the blocks (split K), several row blocks.
        for m, k, n in ((1, 32, 64), (3, 200, 72), (70, 96, 40)):
            for call in range(2):
                x, w, res = randn(m, k), randn(k, n, scale=k ** -0.5), randn(m, n)
                torch.manual_seed(call)
                got = weft.ops.linear_residual(x, w, res)
                want = ((x.float() @ w.float()).to(dtype).float() + res.float()).to(dtype)
                torch.testing.assert_close(got, want, rtol=tol, atol=tol,
                                           msg=lambda s: f"linear_residual {m, k, n}: {s}")

        for m, k, inter in ((1, 32, 16), (5, 136, 40), (17, 64, 24)):
            for call in range(2):
                x, nw, w = randn(m, k), randn(k, scale=0.5) + 1, randn(k, 2 * inter, scale=k ** -0.5)
                got = weft.ops.norm_gate_up_silu(x, nw, w, eps)
                gate, up = (_hf_norm(x, nw, eps) @ w).chunk(2, dim=-1)
                torch.testing.assert_close(got, F.silu(gate) * up, rtol=tol, atol=tol,
                                           msg=lambda s: f"norm_gate_up_silu {m, k, inter}: {s}")

        # Heads of 16 (halves of 8, padded to the 16 columns tl.dot takes) and of 40 (halves of 20).
        for m, k, heads, kv, d in ((1, 48, 4, 2, 16), (3, 160, 3, 1, 40)):
            for qk_norm in (True, False):
                x, nw = randn(m, k), randn(k, scale=0.5) + 1
                w = randn(k, (heads + 2 * kv) * d, scale=k ** -0.5)
                inv_freq = 1.0 / 100.0 ** (torch.arange(0, d, 2).float() / d)
                rows = torch.randperm(4, generator=g)[:m]
                positions = torch.randint(0, 9, (m,), generator=g)
                qw, kw = (randn(d, scale=0.5) + 1 if qk_norm else None for _ in range(2))
                poison = torch.full((4, 9, kv, d), float("nan"), dtype=dtype)
                k_cache, v_cache = poison.clone(), poison.clone()
                q = weft.ops.norm_qkv_rope(x, nw, w, heads, kv, inv_freq, rows, positions, k_cache, v_cache, qw, kw,
                                           eps)
                qkv = _hf_norm(x, nw, eps) @ w
                q_ref, k_ref, v_ref = qkv.split([heads * d, kv * d, kv * d], -1)
                q_ref, k_ref = q_ref.view(m, heads, d), k_ref.view(m, kv, d)
                if qk_norm:
                    q_ref, k_ref = _hf_norm(q_ref, qw, eps), _hf_norm(k_ref, kw, eps)
                angles = positions[:, None].float() * inv_freq
                cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype)[:, None] for f in (torch.cos, torch.sin))

                def rotate(t):  # transformers' apply_rotary_pos_emb
                    return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

                what = f"norm_qkv_rope {m, k, heads, kv, d} qk_norm={qk_norm} {dtype}"
                torch.testing.assert_close(q, rotate(q_ref), rtol=tol, atol=tol, msg=lambda s: f"{what} q: {s}")
                torch.testing.assert_close(k_cache[rows, positions], rotate(k_ref), rtol=tol, atol=tol,
                                           msg=lambda s: f"{what} k: {s}")
                torch.testing.assert_close(v_cache[rows, positions], v_ref.view(m, kv, d), rtol=tol, atol=tol,
                                           msg=lambda s: f"{what} v: {s}")
                assert int((~k_cache.isnan()).sum()) == m * kv * d, f"{what}: k written outside its slots"
                assert int((~v_cache.isnan()).sum()) == m * kv * d, f"{what}: v written outside its slots"
    return True


def test_fused_ops_match_torch():
    assert run_ranks(_fused_ops, 1, 0, timeout=TIMEOUT)[0]


def _splits_taken():
    """The shapes of _fused_ops take both paths: one split, and split K (the tests' cpu launch settings)."""
    import torch

    import weft
    from weft.kernels.decode import LinearResidualPlan

    splits = []
    for k in (32, 200):
        x, w, res = torch.randn(1, k), torch.randn(k, 64), torch.randn(1, 64)
        splits.append(LinearResidualPlan(weft.world(), x, w, res).split)
    assert splits[0] == 1 and splits[1] > 1, splits
    return True


def test_fused_ops_take_split_k_and_not():
    assert run_ranks(_splits_taken, 1, timeout=TIMEOUT)[0]


def _bad_arguments():
    import torch

    import weft
    from weft.testing.checks import rejects

    x, w, res = torch.randn(2, 32), torch.randn(32, 48), torch.randn(2, 48)
    nw, gu = torch.randn(32), torch.randn(32, 40)
    inv = torch.ones(4)
    rows, pos = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    cache = torch.zeros(3, 8, 1, 8)
    qkv = torch.randn(32, 4 * 8)
    ops = weft.ops
    cases = [
        (lambda: ops.linear_residual(x.numpy(), w, res), TypeError, "x must be a torch.Tensor"),
        (lambda: ops.linear_residual(x, w.double(), res), TypeError, "weight has dtype torch.float64"),
        (lambda: ops.linear_residual(x, w[:16], res), ValueError, "weight has shape (16, 48)"),
        (lambda: ops.linear_residual(x, w, res[:, :8]), ValueError, "residual has shape (2, 8)"),
        (lambda: ops.linear_residual(x, w.t().contiguous().t(), res), ValueError, "weight must be contiguous"),
        (lambda: ops.norm_gate_up_silu(x, nw[:8], gu), ValueError, "norm_weight has shape (8,)"),
        (lambda: ops.norm_gate_up_silu(x, nw, torch.randn(32, 39)), ValueError,
         "gate_up_weight's columns (39) must be even"),
        (lambda: ops.norm_gate_up_silu(x, nw, gu, eps="1"), TypeError, "eps must be a float"),
        (lambda: ops.norm_gate_up_silu(x, nw, gu, eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2, 1, inv, rows, pos, cache, cache), None, None),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2.0, 1, inv, rows, pos, cache, cache), TypeError,
         "heads must be an int"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 3, 1, inv, rows, pos, cache, cache), ValueError, "qkv_weight has shape"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2, 1, inv.double(), rows, pos, cache, cache), TypeError,
         "inv_freq has dtype torch.float64"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2, 1, inv, rows.int(), pos, cache, cache), TypeError,
         "rows has dtype torch.int32"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2, 1, inv, rows, pos[:1], cache, cache), ValueError,
         "positions has shape (1,)"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2, 1, inv, rows, pos, cache[..., :4], cache), ValueError,
         "k_dst must be (sequences, positions, 1, 8)"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2, 1, inv, rows, pos, cache, torch.zeros(8, 3, 1, 8).transpose(0, 1)),
         ValueError,
         "k_dst and v_dst must have the same strides"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2, 1, inv, rows, pos, cache, cache, torch.ones(8)), ValueError,
         "give both q_weight and k_weight"),
        (lambda: ops.norm_qkv_rope(x, nw, qkv, 2, 1, inv, rows, pos, cache, cache, torch.ones(6), torch.ones(6)),
         ValueError, "q_weight has shape (6,)"),
    ]
    for call, error, text in cases:
        if error is None:
            call()  # the valid call the others are variations of
        else:
            rejects(call, error, text, [])
    return True


def test_bad_arguments_are_refused():
    assert run_ranks(_bad_arguments, 1, timeout=TIMEOUT)[0]

