"""weft: kernels that overlap computation with communication across GPUs, in stock Triton.

    import weft
    weft.init()
    x = weft.empty((n,), torch.float32)   # symmetric: same offset on every rank
    y = weft.ops.all_gather(x)

`weft.ops` is imported here; `weft.layers`, `weft.models`, `weft.testing`, `weft.tuning` and `weft.bench` on
first use (`weft.models.from_hf(...)` works after a bare `import weft`).
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

from .runtime import backend as _backend  # first: sets TRITON_INTERPRET on the cpu backend
from .runtime import world as _world
from .runtime.errors import OffNodeAccess, SignatureMismatch, WaitTimeout, check_errors
from .runtime.group import Group, GroupLike
from .runtime.world import World, finalize, init, is_initialized, new_group, new_subgroups

import torch

__version__ = "0.1.0"
BACKEND = _backend.BACKEND


def world() -> World:
    """The world weft.init() made: rank, world_size, device, heap, the torch process group."""
    return _world.get()


def rank() -> int:
    """This process's rank in the world."""
    return _world.get().rank


def world_size() -> int:
    """The number of ranks in the world."""
    return _world.get().world_size


def device() -> torch.device:
    """This rank's device (its GPU, or the cpu on the cpu backend)."""
    return _world.get().device


def get_group(group: GroupLike = None) -> Group:
    """The weft Group that an op's `group=` argument names: None (the world), a Group, a torch.distributed
    ProcessGroup this rank belongs to (its Group made on first use), or a group's name."""
    return _world.resolve(group)


def barrier(group: GroupLike = None) -> None:
    """Host barrier across the group's ranks (default: the world); device work queued before it is finished."""
    _world.resolve(group).barrier()


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32,
          group: GroupLike = None) -> torch.Tensor:
    """A tensor in the group's symmetric heap (default: the world's): the same offset on every member.
    Collective: every member makes the same calls in the same order."""
    return _world.resolve(group).heap.empty(shape, dtype)


def zeros(shape: int | Sequence[int], dtype: torch.dtype = torch.float32,
          group: GroupLike = None) -> torch.Tensor:
    """weft.empty, zero-filled (on this rank: the others fill their own copies)."""
    t = empty(shape, dtype, group)
    t.zero_()
    return t


def peer(tensor: torch.Tensor, rank: int, group: GroupLike = None) -> torch.Tensor:
    """Host-side view of group rank `rank`'s copy of the symmetric `tensor` (allocated in that group's heap)."""
    return _world.resolve(group).heap.peer(tensor, rank)


def is_symmetric(tensor: torch.Tensor, group: GroupLike = None) -> bool:
    """Whether `tensor` lies in the group's symmetric heap (default: the world's)."""
    return _world.resolve(group).heap.contains(tensor)


from . import ops  # noqa: E402  (ops import kernels, which need the backend set)
from . import distributed  # noqa: E402  (registers the "weft" torch.distributed backend)

distributed.register()

# Imported on first use: the layers and models pull in more than the ops need, the bench suites more still.
_LAZY = ("layers", "models", "testing", "tuning", "bench")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)  # the import binds it here: called once per name
    raise AttributeError(f"module 'weft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = ["init", "finalize", "is_initialized", "check_errors", "WaitTimeout", "SignatureMismatch", "OffNodeAccess",
           "rank", "world_size", "device", "Group", "GroupLike", "new_group", "new_subgroups", "get_group", "barrier",
           "empty", "zeros", "peer", "is_symmetric", "ops", "distributed", "world", "BACKEND"]
