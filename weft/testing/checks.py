"""Checks shared by the multi-rank tests."""
from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, for bit-exact comparisons (NaN == NaN)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def rejects(fn, exc, word: str, guarded) -> None:
    """fn() raises `exc` naming `word`, and the tensors in `guarded` keep their bits."""
    before = [t.clone() for t in guarded]
    try:
        fn()
    except exc as e:
        assert word in str(e), f"{exc.__name__} does not name {word!r}: {e}"
    else:
        raise AssertionError(f"expected {exc.__name__} naming {word!r}")
    for b, t in zip(before, guarded):
        assert bits(b).equal(bits(t)), f"a rejected call ({word}) wrote into a tensor"
