"""The hierarchical collectives, ag_gemm, gemm_rs, sp_flash_decode and the Ulysses all-to-all on GPUs over
simulated nodes: the node's kernels inside a node, the rail between nodes, the heap mapped per node; and 1000
consecutive calls of every path across nodes (outputs and memory steady). Run:
`weft run -n 2 --local-world-size 1 -m pytest tests/test_gpu_nodes.py -m gpu` (2 nodes of 1), or `-n 4
--local-world-size 2` (2 nodes of 2), `-n 4 --local-world-size 1` (4 nodes of 1).

The rail is NCCL on the rail's process group by default; with WEFT_RAIL=nvshmem in the environment (read at init)
every test here runs with the rail's exchange as weft's kernel over NVSHMEM instead, and checks that it did (one
more tests that kernel itself at the sizes its chunking turns on; it is skipped on the NCCL route). On
one machine NVSHMEM needs its single-host settings (scripts/gpu_suite.sh's nodes part, docs/nodes.md):
`WEFT_RAIL=nvshmem NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_CUDA_VMM=1
weft run -n 4 --local-world-size 2 -m pytest tests/test_gpu_nodes.py -m gpu`."""
import pytest
import torch
import torch.distributed as dist

import weft
from weft.runtime import settings
from weft.testing.graphs import capture

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world(gpu_world):
    return gpu_world


def _rail_workspaces(world):
    """The kinds of rail-exchange workspace this rank's groups made so far: "nvshmem", "cpu kernel"."""
    from weft.kernels import hierarchical

    kinds = {hierarchical.NvshmemRailWorkspace: "nvshmem", hierarchical.RailWorkspace: "cpu kernel"}
    return {kinds[type(ctx)] for g in world.groups.values() for ctx in g.contexts.values() if type(ctx) in kinds}


def _check_rail_route(world):
    """The rail's route is the one WEFT_RAIL asked for: with nvshmem, the exchanges so far went through weft's
    NVSHMEM kernel (its workspace exists, the NCCL route's does not apply); with nccl no exchange kernel ran."""
    assert world.rail_route == settings.rail()
    assert _rail_workspaces(world) == ({"nvshmem"} if settings.rail() == "nvshmem" else set())


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
    _check_rail_route(world)
    # The per-node heap: this node's peers are mapped, another node's are not.
    far = next(r for r in range(world.world_size) if world.node_ids[r] != world.node_ids[world.rank])
    t = weft.empty((4,), torch.float32)
    with pytest.raises(ValueError, match="not mapped here"):
        weft.peer(t, far)


def test_collectives_across_simulated_nodes_in_a_cuda_graph(world):
    """all_gather and all_reduce across nodes captured in one CUDA graph, replayed on new inputs, against NCCL:
    on the NVSHMEM rail each replay's exchanges take new epochs from device memory."""
    gen = torch.Generator("cuda").manual_seed(41 + world.rank)
    n = 3 * 4096 + 5  # not a multiple of any block
    x = torch.randn(n, generator=gen, device="cuda")
    gathered = torch.empty(world.world_size * n, device="cuda")
    reduced = torch.empty(n, device="cuda")

    def calls():
        weft.ops.all_gather(x, method="push", out=gathered)
        weft.ops.all_reduce(x, method="two_shot", out=reduced)

    calls()  # plans and workspaces outside capture
    graph = capture(calls)
    for _ in range(5):
        x.copy_(torch.randn(n, generator=gen, device="cuda"))
        gathered.fill_(float("nan"))
        reduced.fill_(float("nan"))
        graph.replay()
        want = torch.empty_like(gathered)
        dist.all_gather_into_tensor(want, x)
        assert torch.equal(gathered, want)
        total = x.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(reduced, total, rtol=1e-5, atol=1e-4)
    _check_rail_route(world)


def test_nvshmem_rail_exchange_chunks(world):
    """The NVSHMEM rail's exchange itself, all_gather and all-to-all forms, against NCCL's on the rail, at the
    sizes its chunking turns on (one byte, one chunk, a partial last chunk, the most chunks and then larger
    chunks, two passes) from unaligned offsets too, the sizes changing from call to call (flags of chunks that a
    call leaves out stay behind the epoch)."""
    if world.rail_route != "nvshmem":
        pytest.skip("the NVSHMEM rail's kernel (WEFT_RAIL=nvshmem)")
    from weft.kernels import hierarchical
    from weft.kernels.common import workspace

    rail = hierarchical.hierarchy(world).rail
    ws = workspace(rail, "rail_nvshmem", hierarchical.NvshmemRailWorkspace)
    least = ws.MIN_CHUNK_BYTES
    gen = torch.Generator("cuda").manual_seed(59 + world.rank)
    sizes = (1, 255, least, least + 1, least * ws.max_chunks - 1, 3 * least * ws.max_chunks + 17, 4099,
             ws.slot_bytes + 5)
    for nbytes in sizes:
        for offset in (0, 3):
            for all_to_all in (False, True):
                count = rail.size * nbytes if all_to_all else nbytes
                data = torch.randint(0, 256, (offset + count,), generator=gen, device="cuda", dtype=torch.uint8)
                src = data[offset:]
                got = hierarchical._exchange(rail, src, nbytes, all_to_all)
                want = torch.empty((rail.size, nbytes), dtype=torch.uint8, device="cuda")
                if all_to_all:
                    dist.all_to_all_single(want.view(-1), src.contiguous(), group=rail.process_group)
                else:
                    dist.all_gather_into_tensor(want.view(-1), src.contiguous(), group=rail.process_group)
                assert torch.equal(got, want), (nbytes, offset, all_to_all)
    _check_rail_route(world)


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


def _same_inputs(seed: int):
    """A generator giving the same numbers on every rank (each rank takes its own part of them)."""
    return torch.Generator("cuda").manual_seed(seed)


def _sp_case(gen, size, rank, batch=3, q_heads=8, kv_heads=2, d=128, shard_len=300, dtype=torch.bfloat16):
    """sp_flash_decode's inputs (every member's slices, the same on every rank) and this member's arguments."""
    lens = torch.randint(0, shard_len + 1, (size, batch), generator=gen, device="cuda", dtype=torch.int32)
    lens[0, 0] = 0  # an empty slice
    q = torch.randn((batch, q_heads, d), generator=gen, device="cuda").to(dtype)
    k = torch.randn((size, batch, shard_len, kv_heads, d), generator=gen, device="cuda").to(dtype)
    v = torch.randn((size, batch, shard_len, kv_heads, d), generator=gen, device="cuda").to(dtype)
    return (q, k, v, lens), (q, k[rank], v[rank], lens[rank])


def _sp_reference(q, k, v, lens):
    """float64 attention over each sequence's slices concatenated in member order (tests/test_flash_decode.py's
    reference, on the host)."""
    from test_flash_decode import reference

    q, k, v, lens = q.cpu(), k.cpu(), v.cpu(), lens.cpu()
    size, batch = lens.shape
    total = lens.sum(0)
    kk = torch.zeros((batch, int(total.max()), *k.shape[3:]), dtype=k.dtype)
    vv = torch.zeros_like(kk)
    for b in range(batch):
        at = 0
        for r in range(size):
            n = int(lens[r, b])
            kk[b, at:at + n], vv[b, at:at + n] = k[r, b, :n], v[r, b, :n]
            at += n
    return reference(q, kk, vv, total)[0]


def _hierarchical(world, ops):
    """Whether every plan of `ops` on the world is the hierarchical form."""
    plans = [p for key, p in world.plans.items() if key[0] in ops]
    return bool(plans) and all(getattr(p.run, "__self__", None).__class__.__module__ == "weft.kernels.hierarchical"
                               for p in plans)


def test_attention_ops_across_simulated_nodes(world):
    """sp_flash_decode (contiguous and paged caches, an empty slice) against torch attention, the same bits on every
    member; ulysses_all_to_all (both scatters, packed) bit for bit against torch's reordering of every member's
    data; both across nodes: the node's kernels, NCCL on the rail."""
    from test_flash_decode import TOL

    size, rank = world.world_size, world.rank
    gen = _same_inputs(29)
    for step, (batch, shard_len) in enumerate(((3, 300), (5, 77))):
        (q, k, v, lens), (mq, mk, mv, mlens) = _sp_case(gen, size, rank, batch=batch, shard_len=shard_len)
        if step % 2:  # a paged cache: pages of 16 positions in a shuffled pool
            page, kv_heads, d = 16, k.shape[3], k.shape[4]
            pages = -(-shard_len // page)
            pad = torch.zeros((batch, pages * page - shard_len, kv_heads, d), dtype=k.dtype, device="cuda")
            order = torch.randperm(batch * pages, generator=gen, device="cuda")
            table = order.view(batch, pages).to(torch.int32)
            pool_k, pool_v = (torch.empty((batch * pages, page, kv_heads, d), dtype=k.dtype, device="cuda")
                              for _ in range(2))
            pool_k[order] = torch.cat([mk, pad], 1).reshape(batch * pages, page, kv_heads, d)
            pool_v[order] = torch.cat([mv, pad], 1).reshape(batch * pages, page, kv_heads, d)
            got = weft.ops.sp_flash_decode(mq, pool_k, pool_v, mlens, block_table=table)
        else:
            got = weft.ops.sp_flash_decode(mq, mk, mv, mlens)
        torch.testing.assert_close(got.cpu().double(), _sp_reference(q, k, v, lens), **TOL[torch.bfloat16])
        every = [torch.empty_like(got) for _ in range(size)]
        dist.all_gather(every, got)
        assert all(torch.equal(e, got) for e in every), "members disagree"

    heads, head_dim = 4 * size, 64
    hl = heads // size
    for seq in (1, 37, 512):
        xs = torch.randn((size, seq, heads, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
        got = weft.ops.ulysses_all_to_all(xs[rank])
        assert torch.equal(got, torch.cat([xs[r][:, rank * hl:(rank + 1) * hl] for r in range(size)])), seq
        ys = torch.randn((size, size * seq, hl, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
        got = weft.ops.ulysses_all_to_all(ys[rank], "seq")
        assert torch.equal(got, torch.cat([ys[r][rank * seq:(rank + 1) * seq] for r in range(size)], dim=1)), seq
        packed = torch.randn((size, seq, 3, heads, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
        there = weft.ops.ulysses_all_to_all(packed[rank], packed=True)
        assert torch.equal(there, torch.cat([packed[r][:, :, rank * hl:(rank + 1) * hl] for r in range(size)]))
        assert torch.equal(weft.ops.ulysses_all_to_all(there, "seq", packed=True), packed[rank])
    assert _hierarchical(world, ("sp_flash_decode", "ulysses_all_to_all"))


CALLS = 1000  # consecutive calls of each path
CHECK_EVERY = 100  # every this many, the output against the torch reference too


def test_every_path_across_nodes_1000_calls(world):
    """1000 consecutive calls of every path across nodes on fixed inputs: each output bit for bit the first call's,
    every 100th against the torch reference, and memory constant (device memory allocated, every group's heap)."""
    size, rank = world.world_size, world.rank
    gen = _same_inputs(31)
    tol = dict(rtol=2e-2, atol=5e-2)
    x = torch.randn((1 << 18) + 5, generator=gen, device="cuda").to(torch.bfloat16)  # not a multiple of any block
    xs = torch.randn((size, (1 << 16) + 3), generator=gen, device="cuda").to(torch.bfloat16)
    every_x = torch.randn((size, *x.shape), generator=gen, device="cuda").to(torch.bfloat16)
    mine_x = every_x[rank].contiguous()
    block = 1024 + 7  # reduce_scatter's output per member
    rs_in = mine_x[:size * block]
    m, k, n = 512, 256, 384
    shards = torch.randn((size, m, k), generator=gen, device="cuda").to(torch.bfloat16)
    b = (torch.randn((k, n), generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
    parts = torch.randn((size, size * m, k), generator=gen, device="cuda").to(torch.bfloat16)
    b_shards = (torch.randn((size, k, n), generator=gen, device="cuda") / (k * size) ** 0.5).to(torch.bfloat16)
    sp_all, (sq, sk, sv, slens) = _sp_case(gen, size, rank)
    heads, head_dim, seq = 4 * size, 64, 129
    hl = heads // size
    a2a = torch.randn((size, seq, heads, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
    ag_out = torch.empty((size * m, n), dtype=torch.bfloat16, device="cuda")
    rs_out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")

    partials = [parts[q].float() @ b_shards[q].float() for q in range(size)]
    partial_sum = sum(partials)
    # gemm_rs rounds each member's partial to bf16 before the sum: a few of their ulps (test_gemm_ops_across_...).
    rs_tol = dict(rtol=2e-2, atol=size * max(p.abs().max() for p in partials).item() * 2.0 ** -8)
    paths = {  # name: (the call, the torch reference, whether the reference is exact)
        "all_reduce": (lambda: weft.ops.all_reduce(mine_x, method="two_shot"), every_x.float().sum(0), False),
        "all_gather": (lambda: weft.ops.all_gather(xs[rank], method="push"), xs.reshape(-1), True),
        "reduce_scatter": (lambda: weft.ops.reduce_scatter(rs_in, method="two_shot"),
                           every_x[:, :size * block].float().sum(0)[rank * block:(rank + 1) * block], False),
        "ag_gemm": (lambda: weft.ops.ag_gemm(shards[rank], b, method="overlap", out=ag_out),
                    shards.reshape(-1, k).float() @ b.float(), False),
        "gemm_rs": (lambda: weft.ops.gemm_rs(parts[rank], b_shards[rank], method="overlap", out=rs_out),
                    partial_sum[rank * m:(rank + 1) * m], False),
        "sp_flash_decode": (lambda: weft.ops.sp_flash_decode(sq, sk, sv, slens), _sp_reference(*sp_all), False),
        "ulysses_all_to_all": (lambda: weft.ops.ulysses_all_to_all(a2a[rank]),
                               torch.cat([a2a[r][:, rank * hl:(rank + 1) * hl] for r in range(size)]), True),
    }
    heaps = lambda: {g.name: g.heap.used for g in world.groups.values() if g._heap is not None}  # noqa: E731
    for name, (call, ref, exact) in paths.items():
        first = call().clone()
        mismatches = torch.zeros((), dtype=torch.int32, device="cuda")
        for i in range(1, CALLS + 1):
            got = call()
            mismatches += (got.view(torch.uint8) != first.view(torch.uint8)).any().int()  # no host sync per call
            if i % CHECK_EVERY == 0:
                if exact:
                    assert torch.equal(got, ref), (name, i)
                elif name == "sp_flash_decode":
                    torch.testing.assert_close(got.cpu().double(), ref, rtol=2e-2, atol=2e-2, msg=f"{name} call {i}")
                else:
                    torch.testing.assert_close(got.float(), ref.float(), **(rs_tol if name == "gemm_rs" else tol),
                                               msg=f"{name} call {i}")
                if i == CHECK_EVERY:  # warm: every plan, workspace and cached block is there
                    torch.cuda.synchronize()
                    allocated, heap_used = torch.cuda.memory_allocated(), heaps()
        torch.cuda.synchronize()
        assert mismatches.item() == 0, f"{name}: {mismatches.item()} of {CALLS} calls differ from the first"
        assert torch.cuda.memory_allocated() == allocated, (name, allocated, torch.cuda.memory_allocated())
        assert heaps() == heap_used, name
    ops = ("all_reduce", "all_gather", "reduce_scatter", "ag_gemm", "gemm_rs", "sp_flash_decode",
           "ulysses_all_to_all")
    assert all(_hierarchical(world, (op,)) for op in ops)
    _check_rail_route(world)
