"""weft: kernels that overlap computation with communication across GPUs, in stock Triton.

    import weft
    weft.init()
    x = weft.empty((n,), torch.float32)   # symmetric: same offset on every rank
    y = weft.ops.all_gather(x)
"""
from .runtime import backend as _backend  # first: sets TRITON_INTERPRET on the cpu backend
from .runtime import world as _world
from .runtime.errors import SignatureMismatch, WaitTimeout, check_errors
from .runtime.group import Group
from .runtime.world import finalize, init, is_initialized, new_group, new_subgroups

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


def get_group(group=None) -> Group:
    """The weft Group that an op's `group=` argument names: None (the world), a Group, a torch.distributed
    ProcessGroup this rank belongs to (its Group made on first use), or a group's name."""
    return _world.resolve(group)


def barrier(group=None) -> None:
    """Host barrier across the group's ranks (default: the world); device work queued before it is finished."""
    _world.resolve(group).barrier()


def empty(shape, dtype=torch.float32, group=None) -> torch.Tensor:
    """A tensor in the group's symmetric heap (default: the world's): the same offset on every member.
    Collective: every member makes the same calls in the same order."""
    return _world.resolve(group).heap.empty(shape, dtype)


def zeros(shape, dtype=torch.float32, group=None) -> torch.Tensor:
    t = empty(shape, dtype, group)
    t.zero_()
    return t


def peer(tensor: torch.Tensor, rank: int, group=None) -> torch.Tensor:
    """Host-side view of group rank `rank`'s copy of the symmetric `tensor` (allocated in that group's heap)."""
    return _world.resolve(group).heap.peer(tensor, rank)


def is_symmetric(tensor: torch.Tensor, group=None) -> bool:
    return _world.resolve(group).heap.contains(tensor)


from . import ops  # noqa: E402  (ops import kernels, which need the backend set)
from . import distributed  # noqa: E402  (registers the "weft" torch.distributed backend)

distributed.register()

__all__ = ["init", "finalize", "is_initialized", "check_errors", "WaitTimeout", "SignatureMismatch", "rank", "world_size", "device",
           "Group", "new_group", "new_subgroups", "get_group", "barrier", "empty", "zeros", "peer", "is_symmetric", "ops", "distributed", "world", "BACKEND"]
