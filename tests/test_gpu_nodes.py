"""The hierarchical collectives, ag_gemm and gemm_rs on GPUs over simulated nodes: the node's kernels inside a
node, NCCL on the rail between nodes, the heap mapped per node. Run: `weft run -n 2 --local-world-size 1 -m pytest tests/test_gpu_nodes.py
-m gpu` (2 nodes of 1), or `-n 4 --local-world-size 2` (2 nodes of 2)."""
import pytest
import torch
import torch.distributed as dist

import weft

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world():
    w = weft.init()
    yield w
    weft.finalize()


def test_collectives_across_simulated_nodes(world):
    assert world.topology.spans_nodes, "run with --local-world-size smaller than -n"
    gen = torch.Generator("cuda").manual_seed(17 + world.rank)
    for shape in ((3, 5), (4096 + 13, 7), (1 << 20,)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(weft.ops.all_reduce(x, method="two_shot"), ref, **tol)
            xs = torch.randn((world.world_size * shape[0], *shape[1:]), generator=gen, device="cuda").to(dtype)
            rs = torch.empty_like(x)
            dist.reduce_scatter_tensor(rs, xs)
            torch.testing.assert_close(weft.ops.reduce_scatter(xs, method="two_shot"), rs, **tol)
            ag = torch.empty_like(xs)
            dist.all_gather_into_tensor(ag, x)
            assert torch.equal(weft.ops.all_gather(x, method="push"), ag)
    # The per-node heap: this node's peers are mapped, another node's are not.
    far = next(r for r in range(world.world_size) if world.node_ids[r] != world.node_ids[world.rank])
    t = weft.empty((4,), torch.float32)
    with pytest.raises(ValueError, match="not mapped here"):
        weft.peer(t, far)


def test_gemm_ops_across_simulated_nodes(world):
    """ag_gemm and gemm_rs (overlap) across nodes: the node's overlapped op, NCCL on the rail on a side stream."""
    size, rank = world.world_size, world.rank
    gen = torch.Generator("cuda").manual_seed(23)  # the same inputs on every rank
    for m, k, n in ((1000, 512, 256), (77, 256, 128)):  # m a multiple of no tile
        shards = torch.randn((size, m, k), generator=gen, device="cuda").to(torch.bfloat16)
        b = torch.randn((k, n), generator=gen, device="cuda").to(torch.bfloat16)
        want = shards.reshape(-1, k).float() @ b.float()
        out = torch.full((size * m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = weft.ops.ag_gemm(shards[rank], b, method="overlap", out=out)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-1)
        parts = torch.randn((size, size * m, k), generator=gen, device="cuda").to(torch.bfloat16)
        b_shards = torch.randn((size, k, n), generator=gen, device="cuda").to(torch.bfloat16)
        partials = [parts[q].float() @ b_shards[q].float() for q in range(size)]
        full = sum(partials)
        got = weft.ops.gemm_rs(parts[rank], b_shards[rank], method="overlap")
        # Each member's partial is rounded to bf16 before the sum (as the flat op and NCCL's reduce_scatter do), so
        # where partials of ~100 cancel the error is a few of their ulps, not a fraction of the small result.
        ulp = max(p.abs().max() for p in partials).item() * 2.0 ** -8
        torch.testing.assert_close(got.float(), full[rank * m:(rank + 1) * m], rtol=2e-2, atol=size * ulp)
        assert torch.equal(weft.ops.gemm_rs(parts[rank], b_shards[rank], method="overlap"), got)
    plans = [p for key, p in world.plans.items() if key[0] in ("ag_gemm", "gemm_rs")]
    assert plans and all(type(p.run.__self__).__module__ == "weft.kernels.hierarchical" for p in plans)
