"""GPU: weft.finalize() then weft.init() in one process gives a working world (its own heap and workspaces).
Its own file, run after the others: it ends the world the other GPU tests share.

A hang here (it used to hang: the second process group read the first one's NCCL id from torchrun's store)
must fail, not block the suite: past TIMEOUT_S every thread's stack is printed and the process exits."""
import faulthandler

import pytest
import torch

import weft

pytestmark = pytest.mark.gpu
TIMEOUT_S = 120


def test_finalize_and_init_again():
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    try:
        for _ in range(3):
            weft.init()
            w = weft.world()
            x = torch.full((4096,), float(w.rank + 1), device=w.device)
            n = w.world_size
            assert torch.equal(weft.ops.all_reduce(x), torch.full_like(x, n * (n + 1) / 2))
            assert torch.equal(weft.ops.all_gather(x[:5]), torch.arange(1, n + 1, device=w.device,
                                                                         dtype=x.dtype).repeat_interleave(5))
            weft.finalize()
            assert not weft.is_initialized()
    finally:
        faulthandler.cancel_dump_traceback_later()
