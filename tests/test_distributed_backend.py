"""weft as a torch.distributed backend (weft/distributed.py): collectives through a "weft" process group against
gloo's on the same inputs, a new_group(backend="weft") subgroup of an initialised weft, and DDP and FSDP2 training
on init_process_group(backend="weft") against one-process training on the full batch. One rank launch per world
size: each rank first runs the subgroup cases in the world run_ranks made (weft.init over gloo), then finalizes it
and joins a new world with init_process_group(backend="weft")."""
import os

import pytest

from weft.testing import run_ranks

STEPS = 3
BATCH = 12  # per rank


def _weft_takes(call) -> bool:
    """Whether weft's op takes this call (a collective: every rank makes the same call): the route the backend
    must choose for it, weft's own or the internal group's."""
    try:
        call()
    except (TypeError, ValueError):
        return False
    return True


def _collectives_against_gloo(pg, ref, seed: int) -> None:
    """Every collective the backend runs on weft, through `pg` (a weft process group) and through `ref` (a gloo
    group of the same ranks) on the same fresh random inputs; outputs poisoned first, odd shapes. Data movement is
    bit-exact; reductions within fp32 rounding of a different summation order (exact for max/min and ints)."""
    import torch
    import torch.distributed as dist

    import weft

    g, me, n = weft.get_group(pg), pg.rank(), pg.size()
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    before = dict(pg.calls)

    def on_weft(name, takes):
        """The collective `name` ran on weft exactly where weft takes it."""
        route = "weft" if takes else "forwarded"
        assert pg.calls[name, route] == before.get((name, route), 0) + 1, (name, route, dict(pg.calls))
        before[name, route] = pg.calls[name, route]

    # all_gather_into_tensor, out of place and in place (the input is this rank's slice of the output: FSDP2's call)
    x = torch.randn(5, 3, generator=gen)
    out, want = torch.full((n * 5, 3), float("nan")), torch.empty(n * 5, 3)
    dist.all_gather_into_tensor(out, x, group=pg)
    dist.all_gather_into_tensor(want, x, group=ref)
    assert torch.equal(out, want)
    on_weft("all_gather_into_tensor", True)
    inplace = torch.full((n * 7,), float("nan"))
    inplace[me * 7:(me + 1) * 7] = torch.randn(7, generator=gen)
    want = torch.empty(n * 7)
    dist.all_gather_into_tensor(want, inplace[me * 7:(me + 1) * 7].clone(), group=ref)
    dist.all_gather_into_tensor(inplace, inplace[me * 7:(me + 1) * 7], group=pg)
    assert torch.equal(inplace, want)
    on_weft("all_gather_into_tensor", True)

    # all_gather into a list, of a dtype torch's reductions would not take
    x = torch.randint(0, 255, (9,), dtype=torch.uint8, generator=gen)
    outs = [torch.full((9,), 0xAB, dtype=torch.uint8) for _ in range(n)]
    wants = [torch.empty(9, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(outs, x, group=pg)
    dist.all_gather(wants, x, group=ref)
    assert all(torch.equal(o, w) for o, w in zip(outs, wants))
    on_weft("allgather", True)

    # broadcast from every group rank in turn (group_src: c10d's Backend API takes the group rank)
    for root in range(n):
        x = torch.randn(6, 5, generator=gen)
        y, want = x.clone(), x.clone()
        takes = _weft_takes(lambda: weft.ops.broadcast(x.clone(), root=root, group=g))
        dist.broadcast(y, group_src=root, group=pg)
        dist.broadcast(want, group_src=root, group=ref)
        assert torch.equal(y, want), root
        on_weft("broadcast", takes)

    # all_reduce and reduce_scatter (tensor and list forms): every reduction, float and int
    for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.MAX, "max"),
                     (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.PRODUCT, "product")):
        for dtype in (torch.float32, torch.int32):
            if dtype == torch.int32 and op == dist.ReduceOp.AVG:
                continue  # gloo's integer average is not the reference to hold weft to
            exact = dtype != torch.float32 or op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN)
            close = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
            if dtype == torch.float32:
                x = torch.rand(3 * n, 7, generator=gen) + 0.5  # products stay finite
            else:
                x = torch.randint(-3, 4, (3 * n, 7), dtype=dtype, generator=gen)
            y, want = x.clone(), x.clone()
            takes = _weft_takes(lambda: weft.ops.all_reduce(x.clone(), op=name, group=g))
            dist.all_reduce(y, op=op, group=pg)
            dist.all_reduce(want, op=op, group=ref)
            assert close(y, want), (name, dtype)
            on_weft("allreduce", takes)

            takes = _weft_takes(lambda: weft.ops.reduce_scatter(x, op=name, group=g))
            out, want = torch.full((3, 7), -7).to(dtype), torch.empty(3, 7, dtype=dtype)
            dist.reduce_scatter_tensor(out, x, op=op, group=pg)
            dist.reduce_scatter_tensor(want, x, op=op, group=ref)
            assert close(out, want), (name, dtype)
            on_weft("reduce_scatter_tensor", takes)

            parts = list(x.chunk(n))
            out, want = torch.full((3, 7), -7).to(dtype), torch.empty(3, 7, dtype=dtype)
            dist.reduce_scatter(out, parts, op=op, group=pg)
            dist.reduce_scatter(want, parts, op=op, group=ref)
            assert close(out, want), (name, dtype)
            on_weft("reduce_scatter", takes)

    dist.barrier(group=pg)
    on_weft("barrier", True)


def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def _batches(world_size: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(world_size * BATCH, 8, generator=gen), torch.randn(world_size * BATCH, 4, generator=gen))
            for _ in range(STEPS)]


def _train(model, batches, rank: int, world_size: int, share: bool):
    """One SGD step (no momentum: no state between calls) per batch on the mean squared error; with `share`, this
    rank's rows of each batch only."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        if share:
            x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _backend(store_path: str):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import weft

    rank, world_size = weft.rank(), weft.world_size()

    # weft initialised over gloo: a weft subgroup (strided: [1, 3] on 4 ranks, [1] on 2), the others do nothing.
    members = list(range(1, world_size, 2))
    sub = dist.new_group(members, backend="weft")
    ref = dist.new_group(members, backend="gloo")
    if rank in members:
        assert weft.get_group(sub).ranks == tuple(members)
        _collectives_against_gloo(sub, ref, seed=1)
    dist.destroy_process_group(sub)
    weft.finalize()  # destroys run_ranks' gloo world

    # weft as the default group
    dist.init_process_group("weft", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    pg = dist.group.WORLD
    assert dist.get_backend() == "weft" and weft.is_initialized() and weft.get_group(pg) is weft.world()
    _collectives_against_gloo(pg, dist.new_group(backend="gloo"), seed=2)

    reference = _mlp()
    _train(reference, _batches(world_size), rank, world_size, share=False)

    # ~100-byte buckets: five (of six parameters) once DDP rebuilds them after its first step
    ddp = DistributedDataParallel(_mlp(), bucket_cap_mb=1e-4)
    reductions = []
    for step in range(STEPS):
        before = sum(v for (name, _), v in pg.calls.items() if name == "allreduce")
        _train(ddp, _batches(world_size)[step:step + 1], rank, world_size, share=True)
        reductions.append(sum(v for (name, _), v in pg.calls.items() if name == "allreduce") - before)
    assert reductions[-1] >= 4, reductions
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)

    model = _mlp()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, _batches(world_size), rank, world_size, share=True)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor().detach(), q.detach(), rtol=1e-5, atol=1e-6)

    dist.destroy_process_group()
    assert not weft.is_initialized()  # destroying the weft default group finalized weft's world
    return True


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.long)])
def test_weft_backend(world_size, tmp_path):
    assert all(run_ranks(_backend, world_size, os.path.join(tmp_path, "store"), timeout=300))
