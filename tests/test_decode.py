"""The fused decode kernels (weft/kernels/decode.py) and the decode path built on them (WEFT_DECODE=fused), on cpu
ranks:

- norm_qkv_rope, linear_residual and norm_gate_up_silu against torch's own ops (transformers' RMSNorm, rotary
  and SiLU formulas) on fresh random inputs, fp32 and bf16, row counts and widths that leave every block ragged,
  shapes that take the split-K path and shapes that do not, each plan called twice (the split-K counters are
  zeroed for the next call), outputs that start poisoned; bad arguments refused, naming them;
- both GEMV paths (tl.dot and dot-free) of every op at M = 1, 3 (and 8 outside CI), narrow and wide column runs, against torch
  and the layers path; decode.gemv's keys resolved per op and row range;
- the decoder's decode steps and greedy generation on the fused path against the layers path and transformers
  (Qwen3 and Llama configs, 1 and 2 ranks, batch 1 and 3; batch 3 outside CI).
"""
import pytest

from weft.testing import run_ranks

TIMEOUT = 600


def _hf_norm(x, w, eps):
    """transformers' LlamaRMSNorm: in fp32, rounded to x's dtype, times the weight."""
    import torch

    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _fused_ops(seed):
    import torch
    import torch.nn.functional as F

    import weft

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


def _gemv_paths(seed, row_counts):
    """Both GEMV paths (tl.dot and dot-free, forced through the plans' settings) of every fused op at M in
    `row_counts` on odd shapes (K, N, heads of 40 ragged against the blocks), split K and not, narrow and wide column
    runs (one and two heads a QKV program), the weights stored both ways (N- and K-contiguous; the first row count
    only), against torch and the layers path (weft.ops.rms_norm, x @ W, silu_mul, qk_norm_rope: what the decoder
    runs without WEFT_DECODE=fused)."""
    import itertools

    import torch
    import torch.nn.functional as F

    import weft
    from weft.kernels.decode import GateUpPlan, LinearResidualPlan, QkvPlan

    g = torch.Generator().manual_seed(seed)
    eps = 1e-5
    world = weft.world()
    splits = {}
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        def close(got, want, what):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda s: f"{what}: {s}")

        def weight(k, n, k_major):
            """A (K, N) weight, stored K-contiguous (the transpose of an (N, K) tensor, nn.Linear's) or not."""
            if k_major:
                return randn(n, k, scale=k ** -0.5).t()
            return randn(k, n, scale=k ** -0.5)

        def layouts(m):  # both weight layouts at the first row count, weft's own at the others
            return (False, True) if m == row_counts[0] else (False,)

        for dot in (True, False):
            # bf16: runs of 64 columns (one tile of the projections below; two heads of 40 a QKV program).
            block_n = 16 if dtype == torch.float32 else 64
            settings = dict(block_n=block_n, block_k=32, num_warps=4, num_stages=2, programs_per_sm=4, dot=dot)
            for m in row_counts:
                what = f"dot={dot} M={m} {dtype}"
                # linear_residual: K ragged against the K block, N against the two column runs of a program.
                for (k, n), k_major in itertools.product(((200, 72), (24, 40)), layouts(m)):
                    x, w, res = randn(m, k), weight(k, n, k_major), randn(m, n)
                    p = LinearResidualPlan(world, x, w, res, settings)
                    assert p.k_major == k_major
                    splits.setdefault(("linear_residual", dot), set()).add(p.split)
                    for call in range(2):  # the split-K counters are zeroed for the next call
                        got = p.run(x, w, res)
                        close(got, ((x.float() @ w.float()).to(dtype).float() + res.float()).to(dtype),
                              f"linear_residual {m, k, n} {what} K-major={k_major} call {call} against torch")
                        close(got, x @ w + res, f"linear_residual {m, k, n} {what} K-major={k_major} against the "
                              "layers path")
                # norm_gate_up_silu: the intermediate ragged against the column run.
                for (k, inter), k_major in itertools.product(((136, 40), (24, 24)), layouts(m)):
                    x, nw, w = randn(m, k), randn(k, scale=0.5) + 1, weight(k, 2 * inter, k_major)
                    p = GateUpPlan(world, x, nw, w, eps, settings)
                    assert p.k_major == k_major
                    splits.setdefault(("norm_gate_up_silu", dot), set()).add(p.split)
                    got = p.run(x, nw, w, eps)
                    gate, up = (_hf_norm(x, nw, eps) @ w).chunk(2, dim=-1)
                    label = f"norm_gate_up_silu {m, k, inter} {what} K-major={k_major}"
                    close(got, F.silu(gate) * up, f"{label} against torch")
                    close(got, weft.ops.silu_mul(weft.ops.rms_norm(x, nw, eps) @ w), f"{label} against the layers path")
                # norm_qkv_rope: heads of 40 (halves of 20, padded to 32), with Qwen3's q/k norm and without
                # (Llama-3); 8 heads in all, one or two a program, so that K = 192 splits (K = 24 does not).
                heads, kv, d = 4, 2, 40
                for (qk_norm, k), k_major in itertools.product(((True, 192), (False, 24), (False, 192)), layouts(m)):
                    x, nw = randn(m, k), randn(k, scale=0.5) + 1
                    w = weight(k, (heads + 2 * kv) * d, k_major)
                    inv_freq = 1.0 / 100.0 ** (torch.arange(0, d, 2).float() / d)
                    rows = torch.randperm(9, generator=g)[:m]
                    positions = torch.randint(0, 7, (m,), generator=g)
                    qw, kw = (randn(d, scale=0.5) + 1 if qk_norm else None for _ in range(2))
                    caches = [torch.full((9, 7, kv, d), float("nan"), dtype=dtype) for _ in range(4)]
                    p = QkvPlan(world, x, nw, w, heads, kv, inv_freq, rows, positions, caches[0], caches[1], qw, kw,
                                eps, settings)
                    splits.setdefault(("norm_qkv_rope", dot), set()).add(p.split)
                    assert p.heads_p == (1 if dtype == torch.float32 else 2), p.heads_p
                    assert p.k_major == k_major
                    q = p.run(x, nw, w, inv_freq, rows, positions, caches[0], caches[1], qw, kw, eps)
                    q_ref = weft.ops.qk_norm_rope(weft.ops.rms_norm(x, nw, eps) @ w, m, heads, kv, inv_freq, rows,
                                                  positions, caches[2], caches[3], qw, kw, eps)
                    label = f"norm_qkv_rope K={k} qk_norm={qk_norm} {what} K-major={k_major} against the layers path"
                    close(q, q_ref, f"{label} q")
                    close(caches[0][rows, positions], caches[2][rows, positions], f"{label} k")
                    close(caches[1][rows, positions], caches[3][rows, positions], f"{label} v")
                    for cache in caches[:2]:
                        assert int((~cache.isnan()).sum()) == m * kv * d, f"{label}: written outside its slots"
    # Every op took split K and one split on both paths.
    for (op, dot), taken in splits.items():
        assert 1 in taken and max(taken) > 1, (op, dot, taken)
    return True


# M = 1 and 3 (one row, and rows ragged against every row block) in CI; 8 (whole row blocks) outside it.
@pytest.mark.parametrize("row_counts", [(1, 3), pytest.param((8,), marks=pytest.mark.long)])
def test_gemv_paths_match_torch_and_layers(row_counts):
    assert run_ranks(_gemv_paths, 1, 1, row_counts, timeout=TIMEOUT)[0]


def _linear_residual_ar(seed):
    """linear_residual_ar on the world and on a group of some ranks, against torch: residual + the sum of every
    member's x @ w (each member's own shards), the same bits on every member; fp32 and bf16, shapes with and
    without split K, several row blocks, each plan called twice (new inputs; the split-K counters and the
    all-reduce's epochs go on); a call beyond the LL words of the workspace (gemm_ar and the add); then the group of
    one (linear_residual's own kernel). A member whose shapes differ gets weft.SignatureMismatch on every member."""
    import torch
    import torch.distributed as dist

    import weft
    from weft.kernels.decode import LinearResidualArPlan

    me, w = weft.rank(), weft.world_size()
    pair = weft.new_group([0, w - 1])  # None on the ranks between
    singles = [weft.new_group([r]) for r in range(w)]
    splits = set()
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        for group in (None, pair) if pair is not None else (None,):
            g = weft.get_group(group)
            for m, k, n in ((1, 32, 64), (3, 200, 72), (70, 96, 40)):
                for call in range(2):
                    gen = torch.Generator().manual_seed(seed + 100 * call + 7 * m)
                    res = torch.randn(m, n, generator=gen).to(dtype)  # the same on every member
                    shards = [(torch.randn(m, k, generator=gen).to(dtype),
                               (torch.randn(k, n, generator=gen) * k ** -0.5).to(dtype)) for _ in range(g.size)]
                    x, wt = shards[g.rank]
                    got = weft.ops.linear_residual_ar(x, wt, res, group=group)
                    total = sum(a.float() @ b.float() for a, b in shards)
                    want = (total.to(dtype).float() + res.float()).to(dtype)
                    torch.testing.assert_close(got, want, rtol=tol, atol=tol,
                                               msg=lambda s: f"linear_residual_ar {m, k, n} {dtype} {g.ranks}: {s}")
                    every = [torch.empty_like(got) for _ in range(g.size)]
                    dist.all_gather(every, got, group=g.process_group)
                    assert all(torch.equal(e, got) for e in every), "members got different bits"
                    splits.add(LinearResidualArPlan(g, x, wt, res).split)
    assert 1 in splits and max(splits) > 1, splits
    # Beyond the LL words of gemm_ar's workspace (the members' rows x columns): gemm_ar and the add.
    from weft.kernels.common import workspace
    from weft.kernels.gemm_ar import GemmArWorkspace
    world = weft.get_group(None)
    m, k = 64, 16
    n = workspace(world, "gemm_ar", GemmArWorkspace).ll_half // (w * m) + 8
    gen = torch.Generator().manual_seed(seed + 1)
    res = torch.randn(m, n, generator=gen)
    shards = [(torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen) * k ** -0.5) for _ in range(w)]
    assert LinearResidualArPlan(world, *shards[me], res).launch is None
    got = weft.ops.linear_residual_ar(*shards[me], res)
    torch.testing.assert_close(got, sum(a @ b for a, b in shards) + res, rtol=2e-5, atol=2e-5)
    x, wt, res = torch.randn(3, 200), torch.randn(200, 72), torch.randn(3, 72)
    assert torch.equal(weft.ops.linear_residual_ar(x, wt, res, group=singles[me]),
                       weft.ops.linear_residual(x, wt, res))
    # Members whose shapes differ: every member raises, none returns a wrong sum.
    x = torch.randn(2 if me == 0 else 3, 16)
    with pytest.raises(weft.SignatureMismatch, match="linear_residual_ar"):
        weft.ops.linear_residual_ar(x, torch.randn(16, 24), torch.randn(x.shape[0], 24))
        weft.check_errors()
    return True


# 3 ranks in CI (the world, a group of ranks 0 and 2, rank 1 outside it); 2 outside it.
@pytest.mark.parametrize("world_size", [3, pytest.param(2, marks=pytest.mark.long)])
def test_linear_residual_ar_matches_torch(world_size):
    assert all(run_ranks(_linear_residual_ar, world_size, 5, timeout=TIMEOUT, env={"WEFT_WAIT_TIMEOUT_S": "60"}))


def _settings_resolved():
    """decode.gemv's keys: the most specific of op.KxN.range.field, op.KxN.field, op.range.field, op.field,
    range.field, field wins (for a K-contiguous weight, the same with nk after the op and shape first); a bad key is
    refused naming it."""
    from weft import tuning
    from weft.kernels.decode import resolve
    from weft.testing.checks import rejects

    table = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "dot": True,
             "few_max_m": 4, "few.dot": False, "few.block_k": 32, "qkv.block_k": 256, "qkv.few.block_k": 64,
             "down.many.programs_per_sm": 1}
    assert resolve(table, "o", 1) == dict(block_n=64, block_k=32, num_warps=4, num_stages=3, programs_per_sm=2,
                                          dot=False)
    assert resolve(table, "o", 5)["dot"] is True and resolve(table, "o", 5)["block_k"] == 128
    assert resolve(table, "qkv", 4)["block_k"] == 64 and resolve(table, "qkv", 8)["block_k"] == 256
    assert resolve(table, "down", 8)["programs_per_sm"] == 1 and resolve(table, "down", 1)["programs_per_sm"] == 2
    rejects(lambda: resolve(dict(table, **{"qkv.blockn": 1}), "o", 1), tuning.TuningError, "'qkv.blockn'", [])
    rejects(lambda: resolve(dict(table, **{"up.dot": True}), "o", 1), tuning.TuningError, "'up.dot'", [])
    rejects(lambda: resolve({"block_n": 64}, "o", 1), tuning.TuningError, "no 'block_k'", [])
    rejects(lambda: resolve(table, "gate", 1), ValueError, "op must be one of", [])
    # A weight shape's keys (one rank's shapes at a TP size): the most specific, for that shape only.
    shaped = dict(table, **{"gate_up.4096x12288.few.num_stages": 6, "gate_up.4096x12288.programs_per_sm": 1})
    assert resolve(shaped, "gate_up", 1, (4096, 12288))["num_stages"] == 6
    assert resolve(shaped, "gate_up", 8, (4096, 12288))["num_stages"] == 3
    assert resolve(shaped, "gate_up", 8, (4096, 12288))["programs_per_sm"] == 1
    assert resolve(shaped, "gate_up", 1, (4096, 24576)) == resolve(table, "gate_up", 1)
    assert resolve(shaped, "gate_up", 1) == resolve(table, "gate_up", 1)
    rejects(lambda: resolve(dict(table, **{"4096x12288.dot": True}), "o", 1), tuning.TuningError,
            "'4096x12288.dot'", [])
    rejects(lambda: resolve(dict(table, **{"qkv.few.4096x12288.dot": True}), "o", 1), tuning.TuningError,
            "'qkv.few.4096x12288.dot'", [])
    # Weights stored K-contiguous ("nk"): any key with nk before any without; none: the N-contiguous settings.
    nk = dict(shaped, **{"qkv.nk.block_n": 128, "qkv.nk.few.num_stages": 2, "nk.block_k": 512,
                         "qkv.4096x6144.nk.many.dot": False})
    assert resolve(nk, "qkv", 1, layout="nk") == dict(block_n=128, block_k=512, num_warps=4, num_stages=2,
                                                      programs_per_sm=2, dot=False)
    assert resolve(nk, "qkv", 8, (4096, 6144), "nk")["dot"] is False
    assert resolve(nk, "qkv", 8, (4096, 6144), "nk")["block_k"] == 512  # nk.block_k beats qkv.block_k
    assert resolve(nk, "qkv", 1) == resolve(table, "qkv", 1)
    assert resolve(nk, "gate_up", 1, (4096, 12288), "nk") == dict(resolve(shaped, "gate_up", 1, (4096, 12288)),
                                                                  block_k=512)
    rejects(lambda: resolve(nk, "qkv", 1, layout="kn "), ValueError, "layout must be one of", [])
    rejects(lambda: resolve(dict(table, **{"qkv.few.nk.dot": True}), "o", 1), tuning.TuningError,
            "'qkv.few.nk.dot'", [])
    return True


def test_gemv_settings_resolve():
    assert run_ranks(_settings_resolved, 1, timeout=TIMEOUT)[0]


def _splits_taken():
    """The shapes of _fused_ops take both paths: one split, and split K (the tests' cpu launch settings)."""
    import torch

    import weft
    from weft.kernels.decode import LinearResidualPlan

    splits = []
    for m, k, n in ((1, 32, 64), (3, 200, 72)):
        x, w, res = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
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
        (lambda: ops.linear_residual(x, w.t().contiguous().t(), res), None, None),  # stored K-contiguous
        (lambda: ops.linear_residual(x, torch.randn(32, 96)[:, ::2], res), ValueError,
         "weight must be contiguous, or the transpose of a contiguous tensor"),
        (lambda: ops.linear_residual(x[:, :0], w[:0], res), ValueError, "x has no columns"),
        (lambda: ops.norm_gate_up_silu(x[:, :0], nw[:0], gu[:0]), ValueError, "x has no columns"),
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


def _decode_paths(kind, rope, batches):
    """Decode steps on the fused path against the layers path and transformers, and greedy generation on it against
    transformers', at each batch of `batches` (3 runs padded to its bucket of 4 in generate), the same tiny model."""
    import torch

    import weft
    from test_model import _close, _decode_steps, _hf_model
    from weft.models import from_hf

    ref = _hf_model(kind, 4, 2, 96, rope=rope)
    model = from_hf(ref.config, state_dict=ref.state_dict())
    # The default: tuning's decode.fused_max_m at this TP size (1x, 2x and 4x H200 measured: 16, 16 and 0).
    from weft import tuning
    limit = tuning.by_size("decode.fused_max_m", weft.device(), weft.world_size())
    assert model.decode_path(max(limit, 1)) == ("fused" if limit else "layers") and model.decode_path(64) == "layers"
    assert model.with_comm("nccl").decode_path(1) == "layers"  # the NCCL+cuBLAS baseline stays on the layers
    g = torch.Generator().manual_seed(2 + weft.world_size())
    tokens = {}
    for batch in batches:
        prompts = torch.randint(0, 96, (batch, 5), generator=g)
        cont = torch.randint(0, 96, (batch, 2), generator=g)
        want, got = _decode_steps(model, ref, prompts, cont, ("fused", "layers"), 16)
        with torch.no_grad():
            for j in range(2):
                _close(got["fused"][j], got["layers"][j], f"{kind} batch {batch} step {j}: fused against layers")
                _close(got["fused"][j], want[:, j], f"{kind} batch {batch} step {j}: fused against transformers")
            # Greedy tokens: the layers path's (test_model.py) are transformers' too.
            fused = model.generate(prompts, 3, decode_path="fused")
            mask = torch.ones_like(prompts)
            assert fused.tolist() == ref.generate(prompts, attention_mask=mask, max_new_tokens=3,
                                                  do_sample=False).tolist(), (kind, batch)
            tokens[batch] = fused.tolist()
    return tokens


# Batch 1 (the fused path's default batch) in CI; batch 3 outside it (the fused ops at 3 rows: test_gemv_paths).
@pytest.mark.parametrize("kind, world_size, batches", [("qwen3", 1, (1,)), ("llama", 2, (1,)),
                                                       pytest.param("qwen3", 1, (3,), marks=pytest.mark.long),
                                                       pytest.param("llama", 2, (3,), marks=pytest.mark.long)])
def test_fused_decode_matches_layers_and_transformers(kind, world_size, batches):
    from test_model import ENV, LLAMA3_ROPE

    results = run_ranks(_decode_paths, world_size, kind, LLAMA3_ROPE if kind == "llama" else None, batches,
                        timeout=TIMEOUT, env=ENV)
    assert all(r == results[0] for r in results), "ranks generated different tokens"


def test_decode_path_setting():
    """WEFT_DECODE picks the path, and a bad value (or a bad path argument) is refused naming it."""
    assert run_ranks(_path_setting, 1, timeout=TIMEOUT)[0]


def _path_setting():
    import os

    from test_model import _hf_model
    from weft.models import from_hf
    from weft.runtime import settings
    from weft.testing.checks import rejects

    model = from_hf(_hf_model("qwen3", 4, 2, 96).config)
    for value, small, large in (("layers", "layers", "layers"), ("fused", "fused", "fused")):
        os.environ["WEFT_DECODE"] = value
        assert (model.decode_path(1), model.decode_path(64)) == (small, large), value
    os.environ["WEFT_DECODE"] = "fast"
    rejects(lambda: settings.check_all(), ValueError, "WEFT_DECODE='fast'", [])
    del os.environ["WEFT_DECODE"]
    rejects(lambda: model.decode_path(1, "fast"), ValueError, "path must be one of", [])
    return True


def test_balanced_split():
    """The one-wave split where it spreads the work evenly; where it leaves SMs idle or uneven, the split with the
    least work on the busiest SM (the fewest splits among near-equals)."""
    from weft.kernels.decode import balanced_split

    # Qwen3-8B's gate/up at 8 rows on 132 SMs, 96 column tiles of 32 K blocks: one wave leaves 36 SMs idle.
    assert balanced_split(96, 32, 132, 264) == 4
    # 48 QKV tiles: the one-wave split (5) puts 2 programs of 7 blocks on some SMs, 8 puts 3 of 4.
    assert balanced_split(48, 32, 132, 264) == 8
    # Even already: the one-wave split stays (O at 1 row: 32 tiles x 4 splits on 132 SMs).
    assert balanced_split(32, 32, 132, 132) == 4
    assert balanced_split(192, 64, 132, 528) == 2
    assert balanced_split(4, 1, 132, 528) == 1
