"""Runtime: init, the symmetric heap, peer views, barriers, errors."""
import pytest

from weft.testing import run_ranks


def _heap_layout():
    import torch
    import torch.distributed as dist

    import weft

    w = weft.world()
    a = weft.empty((3, 5), torch.float32)
    b = weft.zeros((17,), torch.int8)
    c = weft.empty((2,), torch.bfloat16)
    offsets = [w.heap.offset_of(t) for t in (a, b, c)]
    every = [None] * w.world_size
    dist.all_gather_object(every, offsets, group=w.group)
    assert all(o == offsets for o in every), every  # one offset on every rank
    assert all(o % 256 == 0 for o in offsets)
    assert (b == 0).all() and weft.is_symmetric(a) and not weft.is_symmetric(torch.empty(3))
    a.fill_(float(w.rank))
    weft.barrier()
    for q in range(w.world_size):
        assert (weft.peer(a, q) == q).all()
    weft.barrier()
    return w.heap.descriptor.tolist()[:2]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_heap_is_symmetric_and_peers_are_visible(world):
    assert run_ranks(_heap_layout, world, timeout=240) == [[r, world] for r in range(world)]


def _errors():
    import torch

    import weft

    w = weft.world()
    room = w.heap.size - w.heap.tail_bytes  # the tail: the p2p workspace's, outside the allocator
    left = room - w.heap.used
    with pytest.raises(MemoryError, match=rf"asked for {left + 1} bytes, {left} of {room} left"):
        weft.empty((left + 1,), torch.uint8)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        weft.empty((3,), "float32")
    with pytest.raises(ValueError, match="shape must be non-negative"):
        weft.empty((-1,), torch.float32)
    with pytest.raises(ValueError, match="not allocated from the weft symmetric heap"):
        weft.peer(torch.empty(3), 0)
    with pytest.raises(ValueError, match="rank must be in"):
        weft.peer(weft.empty((3,), torch.float32), w.world_size)
    return True


def test_clear_errors():
    assert all(run_ranks(_errors, 2, timeout=60))


def test_world_of_one_without_launcher(tmp_path):
    import subprocess
    import sys

    code = ("import weft, torch; weft.init(); x = weft.ops.all_gather(torch.arange(5.)); "
            "assert torch.equal(x, torch.arange(5.)); print(weft.rank(), weft.world_size()); weft.finalize()")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "1"]
