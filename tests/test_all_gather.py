"""weft.ops.all_gather on cpu ranks: bit-exact against torch.distributed, every method, odd sizes."""
import pytest

from weft.testing import run_ranks


def _gather(method, shape, dtype_name, symmetric, calls):
    import torch

    import weft
    from weft.testing.reference import all_gather_ref

    dtype = getattr(torch, dtype_name)
    w = weft.world()
    for call in range(calls):
        g = torch.Generator().manual_seed(7919 * call + w.rank)
        x = (torch.randn(shape, generator=g) * 100).to(dtype)
        ref = torch.empty((w.world_size * shape[0], *shape[1:]), dtype=dtype)
        all_gather_ref(ref, x, w.group)
        out = weft.empty(ref.shape, dtype) if symmetric else torch.empty_like(ref)
        out.view(torch.uint8).fill_(0xAB)  # poison: every byte must be written
        got = weft.ops.all_gather(x, out=out, method=method)
        assert got is out
        assert torch.equal(out, ref), (method, shape, dtype, call)
    fresh = weft.ops.all_gather(x, method=method)  # allocates its own output
    assert torch.equal(fresh, ref)
    return True


@pytest.mark.parametrize("world", [2, 4])  # 1 rank: a group of one in test_all_reduce's group layouts test
@pytest.mark.parametrize("method", ["push", "pull", "auto"])
def test_all_gather_methods(world, method):
    assert all(run_ranks(_gather, world, method, (37, 3), "float32", False, 3, timeout=300))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8", "int64"])
@pytest.mark.parametrize("shape", [(1,), (5, 7), (1031,)])
def test_all_gather_dtypes_and_odd_sizes(dtype, shape):
    assert all(run_ranks(_gather, 3, "push", shape, dtype, False, 2, timeout=300))


@pytest.mark.parametrize("world", [2, 8])
def test_all_gather_into_symmetric_output(world):
    assert all(run_ranks(_gather, world, "push", (33,), "float32", True, 3, timeout=300))


def _bad_inputs():
    import torch

    import weft

    w = weft.world()
    x = torch.randn(4, 3)
    out = torch.full((w.world_size * 4, 3), 5.0)
    cases = [
        (TypeError, "x must be a torch.Tensor", lambda: weft.ops.all_gather([1, 2, 3], out=out)),
        (ValueError, "method must be one of", lambda: weft.ops.all_gather(x, out=out, method="ring")),
        (ValueError, "out has shape", lambda: weft.ops.all_gather(x, out=torch.empty(4, 3))),
        (TypeError, "out has dtype", lambda: weft.ops.all_gather(x, out=out.to(torch.float64))),
        (ValueError, "x is on meta", lambda: weft.ops.all_gather(x.to("meta"), out=out)),
        (ValueError, "x must have at least one dimension", lambda: weft.ops.all_gather(torch.tensor(1.0))),
    ]
    for exc, text, call in cases:
        with __import__("pytest").raises(exc, match=text):
            call()
        assert (out == 5.0).all(), f"{text}: output written before the check"
    return True


def test_all_gather_rejects_bad_inputs_before_writing():
    assert all(run_ranks(_bad_inputs, 2, timeout=120))


def _device_barrier(calls):
    import weft

    for _ in range(calls):
        weft.ops.device_barrier()
    return int(weft.world().contexts["device_barrier"].bar[0])


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_device_barrier_counts_epochs(world):
    assert run_ranks(_device_barrier, world, 5, timeout=240) == [5] * world
