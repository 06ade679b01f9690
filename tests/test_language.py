"""Device primitives on the cpu backend (interpreter), at 1, 2, 4 and 8 ranks."""
import pytest

from weft.testing import RankFailure, run_ranks

WORLD_SIZES = [1, 2, 4, 8]


def _ring(n, epochs):
    import torch

    import weft
    from primitive_kernels import ring_kernel

    r, w = weft.rank(), weft.world_size()
    block = 64
    data = weft.zeros((2 * block,), torch.int32)
    flags = weft.zeros((2,), torch.int32)
    acks = weft.zeros((2,), torch.int32)
    weft.barrier()
    prev = (r - 1) % w
    for epoch in range(1, epochs + 1):
        out = torch.full((block,), -1, dtype=torch.int32)
        ring_kernel[(1,)](data, flags, acks, out, weft.world().heap.descriptor, n, epoch, BLOCK=block)
        expect = prev * 100000 + epoch * 1000 + torch.arange(n, dtype=torch.int32)
        assert torch.equal(out[:n], expect), (epoch, out[:n], expect)
        assert (out[n:] == -1).all()
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_of_producers_and_consumers(world):
    assert all(run_ranks(_ring, world, 37, 6, timeout=240))


def _exchange(epochs):
    import torch

    import weft
    from primitive_kernels import exchange_kernel

    w = weft.world_size()
    table = weft.zeros((w,), torch.int32)
    bar = weft.zeros((1 + w,), torch.int32)
    weft.barrier()
    for epoch in range(1, epochs + 1):
        out = torch.full((w,), -1, dtype=torch.int32)
        exchange_kernel[(1,)](table, bar, out, weft.world().heap.descriptor, epoch)
        assert torch.equal(out, epoch * 10 + torch.arange(w, dtype=torch.int32)), (epoch, out)
    assert int(bar[0]) == 2 * epochs  # the barrier's epoch word counted every use, never reset
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_barrier_all_many_epochs_without_reset(world):
    assert all(run_ranks(_exchange, world, 8, timeout=240))


def _fan_in(per_rank, epochs):
    import torch

    import weft
    from primitive_kernels import fan_in_kernel

    w = weft.world_size()
    total = w * per_rank
    flags = weft.zeros((total,), torch.int32)
    table = weft.zeros((total,), torch.int32)
    weft.barrier()
    for epoch in range(1, epochs + 1):
        out = torch.full((total,), -1, dtype=torch.int32)
        fan_in_kernel[(1,)](flags, table, out, weft.world().heap.descriptor, per_rank, epoch)
        assert torch.equal(out, epoch * 1000 + torch.arange(total, dtype=torch.int32)), (epoch, out)
        weft.ops.device_barrier()  # nobody writes parity e % 2 again before everyone read it
    return True


@pytest.mark.parametrize("world", [1, 4])
def test_notify_all_and_wait_on_many_flags(world):
    assert all(run_ranks(_fan_in, world, 9, 3, timeout=240))


def _put_signal(mode, nbytes, epochs):
    import torch

    import weft
    from primitive_kernels import put_signal_kernel

    r, w = weft.rank(), weft.world_size()
    dst = weft.zeros((nbytes,), torch.uint8)
    sig = weft.zeros((2 + w,), torch.int32)
    weft.barrier()
    prev = (r - 1) % w
    for epoch in range(1, epochs + 1):
        g = torch.Generator().manual_seed(1000 * epoch + r)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        expect = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(1000 * epoch + prev))
        out = torch.full((nbytes + 8,), 7, dtype=torch.uint8)
        put_signal_kernel[(1,)](dst, src, sig, out, weft.world().heap.descriptor, nbytes, epoch, MODE=mode)
        assert torch.equal(out[:nbytes], expect), (mode, epoch)
        assert (out[nbytes:] == 7).all(), "getmem wrote past nbytes"
    return True


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["putmem_signal_block", "putmem_block+signal_add", "nbi+quiet"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_putmem_signal_getmem(world, mode):
    assert all(run_ranks(_put_signal, world, mode, 1501, 4, timeout=240))


@pytest.mark.parametrize("nbytes", [0, 5, 64, 64 * 3 + 17])
def test_copy_bytes_whole_blocks_and_tail(nbytes):
    """copy_bytes at BLOCK 64: nothing, a tail alone, one whole block, whole blocks and a tail; a float32 source
    (its pointer taken as bytes), nothing written past nbytes."""
    import torch

    from primitive_kernels import copy_bytes_kernel

    src = torch.randn(64, dtype=torch.float32)
    dst = torch.full((256,), 7, dtype=torch.uint8)
    copy_bytes_kernel[(1,)](dst, src, nbytes, BLOCK=64)
    assert torch.equal(dst[:nbytes], src.view(torch.uint8)[:nbytes])
    assert (dst[nbytes:] == 7).all(), "copy_bytes wrote past nbytes"


def _cmp_and_hardware():
    import torch

    import weft
    from primitive_kernels import cmp_kernel, hardware_kernel

    heap = weft.world().heap.descriptor
    flag = weft.empty((1,), torch.int32)
    flag.fill_(41)
    out = torch.full((6,), -1, dtype=torch.int32)
    cmp_kernel[(1,)](flag, out, heap, 41)
    assert (out == 41).all(), out
    hw = torch.full((6,), -1, dtype=torch.int32)
    hardware_kernel[(1,)](hw, heap)
    assert hw.tolist() == [0, 0, 0, weft.rank(), weft.world_size(), 1], hw
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_wait_comparisons_and_hardware(world):
    assert all(run_ranks(_cmp_and_hardware, world, timeout=120))


def _timeout(kernel_name, numel, dtype_name):
    """Rank 1 runs a kernel that waits for what nobody sends; returns the error it raised."""
    import torch

    import primitive_kernels
    import weft

    flags = weft.zeros((numel,), getattr(torch, dtype_name))
    weft.barrier()
    try:
        getattr(primitive_kernels, kernel_name)[(1,)](flags, weft.world().heap.descriptor)
    except weft.WaitTimeout as e:  # itself, not Triton's InterpreterError around it
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("kernel, numel, dtype, parts", [
    ("never_signalled_kernel", 1, "int32", ("flag 0 of 1", "expected flag == 1", "seen 0")),
    ("never_arriving_ll_kernel", 8, "int64", ("LL words of", "word 0 of a block", "expected epoch 1", "seen 0")),
    ("never_flagged_program_kernel", 6, "int32", ("signal of rank 0 (flag 2 of 6", "expected flag == 1", "seen 0")),
])
def test_wait_timeout_names_rank_and_flag(kernel, numel, dtype, parts):
    msgs = run_ranks(_timeout, 2, kernel, numel, dtype, timeout=60, env={"WEFT_WAIT_TIMEOUT_S": "1"})
    assert msgs[0] is None
    assert msgs[1] is not None and "WaitTimeout" in msgs[1]
    for part in ("rank 1",) + parts:
        assert part in msgs[1], msgs[1]


def _raise_on_rank_one():
    import weft

    if weft.rank() == 1:
        raise ValueError("boom from rank one")
    weft.barrier()  # rank 0 would wait here forever if the failure were not propagated


def test_failing_rank_is_reported_not_hung():
    with pytest.raises(RankFailure, match="rank 1 of 2 failed(.|\n)*boom from rank one"):
        run_ranks(_raise_on_rank_one, 2, timeout=60)
