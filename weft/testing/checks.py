"""Checks shared by the multi-rank tests."""
from __future__ import annotations

import contextlib
import os
import sys

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



def kept_tensors(world) -> list[torch.Tensor]:
    """The tensors that weft keeps between calls (reachable from its workspaces and plans) other than
    symmetric-heap memory (this rank's or a peer's), the heap's descriptor and pinned host memory (a word
    the kernels store to, such as the MoE workspace's error word). It should be none: after a first call
    under CUDA-graph trees (torch.compile's "reduce-overhead") such a tensor would be memory of the graphs'
    pool that no output accounts for, or a caller's tensor kept alive.

    Follows containers, closures (cells and defaults), bound methods and the attributes of weft's own
    objects, up to the world and its heap; the rest (Triton's compiled kernels, streams, numbers) holds no
    tensor of weft's."""
    import types

    heap, found, seen = world.heap, [], {id(world), id(world.heap)}

    def in_heap(t):  # by the memory t keeps alive: its storage, which a heap view shares with a block
        storage = t.untyped_storage()
        start = storage.data_ptr()
        return storage.nbytes() == 0 or (t.device == heap.device and any(b <= start < b + heap.size
                                                                          for b in heap.bases))

    todo = [*world.contexts.values(), *world.plans.values()]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj is not heap.descriptor and not in_heap(obj) and not obj.is_pinned():
                found.append(obj)
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # a cell not filled yet
                    pass
            todo += [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
        elif isinstance(obj, types.MethodType):
            todo += [obj.__self__, obj.__func__]
        elif type(obj).__module__.startswith("weft.") and hasattr(obj, "__dict__"):
            todo += list(vars(obj).values())
    return found


@contextlib.contextmanager
def nan_allocations():
    """Every torch.empty / empty_like in the block returns floating tensors full of NaN (on GPUs a fill
    queued on the stream, no sync): outputs poisoned before an op writes them."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


@contextlib.contextmanager
def host_reads():
    """Yields a list that records, as "file:line name", every read of a tensor's values into Python made by
    weft's own code (not its tests' helpers) in the block: Tensor.item, tolist, numpy, cpu, bool, int, float,
    index. On GPUs each is a host sync (the host waits for the device), so an op that makes none on the cpu
    backend queues its work on GPUs without waiting."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    helpers = os.path.dirname(os.path.abspath(__file__)) + os.sep
    found = []
    names = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def watched(name, fn):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(package) and not caller.co_filename.startswith(helpers):
                found.append(f"{caller.co_filename}:{sys._getframe(1).f_lineno} {name}")
            return fn(self, *args, **kwargs)
        return read

    for name, fn in saved.items():
        setattr(torch.Tensor, name, watched(name, fn))
    try:
        yield found
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
