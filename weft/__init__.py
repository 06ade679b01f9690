"""weft: kernels that overlap computation with communication across GPUs, in stock Triton.

    import weft
    weft.init()
    x = weft.empty((n,), torch.float32)   # symmetric: same offset on every rank
    y = weft.ops.all_gather(x)
"""
from .runtime import backend as _backend  # first: sets TRITON_INTERPRET on the cpu backend
from .runtime import world as _world
from .runtime.errors import WaitTimeout, check_errors
from .runtime.world import finalize, init, is_initialized

import torch

__version__ = "0.1.0"
BACKEND = _backend.BACKEND


def world():
    return _world.get()


def rank() -> int:
    return _world.get().rank


def world_size() -> int:
    return _world.get().world_size


def device() -> torch.device:
    return _world.get().device


def barrier() -> None:
    """Host barrier across all ranks (device work queued before it is finished)."""
    _world.get().barrier()


def empty(shape, dtype=torch.float32) -> torch.Tensor:
    """A tensor in the symmetric heap. Collective: every rank makes the same calls in the same order."""
    return _world.get().heap.empty(shape, dtype)


def zeros(shape, dtype=torch.float32) -> torch.Tensor:
    t = empty(shape, dtype)
    t.zero_()
    return t


def peer(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Host-side view of rank `rank`'s copy of the symmetric `tensor`."""
    return _world.get().heap.peer(tensor, rank)


def is_symmetric(tensor: torch.Tensor) -> bool:
    return _world.get().heap.contains(tensor)


from . import ops  # noqa: E402  (ops import kernels, which need the backend set)

__all__ = ["init", "finalize", "is_initialized", "check_errors", "WaitTimeout", "rank", "world_size", "device",
           "barrier", "empty", "zeros", "peer", "is_symmetric", "ops", "world", "BACKEND"]
