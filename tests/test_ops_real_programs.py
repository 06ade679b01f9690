"""Every op as real programs call it: eagerly, on plain tensors of any layout, with sizes that change from
call to call; bounded memory (no allocation and no host barrier once the workspaces exist); messages larger
than the workspace; bad input caught on the cached path; a missing peer named by the wait timeout; and
finalize / init again in one process.

Shapes are drawn at random per test from a seed that every rank shares (printed in each assertion), so every
rank builds every rank's inputs and checks its result against a torch reference on its own.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 300
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def _layout(t, kind):
    """t (2-D) in the layout `kind`: contiguous, transposed storage, or a strided column view."""
    import torch

    if kind == "transposed":
        return t.t().contiguous().t()
    if kind == "strided":
        wide = torch.empty(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
        wide[:, ::2] = t
        return wide[:, ::2]
    return t


def _one_round(seed, w, me):
    """One call of every op on shapes drawn from `seed`; returns the description of each call."""
    import random

    import torch

    import weft

    rng = random.Random(seed)
    done = []

    def gen(i, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 1000 + i)).to(dtype)

    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "gemm_ar", "ag_gemm", "gemm_rs"):
        dtype_name = rng.choice(["float32", "bfloat16", "float16"])
        dtype = getattr(torch, dtype_name)
        kind = rng.choice(["contiguous", "transposed", "strided"])
        rows, cols = rng.choice([0, 1, 3, 7, 16, 33]), rng.choice([1, 5, 8, 13, 24])
        what = f"seed {seed}: {op} {dtype_name} {kind} rows={rows} cols={cols}"
        tol = TOL[dtype_name]
        if op == "all_reduce":
            xs = [gen(r, rows, cols, dtype=dtype) for r in range(w)]
            ref = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
            out = _layout(torch.full((rows, cols), float("nan"), dtype=dtype), rng.choice(["contiguous", "strided"]))
            got = weft.ops.all_reduce(_layout(xs[me], kind), out=out)
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
        elif op == "all_gather":
            xs = [gen(r, rows, cols, dtype=dtype) for r in range(w)]
            got = weft.ops.all_gather(_layout(xs[me], kind))
            assert torch.equal(got, torch.cat(xs)), what
        elif op == "reduce_scatter":
            xs = [gen(r, w * rows, cols, dtype=dtype) for r in range(w)]
            ref = torch.stack([x.float() for x in xs]).sum(0).to(dtype)[me * rows:(me + 1) * rows]
            got = weft.ops.reduce_scatter(_layout(xs[me], kind))
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
        elif op == "broadcast":
            root = rng.randrange(w)
            want = gen(99, rows, cols, dtype=dtype)
            x = _layout(want.clone() if me == root else torch.full((rows, cols), float("nan"), dtype=dtype), kind)
            assert torch.equal(weft.ops.broadcast(x, root=root), want), what
        else:
            m, k, n = rng.choice([1, 3, 8, 16]), rng.choice([0, 8, 12, 16, 24]), rng.choice([8, 12, 16, 24])
            what += f" m={m} k={k} n={n}"
            g = torch.Generator().manual_seed(seed * 7 + 1)
            if op == "gemm_ar":
                As = [torch.randn(m, k, generator=g).to(dtype) for _ in range(w)]
                Bs = [torch.randn(k, n, generator=g).to(dtype) for _ in range(w)]
                ref = sum(a.float() @ b.float() for a, b in zip(As, Bs))
                got = weft.ops.gemm_ar(_layout(As[me], kind), _layout(Bs[me], kind)).float()
            elif op == "ag_gemm":
                As = [torch.randn(m, k, generator=g).to(dtype) for _ in range(w)]
                b = torch.randn(k, n, generator=g).to(dtype)
                ref = torch.cat(As).float() @ b.float()
                got = weft.ops.ag_gemm(_layout(As[me], kind), _layout(b, kind)).float()
            else:
                As = [torch.randn(w * m, k, generator=g).to(dtype) for _ in range(w)]
                Bs = [torch.randn(k, n, generator=g).to(dtype) for _ in range(w)]
                ref = sum((a.float() @ b.float()) for a, b in zip(As, Bs))[me * m:(me + 1) * m]
                got = weft.ops.gemm_rs(_layout(As[me], kind), _layout(Bs[me], kind)).float()
            scale = max(1.0, ref.abs().max().item())
            torch.testing.assert_close(got, ref, rtol=5 * tol, atol=5 * tol * scale, msg=lambda s: f"{what}: {s}")
        done.append(what)
    return done


def _warm_up():
    """One call of every op family by its weft path: each family's workspace is made (collectively)."""
    import torch

    import weft

    w = weft.world_size()
    x = torch.ones(64)
    for method in ("one_shot", "two_shot"):
        weft.ops.all_reduce(x, method=method)
    for method in ("push", "pull"):
        weft.ops.all_gather(x, method=method)
    weft.ops.device_barrier()
    weft.ops.gemm_ar(torch.ones(1, 8), torch.ones(8, 8), method="fused")
    weft.ops.ag_gemm(torch.ones(4, 8), torch.ones(8, 8), method="overlap")
    weft.ops.gemm_rs(torch.ones(4 * w, 8), torch.ones(8, 8), method="overlap")


def _keeps_only_heap_memory(world) -> None:
    """Between calls weft holds no tensor but symmetric-heap memory: no caller's tensor, no allocation of torch's
    (a first call under CUDA-graph trees would leave it in their pool, which must hold outputs only)."""
    from weft.testing.checks import kept_tensors

    kept = kept_tensors(world)
    assert not kept, f"plans or workspaces keep tensors outside the heap: {[tuple(t.shape) for t in kept]}"


def _changing_sizes(seeds):
    """Round after round of every op at new random shapes: once every family's workspace exists, nothing is
    allocated from the heap and no host barrier is made; nothing is kept outside the heap."""
    import weft

    world = weft.world()
    me, w = weft.rank(), weft.world_size()
    _warm_up()
    used, barriers = world.heap.used, world.barriers
    for seed in seeds:
        _one_round(seed, w, me)
        assert (world.heap.used, world.barriers) == (used, barriers), (
            f"seed {seed}: heap {used} -> {world.heap.used} bytes, barriers {barriers} -> {world.barriers}")
    _keeps_only_heap_memory(world)
    return used


@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_every_op_on_random_shapes_and_layouts_with_bounded_memory(w):
    used = run_ranks(_changing_sizes, w, [11 * w, 11 * w + 1, 11 * w + 2], timeout=TIMEOUT, env=ENV)
    assert len(set(used)) == 1  # the same heap layout on every rank


def _larger_than_the_workspace():
    """With 64 KiB workspaces every message below goes through in several passes."""
    import torch

    import weft

    me, w = weft.rank(), weft.world_size()
    assert weft.world().workspace_bytes == 64 << 10
    for method in ("one_shot", "two_shot"):
        xs = [torch.randn(30011, generator=torch.Generator().manual_seed(r)) for r in range(w)]
        got = weft.ops.all_reduce(xs[me], method=method)
        torch.testing.assert_close(got, torch.stack(xs).sum(0), rtol=1e-5, atol=1e-5)
    symm = weft.empty((30011,), torch.float32).copy_(xs[me])
    weft.ops.all_reduce(symm, method="two_shot", out=symm)
    torch.testing.assert_close(symm, torch.stack(xs).sum(0), rtol=1e-5, atol=1e-5)
    for method in ("push", "pull"):
        parts = [torch.randn(9001, 3, generator=torch.Generator().manual_seed(50 + r)) for r in range(w)]
        assert torch.equal(weft.ops.all_gather(parts[me], method=method), torch.cat(parts)), method
    out = weft.empty((w * 9001, 3), torch.float32)
    assert torch.equal(weft.ops.all_gather(parts[me], out=out, method="push"), torch.cat(parts))
    big = [torch.randn(w * 7001, 5, generator=torch.Generator().manual_seed(80 + r)) for r in range(w)]
    torch.testing.assert_close(weft.ops.reduce_scatter(big[me]), torch.stack(big).sum(0)[me * 7001:(me + 1) * 7001],
                               rtol=1e-5, atol=1e-5)
    want = torch.arange(40000, dtype=torch.int16)
    b = want.clone() if me == w - 1 else torch.zeros(40000, dtype=torch.int16)
    assert torch.equal(weft.ops.broadcast(b, root=w - 1), want)
    _keeps_only_heap_memory(weft.world())
    return weft.world().heap.used


@pytest.mark.parametrize("w", [2, pytest.param(3, marks=pytest.mark.long)])
def test_messages_larger_than_the_workspace(w):
    env = dict(ENV, WEFT_WORKSPACE_BYTES="64K")
    used = run_ranks(_larger_than_the_workspace, w, timeout=TIMEOUT, env=env)
    assert max(used) < 1 << 20  # three families' workspaces and the symmetric tensors, nothing per size


def _cached_path_rejects_bad_input():
    import torch

    import weft
    from weft.testing.checks import rejects

    w = weft.world_size()
    x, out = torch.randn(10), torch.full((10,), float("nan"))
    weft.ops.all_reduce(x, out=out)  # the plan for this signature now exists
    weft.ops.all_gather(x)
    weft.ops.gemm_rs(torch.randn(2 * w, 8), torch.randn(8, 8))
    g = [x, out]
    rejects(lambda: weft.ops.all_reduce(x.to(torch.int32), out=out), TypeError, "x", g)  # wrong dtype
    rejects(lambda: weft.ops.all_reduce(x.to("meta"), out=out), ValueError, "x is on meta", g)  # wrong device
    rejects(lambda: weft.ops.all_reduce(torch.randn(11), out=out), ValueError, "out has shape", g)  # changed shape
    rejects(lambda: weft.ops.all_reduce(x, out=out.half()), TypeError, "out has dtype", g)
    shared = torch.randn(12)
    rejects(lambda: weft.ops.all_reduce(shared[:10], out=shared[2:]), ValueError, "overlaps", g + [shared])
    rejects(lambda: weft.ops.all_gather(x, out=torch.full((w * 10 + 1,), 0.0)), ValueError, "out has shape", g)
    if w > 1:  # rows that do not divide by the world size
        rejects(lambda: weft.ops.gemm_rs(torch.randn(2 * w + 1, 8), torch.randn(8, 8)), ValueError, "group size", g)
        rejects(lambda: weft.ops.reduce_scatter(torch.randn(w + 1, 2)), ValueError, "group size", g)
    rejects(lambda: weft.ops.gemm_rs(torch.randn(2 * w, 8), torch.randn(9, 8)), ValueError, "b_shard", g)
    return True


@pytest.mark.parametrize("w", [1, 2])
def test_cached_path_still_rejects_bad_input(w):
    assert all(run_ranks(_cached_path_rejects_bad_input, w, timeout=TIMEOUT, env=ENV))


def _missing_peer(method):
    """Rank 1 never calls: rank 0's wait gives up and says who it is, in which op, and whom it waits for."""
    import time

    import torch

    import weft

    weft.ops.all_reduce(torch.ones(256), method=method)  # both: the workspace exists (its creation is collective)
    if weft.rank() == 1:
        time.sleep(6)
        return "absent"
    try:
        weft.ops.all_reduce(torch.ones(256), method=method)
    except weft.WaitTimeout as e:
        return str(e)
    return "no timeout"


@pytest.mark.parametrize("method", ["one_shot", "two_shot"])
def test_a_missing_peer_is_named_by_the_wait_timeout(method):
    msg, absent = run_ranks(_missing_peer, 2, method, timeout=TIMEOUT, env={"WEFT_WAIT_TIMEOUT_S": "2"})
    assert absent == "absent"
    assert "rank 0" in msg and "all_reduce" in msg and "rank 1" in msg and "expected" in msg and "seen" in msg, msg


def _init_again():
    import torch

    import weft

    for _ in range(2):
        w = weft.world_size()
        x = torch.full((1000,), float(weft.rank() + 1))
        assert torch.equal(weft.ops.all_reduce(x), torch.full((1000,), w * (w + 1) / 2))
        weft.finalize()
        assert not weft.is_initialized()
        weft.init()
    return weft.world().heap.used


def test_finalize_and_init_again_in_one_process():
    assert run_ranks(_init_again, 2, timeout=TIMEOUT, env=ENV) == [0, 0]  # a fresh heap, no workspaces yet



def _nccl_paths():
    """method="nccl": the process group's own collective (gloo here), with weft's output and layout handling."""
    import torch

    import weft

    me, w = weft.rank(), weft.world_size()
    xs = [torch.randn(6, 5, generator=torch.Generator().manual_seed(r)) for r in range(w)]
    total = torch.stack(xs).sum(0)
    torch.testing.assert_close(weft.ops.all_reduce(xs[me], method="nccl"), total)
    out = torch.full((6, 10), float("nan"))[:, ::2]
    torch.testing.assert_close(weft.ops.all_reduce(xs[me].t().contiguous().t(), method="nccl", out=out), total)
    x = xs[me].clone()
    assert weft.ops.all_reduce(x, method="nccl", out=x) is x and torch.allclose(x, total)
    assert torch.equal(weft.ops.all_gather(xs[me][:, 1:], method="nccl"), torch.cat([t[:, 1:] for t in xs]))
    rows = [torch.randn(w * 3, 4, generator=torch.Generator().manual_seed(10 + r)) for r in range(w)]
    want = torch.stack(rows).sum(0)[me * 3:(me + 1) * 3]
    torch.testing.assert_close(weft.ops.reduce_scatter(rows[me], method="nccl"), want)
    inplace = rows[me].clone()
    got = weft.ops.reduce_scatter(inplace, method="nccl", out=inplace[me * 3:(me + 1) * 3])
    torch.testing.assert_close(got, want)
    return True


@pytest.mark.parametrize("w", [1, 3])
def test_the_nccl_method_through_weft(w):
    assert all(run_ranks(_nccl_paths, w, timeout=TIMEOUT, env=ENV))
