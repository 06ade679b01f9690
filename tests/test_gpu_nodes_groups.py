"""Groups that only some ranks belong to, made before the world's hierarchy, on GPUs over simulated nodes: the
world's first op across nodes then makes its node and rail groups among ranks that registered different numbers
of torch process groups (a hang while torch named those groups: weft/runtime/subgroups.py), and the user group's
first op makes its heap (mapped per node, its node groups made by its members alone) and its own hierarchy.
Run in a fresh world, before anything else makes the world's hierarchy:
`weft run -n 4 --local-world-size 2 -m pytest tests/test_gpu_nodes_groups.py -m gpu` (or `-n 2 --local-world-size 1`).
"""
import pytest
import torch
import torch.distributed as dist

import weft

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world(gpu_world):
    return gpu_world


def _check_all_gather(group, seed):
    g = weft.get_group(group)
    x = torch.randn(5, 3, generator=torch.Generator("cuda").manual_seed(seed + weft.rank()), device="cuda")
    ref = torch.empty((g.size * 5, 3), device="cuda")
    dist.all_gather_into_tensor(ref, x, group=g.process_group)
    assert torch.equal(weft.ops.all_gather(x, group=group), ref), g


def test_group_of_the_corner_ranks_before_the_world_hierarchy(world):
    assert world.topology.spans_nodes, "run with --local-world-size smaller than -n"
    from weft.kernels import hierarchical

    assert "hierarchy" not in world.contexts, "run this file in a fresh world: the world's hierarchy exists already"
    last = world.world_size - 1
    corners = weft.new_group([0, last])  # the first rank of the first node, the last of the last
    _check_all_gather(None, 10)
    assert hierarchical.hierarchy(world) is not None
    # On the NVSHMEM rail a group that spans nodes and is not the world has no heap (check_heap_route refuses it).
    if corners is not None and (world.rail_route != "nvshmem" or corners.size == world.world_size):
        _check_all_gather(corners, 20)
    x = torch.randn(4096, generator=torch.Generator("cuda").manual_seed(30 + world.rank), device="cuda")
    ref = x.clone()
    dist.all_reduce(ref)
    torch.testing.assert_close(weft.ops.all_reduce(x), ref, rtol=1e-5, atol=1e-4)
    weft.barrier()
