"""The hierarchical collectives on GPUs over simulated nodes: the node's kernels inside a node, NCCL on the rail
between nodes, the heap mapped per node. Run: `weft run -n 2 --local-world-size 1 -m pytest tests/test_gpu_nodes.py
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
