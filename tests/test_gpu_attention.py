"""GPU checks of flash_decode and sp_flash_decode, run on every rank:
`weft run -n N -m pytest tests/test_gpu_attention.py -m gpu` (N = 1 checks flash_decode alone)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import weft
from weft.kernels.flash_decode import flash_decode, sp_flash_decode, sp_flash_decode_merge_only
from weft.testing.checks import nan_allocations
from weft.testing.graphs import capture

pytestmark = pytest.mark.gpu

# Against an fp32 reference on the same (rounded) inputs: the kernels round P to the KV dtype before P @ V.
TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=5e-3, atol=5e-3),
       torch.float32: dict(rtol=1e-4, atol=1e-4)}


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    yield weft.world()


def _gen(seed):
    """The same random stream on every rank (sp's q and every rank's shard are known everywhere)."""
    return torch.Generator(device=weft.device()).manual_seed(seed)


def _inputs(seed, batch, q_heads, kv_heads, head_dim, max_len, dtype, lens=None):
    g = _gen(seed)
    dev = weft.device()
    q = torch.randn(batch, q_heads, head_dim, device=dev, generator=g).to(dtype)
    k = torch.randn(batch, max_len, kv_heads, head_dim, device=dev, generator=g).to(dtype)
    v = torch.randn(batch, max_len, kv_heads, head_dim, device=dev, generator=g).to(dtype)
    if lens is None:
        lens = torch.randint(1, max_len + 1, (batch,), device=dev, generator=g)
        lens[0], lens[-1] = max_len, 1
    return q, k, v, torch.as_tensor(lens, device=dev).to(torch.int32)


def _reference(q, k, v, lens, scale=None):
    """fp32 (out, lse) through torch's scaled_dot_product_attention, ragged lengths as a mask."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    kk = k.float().transpose(1, 2).repeat_interleave(group, dim=1)  # (B, H, L, D)
    vv = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    mask = torch.arange(k.shape[1], device=k.device)[None, :] < lens[:, None].long()  # (B, L)
    out = F.scaled_dot_product_attention(q.float()[:, :, None, :], kk, vv, attn_mask=mask[:, None, None, :],
                                         scale=scale)[:, :, 0]
    s = torch.einsum("bhd,bhld->bhl", q.float(), kk) * scale
    lse = torch.logsumexp(s.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
    return torch.where(lens[:, None, None] > 0, out, 0.0), lse


def _paged(k, v, page_size, seed):
    batch, max_len, kv_heads, head_dim = k.shape
    per_seq = -(-max_len // page_size)
    pad = per_seq * page_size - max_len
    order = torch.randperm(batch * per_seq + 3, generator=torch.Generator().manual_seed(seed)).to(k.device)
    table = order[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    k_pages = torch.full((batch * per_seq + 3, page_size, kv_heads, head_dim), float("nan"), dtype=k.dtype,
                         device=k.device)
    v_pages = torch.full_like(k_pages, float("nan"))
    k_pages[table.view(-1).long()] = F.pad(k, (0, 0, 0, 0, 0, pad)).view(-1, page_size, kv_heads, head_dim)
    v_pages[table.view(-1).long()] = F.pad(v, (0, 0, 0, 0, 0, pad)).view(-1, page_size, kv_heads, head_dim)
    return k_pages, v_pages, table


def _check(out, lse, ref_out, ref_lse, dtype, what=""):
    torch.testing.assert_close(out.float(), ref_out, **TOL[dtype], msg=lambda m: f"{what}: {m}")
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-3, msg=lambda m: f"{what} lse: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "paged 16", "paged 256", "paged 1"])
def test_flash_decode_matches_sdpa(layout, dtype):
    """Llama-3-8B decode: batch 8, 32 query / 8 KV heads, head_dim 128, up to 4096 cached positions."""
    q, k, v, lens = _inputs(1, 8, 32, 8, 128, 4096, dtype)
    ref_out, ref_lse = _reference(q, k, v, lens)
    if layout == "contiguous":
        out, lse = flash_decode(q, k, v, lens, return_lse=True)
    else:
        k_pages, v_pages, table = _paged(k, v, int(layout.split()[1]), seed=2)
        out, lse = flash_decode(q, k_pages, v_pages, lens, block_table=table, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _check(out, lse, ref_out, ref_lse, dtype, layout)


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, dtype", [
    (8, 8, 64, torch.bfloat16), (64, 8, 128, torch.bfloat16), (32, 1, 256, torch.float16),
    (128, 1, 64, torch.bfloat16), (12, 4, 128, torch.float32)])
def test_flash_decode_head_configs(q_heads, kv_heads, head_dim, dtype):
    q, k, v, lens = _inputs(3, 5, q_heads, kv_heads, head_dim, 1000, dtype, lens=[1000, 0, 1, 999, 513])
    ref_out, ref_lse = _reference(q, k, v, lens, scale=0.05)
    out, lse = flash_decode(q, k, v, lens, scale=0.05, return_lse=True)
    _check(out, lse, ref_out, ref_lse, dtype, f"{q_heads}/{kv_heads} d{head_dim}")
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def _concat_reference(q, ks, vs, lens):
    """The reference over the concatenation of every rank's slice: (ks[r], vs[r]) of lengths lens[r]."""
    keep = torch.cat([torch.arange(k.shape[1], device=k.device)[None, :] < n[:, None] for k, n in zip(ks, lens)],
                     dim=1)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # every sequence's kept positions first
    idx = order[:, :, None, None].expand(-1, -1, *ks[0].shape[2:])
    full_k, full_v = torch.cat(ks, dim=1).gather(1, idx), torch.cat(vs, dim=1).gather(1, idx)
    return _reference(q, full_k, full_v, keep.sum(1).to(torch.int32))[0]


def _sp_case(seed, shard_len, empty_rank=None, page_size=0, batch=4):
    """(q, my shard (k, v, lens, block_table), the reference): every rank makes every rank's shard."""
    w = weft.world()
    shards = [_inputs(seed * 100 + r, batch, 32, 8, 128, shard_len, torch.bfloat16) for r in range(w.world_size)]
    q = shards[0][0]
    if empty_rank is not None:
        shards[empty_rank][3].zero_()
    ref_out = _concat_reference(q, [s[1] for s in shards], [s[2] for s in shards], [s[3] for s in shards])
    _, k, v, lens = shards[w.rank]
    if page_size:
        k, v, table = _paged(k, v, page_size, seed)
        return q, (k, v, lens, table), ref_out
    return q, (k, v, lens, None), ref_out


def _same_on_every_rank(out):
    w = weft.world()
    every = [torch.empty_like(out) for _ in range(w.world_size)]
    dist.all_gather(every, out.contiguous(), group=w.group)
    for r, o in enumerate(every):
        assert torch.equal(o.view(torch.uint8), out.view(torch.uint8)), f"rank {r} differs from rank {w.rank}"


@pytest.mark.parametrize("page_size", [0, 16])
def test_sp_flash_decode_matches_reference(page_size):
    w = weft.world()
    for call, empty_rank in enumerate([None, w.world_size - 1, 0]):
        q, (k, v, lens, table), ref_out = _sp_case(10 + call, 2048, empty_rank, page_size)
        out = sp_flash_decode(q, k, v, lens, block_table=table)
        _check(out, None, ref_out, None, torch.bfloat16, f"call {call}")
        _same_on_every_rank(out)


def test_sp_flash_decode_back_to_back_no_host_sync():
    """20 calls with changing lengths and no host synchronisation until the end (a rank late each time)."""
    w = weft.world()
    _back_to_back([_sp_case(20 + i, 512, empty_rank=i % w.world_size if i % 3 == 0 else None, batch=2)
                   for i in range(20)])


def _back_to_back(cases):
    """sp_flash_decode of every case in turn, outputs poisoned, no host sync until the end, a different rank
    late each call; then each output against its reference and the same on every rank."""
    w = weft.world()
    outs = []
    weft.barrier()
    with nan_allocations():
        for i, (q, (k, v, lens, _), _) in enumerate(cases):
            if i % w.world_size == w.rank:
                torch.cuda._sleep(100_000)
            outs.append(sp_flash_decode(q, k, v, lens))
    torch.cuda.synchronize()
    for i, (out, (_, _, ref_out)) in enumerate(zip(outs, cases)):
        _check(out, None, ref_out, None, torch.bfloat16, f"call {i}")
        _same_on_every_rank(out)


def test_sp_flash_decode_alternating_grids_no_host_sync():
    """Calls whose merge grids differ (32 rows: 32 programs; 256 rows: one per SM, several rows each; 64;
    batch 40: two passes) in turn, outputs poisoned, no host sync until the end, a rank late each time: the
    epoch counter must hold whatever each call's grid."""
    _back_to_back([_sp_case(60 + i, 256, batch=b) for i, b in enumerate([1, 8, 2, 40, 1, 8, 2])])


def test_sp_merge_kernel_alone_in_a_graph():
    """The merge kernel alone on ready partials (what `weft bench attention --ops sp` times), replayed from
    a CUDA graph between ordinary calls, its output poisoned before each replay."""
    q, (k, v, lens, _), ref_out = _sp_case(80, 1024, batch=2)
    merge, out = sp_flash_decode_merge_only(q, k, v, lens)
    merge()
    _check(out, None, ref_out, None, torch.bfloat16, "merge alone")
    g = capture(merge)
    for replay in range(3):
        out.fill_(float("nan"))
        g.replay()
        _check(out, None, ref_out, None, torch.bfloat16, f"merge alone, replay {replay}")
        _same_on_every_rank(out)
        _check(sp_flash_decode(q, k, v, lens), None, ref_out, None, torch.bfloat16, f"call after replay {replay}")


def test_cuda_graph_capture_and_replay():
    """flash_decode and sp_flash_decode captured once, replayed with new queries and lengths."""
    q, k, v, lens = _inputs(30, 4, 32, 8, 128, 2048, torch.bfloat16)
    sq, (sk, sv, slens, _), _ = _sp_case(31, 1024)
    outs = {}

    def calls():
        outs["fd"] = flash_decode(q, k, v, lens)
        outs["sp"] = sp_flash_decode(sq, sk, sv, slens)

    calls()  # creates sp's exchange buffer outside capture
    g = capture(calls)
    for replay in range(4):
        gen = _gen(40 + replay)
        q.copy_(torch.randn(q.shape, device=q.device, generator=gen))
        lens.copy_(torch.randint(0, 2049, lens.shape, device=q.device, generator=gen))
        sq.copy_(torch.randn(sq.shape, device=q.device, generator=gen))
        slens.copy_(torch.randint(0, 1025, slens.shape, device=q.device, generator=_gen(50 + replay + weft.rank())))
        g.replay()
        ref_out, _ = _reference(q, k, v, lens)
        _check(outs["fd"], None, ref_out, None, torch.bfloat16, f"flash_decode replay {replay}")
        _check(outs["sp"], None, _sp_replay_reference(sq, sk, sv, slens), None, torch.bfloat16,
               f"sp_flash_decode replay {replay}")
        _same_on_every_rank(outs["sp"])


def _sp_replay_reference(q, k, v, lens):
    """The reference over every rank's (k, v, lens), all-gathered (as bytes: any dtype, any backend)."""
    group = weft.world().group
    parts = []
    for t in (k, v, lens):
        t = t.contiguous()
        every = [torch.empty_like(t) for _ in range(weft.world_size())]
        dist.all_gather([e.view(torch.uint8) for e in every], t.view(torch.uint8), group=group)
        parts.append(every)
    return _concat_reference(q, *parts)
