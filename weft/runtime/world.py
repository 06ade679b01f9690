"""The initialised world: process group, rank, device, symmetric heap, op workspaces and plans.

This is weft's only process-wide state. `init()` creates it, `finalize()`
drops it. Ops keep their workspaces in `world.contexts` (one per op family,
created collectively on first use, never grown) and their per-call-signature
launch plans in `world.plans`, so both live as long as the heap they use.
"""
from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

from . import backend, settings
from .heap import SymmetricHeap, cpu_heap, cuda_heap

DEFAULT_HEAP_SIZE = {"cpu": 64 << 20, "cuda": 2 << 30}
# Bytes of symmetric workspace each op family owns (all_gather, the reductions, ag_gemm, gemm_rs, gemm_ar, ...):
# a message that does not fit goes through in several passes, or by the op's documented fallback (gemm_rs
# takes it twice: receive buffer and send slots). The seven families take half the default heap, leaving room
# for the caller's own symmetric tensors.
DEFAULT_WORKSPACE_BYTES = {"cpu": 4 << 20, "cuda": 128 << 20}


class World:
    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device, group,
                 heap: SymmetricHeap, owns_group: bool, workspace_bytes: int):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device, self.group, self.heap = device, group, heap
        self.backend = backend.BACKEND
        self.workspace_bytes = workspace_bytes
        self.contexts: dict = {}  # op family -> its workspace
        self.plans: dict = {}  # call signature -> what the call does (weft.kernels.common.Plan)
        self.barriers = 0  # host barriers made so far: ops make none once their workspaces exist
        # Callables that raise an op family's recorded device-side error (weft.check_errors runs them in turn);
        # a family with an error word appends its check when it makes its workspace.
        self.error_checks: list = []
        # The barrier's one word, made now: NCCL's own barrier allocates a tensor per call and keeps it, which
        # a workspace first made under CUDA-graph trees' warm-up (in their pool) would leave behind there.
        self._barrier_word = torch.zeros(1, dtype=torch.int32, device=device) if device.type == "cuda" else None
        self._owns_group = owns_group

    def context(self, key, make):
        """The op context cached under `key` (the op's name, or a tuple led by it), created (collectively)
        on first use. Creation allocates and synchronises, so it cannot happen inside CUDA-graph capture."""
        ctx = self.contexts.get(key)
        if ctx is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                op = key[0] if isinstance(key, tuple) else key
                raise RuntimeError(f"weft.ops.{op}: its workspace is created collectively on first use; call it "
                                   "once outside CUDA-graph capture (same shapes) before capturing")
            ctx = self.contexts[key] = make()
        return ctx

    def barrier(self):
        """Host barrier: every rank has reached it and its queued device work is done."""
        self.barriers += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            dist.all_reduce(self._barrier_word, group=self.group)
            torch.cuda.synchronize(self.device)
        else:
            dist.barrier(group=self.group)


_world: World | None = None


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected an integer >= 0 (set by the launcher)")
    return value


def _size_setting(value, env: str, default: dict, name: str) -> int:
    if value is None:
        value = settings.get(env, default[backend.BACKEND])
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    return value


def _check_sizes_agree(heap_size: int, workspace_bytes: int, world_size: int, group, device) -> None:
    """Every rank's heap and workspace sizes, compared on every rank: the heap's layout (and the cpu heap's
    one shared file) assumes one size everywhere. Raises on every rank, naming each rank's value."""
    if world_size == 1:
        return
    mine = torch.tensor([heap_size, workspace_bytes], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    every = [t.tolist() for t in every]
    for i, name in enumerate(("heap_size", "workspace_bytes")):
        values = [v[i] for v in every]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"weft.init: {name} differs across ranks ({per_rank}); every rank must pass the same "
                             f"value (WEFT_HEAP_SIZE / WEFT_WORKSPACE_BYTES or weft.init's arguments)")


def _launcher_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The launcher's key-value store (env://: MASTER_ADDR, MASTER_PORT), under keys of this world's own.

    torchrun's store is its agent's, which outlives process groups: a group made after finalize() under the
    keys of the one before reads that one's entries, its NCCL unique id among them, and NCCL then waits for
    ever to join a communicator that is gone (pytorch issues 114585, 119196). So each world of a process
    takes the next generation number from the store: every rank adds 1, and the W adds of one world all come
    before any of the next (which starts after the finalize barrier)."""
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    generation = (store.add("weft/worlds", 1) - 1) // world_size
    return dist.PrefixStore(f"weft/{generation}", store)


def init(heap_size: int | None = None, workspace_bytes: int | None = None) -> World:
    """Join the world: from torchrun's (or `weft run`'s) environment, else a world of one.

    A second call is a no-op when its arguments are None or those of the world already made, and raises
    a ValueError otherwise. Every rank must ask for the same sizes: init compares them and raises on every
    rank, naming each rank's, when they differ.

    heap_size: bytes of symmetric heap per rank (default WEFT_HEAP_SIZE, else 2 GiB on GPUs, 64 MiB on cpu).
    workspace_bytes: bytes of symmetric workspace each op family takes from it on first use (default
    WEFT_WORKSPACE_BYTES, else 128 MiB on GPUs, 4 MiB on cpu); larger messages go through in passes.
    """
    global _world
    if _world is not None:
        # Joining again is a no-op; asking for another size is an error, never silently ignored.
        for name, asked, has in (("heap_size", heap_size, _world.heap.size),
                                 ("workspace_bytes", workspace_bytes, _world.workspace_bytes)):
            if asked is not None and asked != has:
                raise ValueError(f"weft.init({name}={asked!r}): weft is already initialised with {name}={has}; "
                                 "call weft.finalize() first to start a world of another size")
        return _world
    settings.check_all()
    heap_size = _size_setting(heap_size, "WEFT_HEAP_SIZE", DEFAULT_HEAP_SIZE, "heap_size")
    workspace_bytes = _size_setting(workspace_bytes, "WEFT_WORKSPACE_BYTES", DEFAULT_WORKSPACE_BYTES,
                                    "workspace_bytes")
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    timeout = datetime.timedelta(seconds=settings.init_timeout_s())

    if backend.BACKEND == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("WEFT_BACKEND=cuda but no GPU is visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # ranks share the cores

    owns = not dist.is_initialized()
    if owns:
        pg_backend = "nccl" if device.type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:
            kwargs = dict(device_id=device) if device.type == "cuda" else {}
            dist.init_process_group(pg_backend, store=_launcher_store(rank, world_size, timeout), rank=rank,
                                    world_size=world_size, timeout=timeout, **kwargs)
        else:
            if world_size != 1:
                raise RuntimeError("WORLD_SIZE > 1 but no MASTER_ADDR: start ranks with `weft run -n N` or torchrun")
            dist.init_process_group(pg_backend, store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    if dist.get_world_size(group) != world_size:
        raise RuntimeError(f"process group has {dist.get_world_size(group)} ranks, WORLD_SIZE says {world_size}")
    try:
        _check_sizes_agree(heap_size, workspace_bytes, world_size, group, device)
    except ValueError:
        if owns:  # leave no group behind: a corrected init() in this process starts afresh
            dist.destroy_process_group()
        raise

    if device.type == "cuda":
        heap = cuda_heap(rank, world_size, heap_size, group, device)
    else:
        heap = cpu_heap(rank, world_size, heap_size, group)
    _world = World(rank, world_size, local_rank, device, group, heap, owns, workspace_bytes)
    _world.barrier()
    return _world


def get() -> World:
    if _world is None:
        raise RuntimeError("weft is not initialised: call weft.init() first")
    return _world


def is_initialized() -> bool:
    return _world is not None


def finalize() -> None:
    global _world
    if _world is None:
        return
    w, _world = _world, None
    # CUDA graphs still alive in reference cycles (a model and its decode sessions) may hold NCCL kernels of
    # this group's communicator: free them, and let the device finish, before the group goes.
    gc.collect()
    if w.device.type == "cuda":
        torch.cuda.synchronize(w.device)
    w.barrier()
    w.contexts.clear()
    w.plans.clear()
    w.error_checks.clear()
    if w._owns_group and dist.is_initialized():
        dist.destroy_process_group()
