"""GPU checks of Ulysses sequence parallelism, run on every rank:
`weft run -n N -m pytest tests/test_gpu_ulysses.py -m gpu` (scripts/gpu_suite.sh, attention part)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import weft
from weft.layers import SPDecodeAttention, UlyssesAttention
from weft.testing.graphs import capture

pytestmark = pytest.mark.gpu

HEADS, HEAD_DIM, HIDDEN = 32, 128, 4096


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    torch.manual_seed(1 + weft.rank())  # inputs differ per rank
    yield weft.world()


def _rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_all_to_all_matches_all_to_all_single(packed, dtype):
    """Push against all_to_all_single (+ permutes), bit-exact, both ways, sizes changing call by call (the
    largest goes through the workspace in passes)."""
    w = weft.world()
    mid = (3,) if packed else ()
    for s in (1, 37, 1024, 8192, 513):
        x = torch.randn(s, *mid, HEADS, HEAD_DIM, device=w.device).to(dtype)
        ref = weft.ops.ulysses_all_to_all(x, packed=packed, method="nccl")
        got = weft.ops.ulysses_all_to_all(x, packed=packed, method="push")
        assert torch.equal(got, ref), (s, packed, dtype)
        back = weft.ops.ulysses_all_to_all(got, scatter="seq", packed=packed, method="push")
        assert torch.equal(back, x), (s, packed, dtype)
        assert torch.equal(weft.ops.ulysses_all_to_all(got, scatter="seq", packed=packed, method="nccl"), x)


def test_all_to_all_cuda_graph_replay():
    w = weft.world()
    x = torch.randn(256, HEADS, HEAD_DIM, device=w.device, dtype=torch.bfloat16)
    weft.ops.ulysses_all_to_all(x, method="push")  # the workspace is made outside capture
    outs = []
    g = capture(lambda: outs.append(weft.ops.ulysses_all_to_all(
        weft.ops.ulysses_all_to_all(x, method="push"), scatter="seq", method="push")))
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        g.replay()
        assert torch.equal(outs[-1], x)


@pytest.mark.parametrize("s", [128, 1000, 2048, 6000])  # 6000: QKV in 3 passes of the default workspace
def test_fused_projections(s):
    w = weft.world()
    gen = torch.Generator(device=w.device).manual_seed(5)  # the same weights everywhere
    w_qkv = (torch.randn(HIDDEN, 3 * HEADS * HEAD_DIM, device=w.device, generator=gen) * HIDDEN ** -0.5).bfloat16()
    w_o = (torch.randn(HEADS * HEAD_DIM, HIDDEN, device=w.device, generator=gen) * 0.02).bfloat16()
    for _ in range(2):
        x = torch.randn(s, HIDDEN, device=w.device, dtype=torch.bfloat16)
        got = weft.ops.qkv_all_to_all(x, w_qkv, HEADS, method="fused")
        ref = weft.ops.qkv_all_to_all(x, w_qkv, HEADS, method="unfused")
        assert _rel_err(got, ref) < 1e-2
        attn = torch.randn(w.world_size * s, HEADS // w.world_size, HEAD_DIM, device=w.device, dtype=torch.bfloat16)
        got = weft.ops.all_to_all_o_proj(attn, w_o, method="fused")
        ref = weft.ops.all_to_all_o_proj(attn, w_o, method="unfused")
        assert _rel_err(got, ref) < 1e-2


def test_ulysses_attention_matches_dense():
    w = weft.world()
    s = 1024
    torch.manual_seed(7)  # the same layer and sequence on every rank
    for kv_heads in (HEADS, 8):
        q_p, k_p, v_p = (nn.Linear(HIDDEN, n * HEAD_DIM, bias=False, device=w.device, dtype=torch.bfloat16)
                         for n in (HEADS, kv_heads, kv_heads))
        o_p = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False, device=w.device, dtype=torch.bfloat16)
        x = torch.randn(w.world_size * s, HIDDEN, device=w.device, dtype=torch.bfloat16)
        with torch.no_grad():
            q, k, v = (p(x).view(x.shape[0], -1, HEAD_DIM).transpose(0, 1) for p in (q_p, k_p, v_p))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != HEADS)
            ref = o_p(a.transpose(0, 1).reshape(x.shape[0], -1))[w.rank * s:(w.rank + 1) * s]
            got = UlyssesAttention.from_dense(q_p, k_p, v_p, o_p, HEADS)(x[w.rank * s:(w.rank + 1) * s])
        assert _rel_err(got, ref) < 2e-2, kv_heads


def test_sp_decode_attention_matches_dense():
    w = weft.world()
    torch.manual_seed(8)  # the same layer, caches and tokens on every rank
    batch, kv_heads, cap, shard = 4, 8, 4096, 3000
    dev, dt = w.device, torch.bfloat16
    q_p, k_p, v_p = (nn.Linear(HIDDEN, n * HEAD_DIM, device=dev, dtype=dt) for n in (HEADS, kv_heads, kv_heads))
    o_p = nn.Linear(HEADS * HEAD_DIM, HIDDEN, device=dev, dtype=dt)
    layer = SPDecodeAttention.from_dense(q_p, k_p, v_p, o_p, HEADS)
    ks = torch.randn(w.world_size, batch, cap, kv_heads, HEAD_DIM, device=dev, dtype=dt)
    vs = torch.randn_like(ks)
    k_cache, v_cache = ks[w.rank].clone(), vs[w.rank].clone()
    seqlens = torch.full((batch,), shard, dtype=torch.int32, device=dev)
    x = torch.randn(batch, HIDDEN, device=dev, dtype=dt)
    with torch.no_grad():
        got = layer(x, k_cache, v_cache, seqlens)
        kk = torch.cat([ks[r, :, :shard] for r in range(w.world_size)] + [k_p(x).view(batch, 1, kv_heads, HEAD_DIM)], 1)
        vv = torch.cat([vs[r, :, :shard] for r in range(w.world_size)] + [v_p(x).view(batch, 1, kv_heads, HEAD_DIM)], 1)
        a = F.scaled_dot_product_attention(q_p(x).view(batch, HEADS, 1, HEAD_DIM), kk.transpose(1, 2),
                                           vv.transpose(1, 2), enable_gqa=True)
        ref = o_p(a.reshape(batch, HEADS * HEAD_DIM))
    assert _rel_err(got, ref) < 2e-2
    assert seqlens.tolist() == [shard + (w.rank == w.world_size - 1)] * batch
