"""Ulysses sequence parallelism on the cpu backend: ulysses_all_to_all (bit-exact, both directions, packed
and separate, every method, changing sizes, passes), the fused QKV / O projections against matmul + the
all-to-all, and the layers against a single-process dense attention.

Every rank builds every rank's inputs from a shared seed and checks its own result against a local torch
reference; method="nccl" (all_to_all_single on gloo here) is checked against the same reference.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 120


def _heads_ref(xs, me, w):
    """Rank me's head-sharded tensor: its heads of every rank's tokens."""
    hl = xs[0].shape[-2] // w
    import torch

    return torch.cat([x[..., me * hl:(me + 1) * hl, :] for x in xs])


def _seq_ref(ys, me, w):
    """Rank me's tokens with every rank's heads, from head-sharded ys."""
    import torch

    s = ys[0].shape[0] // w
    return torch.cat([y[me * s:(me + 1) * s] for y in ys], dim=-2)


def _all_to_all_rounds(seed):
    import random

    import torch

    import weft
    from weft.testing.checks import bits

    w, me = weft.world_size(), weft.rank()
    rng = random.Random(seed)
    for rnd in range(3):
        s = rng.choice([4, 5, 7, 9])
        hl = rng.choice([1, 2])
        d = 16
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.int8])
        for packed in (False, True):
            mid = (3,) if packed else ()
            xs = [(torch.randn(s, *mid, w * hl, d, generator=torch.Generator().manual_seed(seed * 100 + rnd * 10 + r))
                   * 20).to(dtype) for r in range(w)]
            ref = _heads_ref(xs, me, w)
            x = xs[me]
            if rnd % 2:  # a layout the op must copy first
                x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
            for method in ("push", "nccl", "auto"):
                what = f"seed {seed} round {rnd} s={s} hl={hl} {dtype} packed={packed} {method}"
                got = weft.ops.ulysses_all_to_all(x, packed=packed, method=method)
                assert got.shape == ref.shape and bits(got).equal(bits(ref)), what
                back = weft.ops.ulysses_all_to_all(got, scatter="seq", packed=packed, method=method)
                assert bits(back).equal(bits(xs[me])), f"{what}: seq"
            ys = [torch.randn(w * s, *mid, hl, d, generator=torch.Generator().manual_seed(seed + 7 * r)).to(dtype)
                  for r in range(w)]
            got = weft.ops.ulysses_all_to_all(ys[me], scatter="seq", packed=packed)
            assert bits(got).equal(bits(_seq_ref(ys, me, w))), f"seed {seed} round {rnd}: seq from fresh inputs"
    empty = weft.ops.ulysses_all_to_all(torch.empty(0, 2 * w, 16))
    assert empty.shape == (0, 2, 16)
    return True


@pytest.mark.parametrize("world_size", [1, 2])  # 3 and 4 ranks: the group tests below and test_fused_projections
def test_all_to_all_bit_exact(world_size):
    run_ranks(_all_to_all_rounds, world_size, world_size, timeout=TIMEOUT, env=ENV)


def _passes_and_rejections():
    import torch

    import weft
    from weft.kernels.ulysses import _workspace
    from weft.testing.checks import bits, rejects

    w, me = weft.world_size(), weft.rank()
    xs = [torch.randn(9, 3, 2 * w, 16, generator=torch.Generator().manual_seed(r)) for r in range(w)]
    for _ in range(3):  # 27 rows of 128 bytes per peer through slots of 1 KiB: 4 passes per call
        got = weft.ops.ulysses_all_to_all(xs[me], packed=True, method="push")
        assert bits(got).equal(bits(_heads_ref(xs, me, w)))
        assert bits(weft.ops.ulysses_all_to_all(got, scatter="seq", packed=True, method="push")).equal(bits(xs[me]))
    used = weft.world().heap.used
    # A row (heads / W x head_dim) larger than a slot: push refuses, auto takes all_to_all_single.
    wide = [torch.randn(4, 2 * w, 512, generator=torch.Generator().manual_seed(10 + r)) for r in range(w)]
    assert _workspace(weft.world()).half_bytes // w < 2 * 512 * 4
    rejects(lambda: weft.ops.ulysses_all_to_all(wide[me], method="push"), ValueError, "workspace slot", [wide[me]])
    assert bits(weft.ops.ulysses_all_to_all(wide[me])).equal(bits(_heads_ref(wide, me, w)))
    assert weft.world().heap.used == used
    # The fused QKV projection in passes (a 2 KiB half holds 2 rows of 768 bytes: 3 passes), and with one
    # output row larger than a half: fused refuses, auto falls back.
    g = torch.Generator().manual_seed(3)
    for d in (16, 48):
        x = [torch.randn(5, 8, generator=g) for _ in range(w)]
        w_qkv = torch.randn(8, 3 * 2 * w * d, generator=g)
        ref = _heads_ref([(xr @ w_qkv).view(5, 3, 2 * w, d) for xr in x], me, w)
        if d == 48:
            rejects(lambda: weft.ops.qkv_all_to_all(x[me], w_qkv, 2 * w, method="fused"), ValueError,
                    "exceeds half the workspace", [])
        got = weft.ops.qkv_all_to_all(x[me], w_qkv, 2 * w, method="fused" if d == 16 else "auto")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    # The fused O projection in passes (8 tokens of 2 x 128 bytes of heads per pass: 3 passes), and with one
    # token's heads larger than a half: fused refuses, auto falls back.
    for d in (16, 512):
        attn = [torch.randn(w * 20, 2, d, generator=g) for _ in range(w)]
        w_o = torch.randn(2 * w * d, 8, generator=g)
        ref = _seq_ref(attn, me, w).reshape(20, -1) @ w_o
        if d == 512:
            rejects(lambda: weft.ops.all_to_all_o_proj(attn[me], w_o, method="fused"), ValueError,
                    "exceed half the workspace", [])
        got = weft.ops.all_to_all_o_proj(attn[me], w_o, method="fused" if d == 16 else "auto")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    if w > 1:
        odd = torch.randn(4, 2 * w + 1, 16)
        rejects(lambda: weft.ops.ulysses_all_to_all(odd), ValueError, "x has", [odd])
        rejects(lambda: weft.ops.ulysses_all_to_all(torch.randn(w + 1, 2, 16), scatter="seq"), ValueError, "x has", [])
    rejects(lambda: weft.ops.ulysses_all_to_all(torch.randn(4, 2, 2 * w, 16), packed=True), ValueError, "x must", [])
    rejects(lambda: weft.ops.ulysses_all_to_all(xs[me][:, 0], scatter="rows"), ValueError, "scatter", [])
    rejects(lambda: weft.ops.ulysses_all_to_all(xs[me][:, 0], method="ring"), ValueError, "method", [])
    return True


def test_all_to_all_passes_and_rejections():
    run_ranks(_passes_and_rejections, 2, timeout=TIMEOUT, env={**ENV, "WEFT_WORKSPACE_BYTES": "4KiB"})


def _fused(seed):
    import torch

    import weft
    from weft.testing.checks import rejects

    w, me = weft.world_size(), weft.rank()
    hid, heads, d = 40, 2 * w, 16  # the O projection's 40 columns: two column groups where one row block
    g = torch.Generator().manual_seed(seed)
    w_qkv = torch.randn(hid, 3 * heads * d, generator=g)
    w_o = torch.randn(heads * d, hid, generator=g)
    for s in (5, 20, 12):  # 20 rows: two row blocks, two programs; 12: one row block, two groups pushing
        xs = [torch.randn(s, hid, generator=g) for _ in range(w)]
        ref = _heads_ref([(x @ w_qkv).view(s, 3, heads, d) for x in xs], me, w)
        attn = [torch.randn(w * s, heads // w, d, generator=g) for _ in range(w)]
        o_ref = _seq_ref(attn, me, w).reshape(s, heads * d) @ w_o
        for method in ("fused", "unfused", "auto"):
            got = weft.ops.qkv_all_to_all(xs[me], w_qkv, heads, method=method)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4, msg=lambda m: f"qkv s={s} {method}: {m}")
            got = weft.ops.all_to_all_o_proj(attn[me], w_o, method=method)
            torch.testing.assert_close(got, o_ref, rtol=1e-5, atol=1e-4, msg=lambda m: f"o s={s} {method}: {m}")
        # The weight as nn.Linear keeps it: transposed storage.
        got = weft.ops.qkv_all_to_all(xs[me], w_qkv.t().contiguous().t(), heads, method="fused")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    xb = xs[me].bfloat16()
    got = weft.ops.qkv_all_to_all(xb, w_qkv.bfloat16(), heads, method="fused").float()
    ref = _heads_ref([(x.bfloat16().float() @ w_qkv.bfloat16().float()).view(s, 3, heads, d) for x in xs], me, w)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    if w > 1:
        rejects(lambda: weft.ops.qkv_all_to_all(xs[me], w_qkv, heads + 1), ValueError, "heads", [])
    rejects(lambda: weft.ops.qkv_all_to_all(xs[me], w_qkv[:, :-1], heads), ValueError, "w_qkv", [])
    rejects(lambda: weft.ops.all_to_all_o_proj(attn[me], w_o[:-1]), ValueError, "w_o", [])
    rejects(lambda: weft.ops.all_to_all_o_proj(attn[me][:, 0], w_o), ValueError, "attn", [])
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fused_projections(world_size):
    run_ranks(_fused, world_size, 5 + world_size, timeout=TIMEOUT, env=ENV)


def _layers(seed):
    import torch
    import torch.nn.functional as F
    from torch import nn

    import weft
    from weft.layers import SPDecodeAttention, UlyssesAttention

    w, me = weft.world_size(), weft.rank()
    torch.manual_seed(seed)  # the same dense layers on every rank
    hid, s = 32, 6
    for heads, kv_heads, bias in ((2 * w, 2 * w, False), (4 * w, 2 * w, False), (2 * w, 2 * w, True)):
        d = 16
        q_p, k_p, v_p = (nn.Linear(hid, n * d, bias=bias) for n in (heads, kv_heads, kv_heads))
        o_p = nn.Linear(heads * d, hid, bias=bias)
        x = torch.randn(w * s, hid)
        with torch.no_grad():
            q, k, v = (p(x).view(w * s, -1, d).transpose(0, 1) for p in (q_p, k_p, v_p))
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // kv_heads, 0),
                                               v.repeat_interleave(heads // kv_heads, 0), is_causal=True)
            ref = o_p(a.transpose(0, 1).reshape(w * s, heads * d))
            got = UlyssesAttention.from_dense(q_p, k_p, v_p, o_p, heads)(x[me * s:(me + 1) * s])
        torch.testing.assert_close(got, ref[me * s:(me + 1) * s], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"ulysses heads={heads} kv={kv_heads} bias={bias}: {m}")

    # Decode: every rank holds a slice of each sequence's cache; the new token goes to the last rank's slice.
    heads, kv_heads, d, batch, cap = 4, 2, 64, 2, 8
    q_p, k_p, v_p = (nn.Linear(hid, n * d) for n in (heads, kv_heads, kv_heads))
    o_p = nn.Linear(heads * d, hid)
    layer = SPDecodeAttention.from_dense(q_p, k_p, v_p, o_p, heads)
    lens = [[3, 0], [2, 5], [4, 1], [1, 2]][:w]  # per rank, per sequence
    caches = [(torch.randn(batch, cap, kv_heads, d), torch.randn(batch, cap, kv_heads, d)) for _ in range(w)]
    k_cache, v_cache = (t.clone() for t in caches[me])
    seqlens = torch.tensor(lens[me], dtype=torch.int32)
    for step in range(2):
        x = torch.randn(batch, hid)
        with torch.no_grad():
            got = layer(x, k_cache, v_cache, seqlens)
            ks = [torch.cat([caches[r][0][b, :lens[r][b]] for r in range(w)]) for b in range(batch)]
            vs = [torch.cat([caches[r][1][b, :lens[r][b]] for r in range(w)]) for b in range(batch)]
            kn, vn = k_p(x).view(batch, kv_heads, d), v_p(x).view(batch, kv_heads, d)
            q = q_p(x).view(batch, heads, d)
            outs = []
            for b in range(batch):
                kk = torch.cat([ks[b], kn[b:b + 1]]).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
                vv = torch.cat([vs[b], vn[b:b + 1]]).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
                outs.append(F.scaled_dot_product_attention(q[b][:, None], kk, vv)[:, 0])
            ref = o_p(torch.stack(outs).reshape(batch, heads * d))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"sp decode step {step}: {m}")
        last = w - 1  # the reference cache follows the appends
        for b in range(batch):
            caches[last][0][b, lens[last][b]] = kn[b]
            caches[last][1][b, lens[last][b]] = vn[b]
            lens[last][b] += 1
    assert seqlens.tolist() == lens[me]
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_layers_match_dense_attention(world_size):
    run_ranks(_layers, world_size, 11, timeout=TIMEOUT, env=ENV)


# -- groups ---------------------------------------------------------------------------------

def _group_calls(group, seed, what):
    """Every op of the family over `group` (a weft Group, a torch ProcessGroup or None) on fresh inputs of odd
    sizes (3 tokens, 3 heads per member), outputs poisoned: each member's inputs gathered over the group's
    process group make the torch reference; the all-to-all bit-exact both ways (method by seed), the fused
    projections against matmul."""
    import torch
    import torch.distributed as dist

    import weft
    from weft.runtime.world import resolve
    from weft.testing.checks import bits, nan_allocations

    g = resolve(group)
    w, me, pg = g.size, g.rank, g.process_group
    gen = torch.Generator().manual_seed(seed * 16 + weft.rank())

    def gathered(t):
        parts = [torch.empty_like(t) for _ in range(w)]
        dist.all_gather(parts, t, group=pg)
        return parts

    def shared(t):  # the same on every member: group rank 0's
        dist.broadcast(t, src=g.ranks[0], group=pg)
        return t

    method = ("push", "nccl", "auto")[seed % 3]
    packed = seed % 2 == 1
    x = torch.randn(3, *((3,) if packed else ()), 3 * w, 16, generator=gen)
    xs = gathered(x)
    with nan_allocations():
        got = weft.ops.ulysses_all_to_all(x, packed=packed, method=method, group=group)
        back = weft.ops.ulysses_all_to_all(got, scatter="seq", packed=packed, method=method, group=group)
    assert bits(got).equal(bits(_heads_ref(xs, me, w))), f"{what}: heads {method} packed={packed}"
    assert bits(back).equal(bits(x)), f"{what}: seq {method} packed={packed}"

    heads, d, hid = 2 * w, 16, 24
    x = torch.randn(5, hid, generator=gen)
    w_qkv = shared(torch.randn(hid, 3 * heads * d, generator=gen))
    attn = torch.randn(w * 5, 2, d, generator=gen)
    w_o = shared(torch.randn(heads * d, hid, generator=gen))
    with nan_allocations():
        qkv = weft.ops.qkv_all_to_all(x, w_qkv, heads, method="fused", group=group)
        o = weft.ops.all_to_all_o_proj(attn, w_o, method="fused", group=group)
    ref = _heads_ref([(xr @ w_qkv).view(5, 3, heads, d) for xr in gathered(x)], me, w)
    torch.testing.assert_close(qkv, ref, rtol=1e-5, atol=1e-4, msg=lambda m: f"{what}: qkv_all_to_all: {m}")
    o_ref = _seq_ref(gathered(attn), me, w).reshape(5, heads * d) @ w_o
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-4, msg=lambda m: f"{what}: all_to_all_o_proj: {m}")


def test_ops_on_group_layouts():
    """4 ranks: every layout (strided, pairs, one, a torch ProcessGroup, the world), calls interleaved (one
    iteration: each layout's call runs several ops on its group, and layouts take different methods)."""
    from weft.testing.groups import on_every_layout

    run_ranks(on_every_layout, 4, _group_calls, 1, timeout=2 * TIMEOUT, env=ENV)


def _leftover_rank():
    """3 ranks: group [0, 2] runs the ops (and the all-to-all compiled with group=, its backward over the
    group) while rank 1 runs its own group of one: no call waits on a non-member."""
    import torch

    import weft
    from weft.testing.checks import bits

    pair = weft.new_group([2, 0])
    one = weft.new_subgroups(1)
    if pair is None:
        for it in range(3):
            _group_calls(one, 20 + it, f"rank 1's own group, call {it}")
        return True
    _group_calls(pair, 30, "pair, call 0")
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(weft.rank())).requires_grad_()
    compiled = torch.compile(lambda t: weft.ops.ulysses_all_to_all(t, group=pair), fullgraph=True)
    y = compiled(x)
    assert bits(y).equal(bits(weft.ops.ulysses_all_to_all(x.detach(), group=pair)))
    y.backward(y.detach())  # the backward is the all-to-all back over the pair: the gradient is x
    assert bits(x.grad).equal(bits(x.detach()))
    _group_calls(pair, 31, "pair, call 1")
    return True


def test_group_with_leftover_rank():
    run_ranks(_leftover_rank, 3, timeout=2 * TIMEOUT, env=ENV)
