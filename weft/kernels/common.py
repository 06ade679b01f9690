"""Host-side helpers shared by the ops: argument checks and launch sizing."""
from __future__ import annotations

import torch

from ..runtime import world as _world


def check_tensor(name: str, t, world, dtypes=None, contiguous=True) -> None:
    """Raise TypeError/ValueError naming `name` unless `t` is usable on this rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != world.device:
        raise ValueError(f"{name} is on {t.device}, but this rank's device is {world.device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_out(out, shape, dtype, world) -> None:
    check_tensor("out", out, world)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")


def check_method(method: str, methods) -> None:
    if method not in methods:
        raise ValueError(f"method must be one of {', '.join(repr(m) for m in methods)}, got {method!r}")


def as_words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as the widest integer words that tile them (pure data movement is bit-exact)."""
    flat = t.reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0 and t.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat.view(torch.int8)


def world_or_raise():
    return _world.get()
