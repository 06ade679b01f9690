"""Every family's ops with `group=` on GPUs, on every layout the world size allows (weft.testing.groups: the world,
groups of every other rank, consecutive pairs, a torch ProcessGroup, a group of one), against NCCL over the same
group. Run: `weft run -n N -m pytest tests/test_gpu_groups.py -m gpu` (N = 1 gives the world and groups of one)."""
import pytest
import torch
import torch.distributed as dist

import weft

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def layouts():
    weft.init()
    from weft.testing.groups import layouts as make

    found = make()
    yield found
    weft.finalize()


def _gen(seed):
    return torch.Generator("cuda").manual_seed(seed)


def _randn(seed, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=_gen(seed), device="cuda").to(dtype)


def _each(layouts):
    for name, group in layouts.items():
        yield name, group, weft.get_group(group)


def _nccl_gather(x, g):
    out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=g.process_group)
    return out


def test_collectives_on_every_layout(layouts):
    me = weft.rank()
    for name, group, g in _each(layouts):
        for it in range(2):
            x = _randn(100 * me + it, 37 * g.size, 5)
            assert torch.equal(weft.ops.all_gather(x, group=group), _nccl_gather(x, g)), name
            for op, dtype in (("sum", torch.float32), ("max", torch.bfloat16), ("sum", torch.int32)):
                y = (x.float() * 100).to(dtype)
                ref = y.clone()
                dist.all_reduce(ref, op=getattr(dist.ReduceOp, op.upper()), group=g.process_group)
                got = weft.ops.all_reduce(y, op=op, group=group)
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3, msg=f"{name} all_reduce {op} {dtype}")
                rs = ref.new_empty((y.shape[0] // g.size, *y.shape[1:]))
                dist.reduce_scatter_tensor(rs, y, op=getattr(dist.ReduceOp, op.upper()), group=g.process_group)
                torch.testing.assert_close(weft.ops.reduce_scatter(y, op=op, group=group), rs, rtol=1e-5, atol=1e-3,
                                           msg=f"{name} reduce_scatter {op} {dtype}")
            root = g.size - 1
            b = x.clone()
            dist.broadcast(b, group_src=root, group=g.process_group)
            assert torch.equal(weft.ops.broadcast(x.clone(), root=root, group=group), b), name
            weft.ops.device_barrier(group=group)
    torch.cuda.synchronize()


def test_overlapped_gemms_on_every_layout(layouts):
    me = weft.rank()
    for name, group, g in _each(layouts):
        a_shard = _randn(7 + me, 128, 256)
        b = _randn(11, 256, 384)  # the same on every rank
        ref = _nccl_gather(a_shard, g).float() @ b.float()
        torch.testing.assert_close(weft.ops.ag_gemm(a_shard, b, group=group).float(), ref, rtol=2e-2, atol=2e-1,
                                   msg=f"{name} ag_gemm")
        a = _randn(13 + me, 128 * g.size, 256)
        b_shard = _randn(17 + me, 256, 384)
        full = (a.float() @ b_shard.float()).contiguous()
        dist.all_reduce(full, group=g.process_group)
        rows = full.shape[0] // g.size
        torch.testing.assert_close(weft.ops.gemm_rs(a, b_shard, group=group).float(),
                                   full[g.rank * rows:(g.rank + 1) * rows], rtol=2e-2, atol=5e-1, msg=f"{name} gemm_rs")
        a8 = _randn(19, 8, 256)
        full8 = (a8.float() @ b_shard.float()).contiguous()
        dist.all_reduce(full8, group=g.process_group)
        torch.testing.assert_close(weft.ops.gemm_ar(a8, b_shard, group=group).float(), full8, rtol=2e-2, atol=5e-1,
                                   msg=f"{name} gemm_ar")
    torch.cuda.synchronize()


def test_attention_and_ulysses_on_every_layout(layouts):
    me = weft.rank()
    for name, group, g in _each(layouts):
        # Ulysses: (tokens, heads, d) sharded by tokens -> by heads; the all-to-all's reference is NCCL's.
        x = _randn(23 + me, 16, 2 * g.size, 64)
        got = weft.ops.ulysses_all_to_all(x, group=group)
        parts = list(x.chunk(g.size, dim=1))
        recv = [torch.empty_like(p) for p in parts]
        dist.all_to_all(recv, [p.contiguous() for p in parts], group=g.process_group)
        assert torch.equal(got, torch.cat(recv, dim=0)), f"{name} ulysses_all_to_all"
        # sp_flash_decode: each member a slice of the cache; the reference attends over the whole.
        q = _randn(29, 2, 8, 128)
        k, v = _randn(31 + me, 2, 64, 2, 128), _randn(37 + me, 2, 64, 2, 128)
        lens = torch.tensor([64, 17], dtype=torch.int32, device="cuda")
        out = weft.ops.sp_flash_decode(q, k, v, lens, group=group)
        ks, vs = _nccl_gather(k.transpose(0, 1).contiguous(), g), _nccl_gather(v.transpose(0, 1).contiguous(), g)
        all_lens = _nccl_gather(lens, g).view(g.size, 2)
        keys = ks.view(g.size, 64, 2, 2, 128)
        vals = vs.view(g.size, 64, 2, 2, 128)
        for row in range(2):
            kk = torch.cat([keys[r, :all_lens[r, row], row] for r in range(g.size)]).float()  # (L, kv, d)
            vv = torch.cat([vals[r, :all_lens[r, row], row] for r in range(g.size)]).float()
            qq = q[row].float().view(2, 4, 128)  # (kv, group, d)
            s = torch.einsum("kgd,lkd->kgl", qq, kk) / 128 ** 0.5
            ref = torch.einsum("kgl,lkd->kgd", s.softmax(-1), vv).reshape(8, 128)
            torch.testing.assert_close(out[row].float(), ref, rtol=2e-2, atol=2e-2, msg=f"{name} sp_flash_decode")
    torch.cuda.synchronize()


def test_moe_on_every_layout(layouts):
    me = weft.rank()
    for name, group, g in _each(layouts):
        e, hidden, tokens = 4 * g.size, 128, 24
        x = _randn(41 + me, tokens, hidden)
        idx = torch.stack([torch.randperm(e, generator=_gen(43 + 7 * me + t), device="cuda")[:2]
                           for t in range(tokens)])
        weights = torch.rand(tokens, 2, generator=_gen(47 + me), device="cuda")
        # EP (prefill): a token goes once to each member holding one of its experts, and the combine sums what
        # comes back unweighted: the rows returned unchanged give x times the number of members it went to.
        rx, ridx, rw, counts, handle = weft.ops.ep_dispatch(x, idx, weights, e, group=group)
        y = weft.ops.ep_combine(rx, handle, group=group)
        owners = idx // (e // g.size)
        went = (owners[:, :1] != owners[:, 1:]).sum(1, keepdim=True) + 1
        torch.testing.assert_close(y.float(), x.float() * went, rtol=2e-2, atol=2e-2, msg=f"{name} ep pair")
        # EP (decode): one row per (token, expert); the combine weights them: x times the sum of its weights.
        recv, ll_counts, _, ll_handle = weft.ops.ep_dispatch_ll(x, idx, e, tokens, group=group)
        y = weft.ops.ep_combine_ll(recv, idx, weights, ll_handle, group=group)
        torch.testing.assert_close(y.float(), x.float() * weights.sum(1, keepdim=True), rtol=2e-2, atol=2e-2,
                                   msg=f"{name} ep ll pair")
    torch.cuda.synchronize()
