"""The initialised world: process group, rank, device, symmetric heap, op workspaces and plans.

This is weft's only process-wide state. `init()` creates it, `finalize()`
drops it. The world is the group of every rank (weft.runtime.group.Group);
`new_group` / `new_subgroups` make others, and `resolve` turns an op's
`group=` argument into the Group it runs over. Ops keep their workspaces in
`group.contexts` (one per op family, created collectively on first use,
never grown) and their per-call-signature plans in `group.plans`, so both
live as long as the heap they use.
"""
from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

from . import backend, settings, topology
from .group import Group, make_heap
from .heap import SymmetricHeap

DEFAULT_HEAP_SIZE = {"cpu": 64 << 20, "cuda": 2 << 30}
# Bytes of symmetric workspace each op family owns (all_gather, the reductions, ag_gemm, gemm_rs, gemm_ar, ...):
# a message that does not fit goes through in several passes, or by the op's documented fallback (gemm_rs
# takes it twice: receive buffer and send slots). The seven families take half the default heap, leaving room
# for the caller's own symmetric tensors.
DEFAULT_WORKSPACE_BYTES = {"cpu": 4 << 20, "cuda": 128 << 20}


class World(Group):
    """The world group (every rank), and the process-wide state: the device, the other groups made in it.

    `world_size` is its size; `group` its torch process group (dist.group.WORLD); `node_ids[r]` the node of
    world rank r (weft.runtime.topology); `rail_route` the hierarchical ops' exchange between nodes (below; None:
    the device's default)."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device, process_group,
                 heap: SymmetricHeap, owns_group: bool, heap_size: int, workspace_bytes: int,
                 node_ids: tuple[int, ...] | None = None, rail_route: str | None = None):
        self.rank, self.world_size, self.local_rank, self.device = rank, world_size, local_rank, device
        self.node_ids = tuple(node_ids) if node_ids is not None else (0,) * world_size
        self.group = process_group
        # Callables that raise an op family's recorded device-side error (weft.check_errors runs them in turn);
        # a family with an error word appends its check when it makes its workspace, in whichever group.
        self._error_checks: list = []
        super().__init__(self, process_group, tuple(range(world_size)), heap_size, workspace_bytes, heap)
        self.groups: dict[str, Group] = {self.name: self}  # by process-group name: every group of this world
        self.made_groups: list = []  # process groups weft made (new_group), destroyed at finalize
        self._owns_group = owns_group
        # The hierarchical ops' exchange between nodes (WEFT_RAIL on GPUs, fixed at init: it decides torch's
        # symmetric-memory backend): "nccl" (the rail's process group) or "nvshmem" (weft's kernel over NVSHMEM);
        # "cpu" on the cpu backend (weft's kernel over the simulated network, whatever WEFT_RAIL says).
        self.rail_route = rail_route if rail_route is not None else "nccl" if device.type == "cuda" else "cpu"

    @property
    def error_checks(self) -> list:
        return self._error_checks


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


def _check_sizes_agree(heap_size: int, workspace_bytes: int, world_size: int, group, device,
                       local_world_size: int) -> None:
    """Every rank's heap and workspace sizes and ranks per node, compared on every rank: the heap's layout (and
    the cpu heap's one shared file) assumes one size everywhere, the nodes one split. Raises on every rank,
    naming each rank's value."""
    if world_size == 1:
        return
    mine = torch.tensor([heap_size, workspace_bytes, local_world_size], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    every = [t.tolist() for t in every]
    for i, name in enumerate(("heap_size", "workspace_bytes", "local_world_size")):
        values = [v[i] for v in every]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"weft.init: {name} differs across ranks ({per_rank}); every rank must pass the same "
                             f"value (WEFT_HEAP_SIZE / WEFT_WORKSPACE_BYTES or weft.init's arguments; "
                             f"WEFT_LOCAL_WORLD_SIZE / LOCAL_WORLD_SIZE for the ranks per node)")


def _nvshmem_rail(device: torch.device, node_ids, heap_size: int, workspace_bytes: int) -> bool:
    """WEFT_RAIL=nvshmem on GPUs where the world spans nodes: torch's symmetric memory switched to NVSHMEM before
    the first allocation (the backend is per process and fixed by it), so that every weft heap is NVSHMEM's
    symmetric memory, which the rail's exchange kernel puts into by NVSHMEM calls (weft/kernels/hierarchical.py).
    The node's peers still come from each heap's rendezvous among the node's members (nvshmem_ptr underneath).
    True where the switch is made (or was, by an earlier world of this process)."""
    if settings.rail() != "nvshmem" or device.type != "cuda" or len(set(node_ids)) < 2:
        return False
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        raise RuntimeError("WEFT_RAIL=nvshmem: this torch build has no NVSHMEM (libnvshmem_host.so.3 not found); "
                           "unset WEFT_RAIL for the NCCL rail")
    # NVSHMEM's symmetric heap holds every weft heap: the world's and, for the world's hierarchical ops, its
    # node's (eight workspaces and flags) and its rail's (two), with room. NVSHMEM reads it at its init (the
    # first allocation); a value the caller set is kept.
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap_size + 12 * workspace_bytes + (256 << 20)))
    if symm_mem.get_backend(device) != "NVSHMEM":
        try:
            symm_mem.set_backend("NVSHMEM")
        except RuntimeError as e:
            raise RuntimeError("WEFT_RAIL=nvshmem: torch's symmetric memory could not switch to NVSHMEM (its "
                               "backend is fixed by the process's first symmetric allocation: weft.init() must "
                               f"come first): {e}") from e
    return True


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
    local_world_size = topology.local_world_size(world_size)

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
        _check_sizes_agree(heap_size, workspace_bytes, world_size, group, device, local_world_size)
    except ValueError:
        if owns:  # leave no group behind: a corrected init() in this process starts afresh
            dist.destroy_process_group()
        raise

    node_ids = topology.world_nodes(world_size)
    nvshmem = _nvshmem_rail(device, node_ids, heap_size, workspace_bytes)
    heap = make_heap(rank, world_size, heap_size, group, device, workspace_bytes, node_ids,
                     tuple(range(world_size)))
    _world = World(rank, world_size, local_rank, device, group, heap, owns, heap_size, workspace_bytes, node_ids,
                   "nvshmem" if nvshmem else None)
    _world.barrier()
    return _world


def init_over(process_group, rank: int, world_size: int) -> World:
    """Join the world over a given torch process group, which this process joined as `rank` of `world_size`,
    making and destroying none: what weft's torch.distributed backend (weft.distributed) calls when
    init_process_group(backend="weft") makes the default group, `process_group` being its internal gloo / NCCL
    group, which is not registered as torch's default. Sizes, device and checks as init() with no arguments;
    finalize() leaves the process group to its maker. Collective over the group."""
    global _world
    if _world is not None:
        raise RuntimeError("weft is already initialised: call weft.finalize() first")
    settings.check_all()
    heap_size = _size_setting(None, "WEFT_HEAP_SIZE", DEFAULT_HEAP_SIZE, "heap_size")
    workspace_bytes = _size_setting(None, "WEFT_WORKSPACE_BYTES", DEFAULT_WORKSPACE_BYTES, "workspace_bytes")
    local_rank = _env_int("LOCAL_RANK", rank)
    if backend.BACKEND == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # ranks share the cores
    local_world_size = topology.local_world_size(world_size)
    _check_sizes_agree(heap_size, workspace_bytes, world_size, process_group, device, local_world_size)
    node_ids = topology.world_nodes(world_size)
    nvshmem = _nvshmem_rail(device, node_ids, heap_size, workspace_bytes)
    heap = make_heap(rank, world_size, heap_size, process_group, device, workspace_bytes, node_ids,
                     tuple(range(world_size)))
    _world = World(rank, world_size, local_rank, device, process_group, heap, False, heap_size, workspace_bytes,
                   node_ids, "nvshmem" if nvshmem else None)
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
    for g in w.groups.values():
        g.release()
    w.groups.clear()
    w.error_checks.clear()
    if dist.is_initialized():
        if w._owns_group:
            dist.destroy_process_group()  # every group with it
        else:
            for pg in w.made_groups:
                dist.destroy_process_group(pg)


# -- groups -------------------------------------------------------------------------------------------------------

def new_group(ranks, heap_size: int | None = None, workspace_bytes: int | None = None) -> Group | None:
    """A group of the world ranks `ranks`. Collective over the world, like torch.distributed.new_group: every rank
    calls it with the same list; members get the Group, the other ranks None. As in torch.distributed, group ranks
    follow world order whatever the list's order: group rank i is the i-th smallest world rank of the list. Every rank's list is compared first: ranks that disagree get a ValueError on every
    rank, naming each rank's list.

    heap_size / workspace_bytes: the group's own symmetric heap per member (default: the world's), made on the
    group's first use, and the workspace each op family takes from it (default: the world's).
    """
    w = get()
    ranks = _check_ranks(ranks, w.world_size)
    heap_size = _size_setting(heap_size if heap_size is not None else w.heap_size, "", {}, "heap_size")
    workspace_bytes = _size_setting(workspace_bytes if workspace_bytes is not None else w.workspace_bytes, "", {},
                                    "workspace_bytes")
    _check_world_agrees("new_group", [list(ranks), heap_size, workspace_bytes], w)
    pg = dist.new_group(list(ranks))
    w.made_groups.append(pg)
    if w.rank not in ranks:
        return None
    group = Group(w, pg, tuple(dist.get_process_group_ranks(pg)), heap_size, workspace_bytes)
    w.groups[group.name] = group
    return group


def new_subgroups(size: int, heap_size: int | None = None, workspace_bytes: int | None = None) -> Group:
    """This rank's group among the world cut into groups of `size` consecutive ranks ([0..size-1], [size..2 size-1],
    ...; every rank in exactly one). Collective over the world; `size` must divide the world size."""
    w = get()
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"size must be an int, got {type(size).__name__}")
    if size < 1 or w.world_size % size:
        raise ValueError(f"size must be a positive divisor of the world size {w.world_size}, got {size}")
    mine = None
    for first in range(0, w.world_size, size):
        g = new_group(range(first, first + size), heap_size, workspace_bytes)
        mine = mine or g
    return mine


def resolve(group) -> Group:
    """The Group an op's `group=` names: None (the world), a weft Group of this world, a torch.distributed
    ProcessGroup this rank is a member of (its weft Group made on first use), or a group's name."""
    w = _world
    if group is None:
        if w is None:
            raise RuntimeError("weft is not initialised: call weft.init() first")
        return w
    if isinstance(group, Group):
        if w is None or group.world is not w:
            raise ValueError(f"group {group!r} belongs to a weft world that was finalized; make the group again "
                             "in this one")
        return group
    if w is None:
        raise RuntimeError("weft is not initialised: call weft.init() first")
    if isinstance(group, str):
        found = w.groups.get(group)
        if found is None:
            raise ValueError(f"group {group!r}: no weft group of that name on world rank {w.rank} (its groups: "
                             f"{', '.join(sorted(w.groups))})")
        return found
    if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:  # what torch's new_group gave a non-member
        raise ValueError(f"group: world rank {w.rank} is not a member of this process group (new_group gave it "
                         "GroupMember.NON_GROUP_MEMBER)")
    if isinstance(group, dist.ProcessGroup):
        found = w.groups.get(group.group_name)
        if found is None:
            found = _from_process_group(w, group)
        return found
    raise TypeError(f"group must be None, a weft.Group, a torch.distributed.ProcessGroup or a group name, got "
                    f"{type(group).__name__}")


def _from_process_group(w: World, pg) -> Group:
    ranks = tuple(dist.get_process_group_ranks(pg))
    if w.rank not in ranks:
        raise ValueError(f"group: world rank {w.rank} is not a member of the process group of ranks {list(ranks)}")
    group = Group(w, pg, ranks, w.heap_size, w.workspace_bytes)
    w.groups[group.name] = group
    return group


def _check_ranks(ranks, world_size: int) -> tuple[int, ...]:
    try:
        ranks = tuple(ranks)
    except TypeError:
        raise TypeError(f"ranks must be a sequence of world ranks, got {type(ranks).__name__}") from None
    if not ranks:
        raise ValueError("ranks must name at least one rank")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"ranks must be ints, got {type(r).__name__} in {list(ranks)}")
        if not 0 <= r < world_size:
            raise ValueError(f"ranks: {r} is not a world rank (the world has {world_size} ranks)")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks {list(ranks)} name a rank twice")
    return ranks


def _check_world_agrees(what: str, value, w: World) -> None:
    """Every world rank's `value` compared on every rank (a host collective: group creation is rare)."""
    if w.world_size == 1:
        return
    every = [None] * w.world_size
    dist.all_gather_object(every, value, group=w.group)
    if any(v != every[0] for v in every):
        per_rank = "; ".join(f"rank {r}: {v}" for r, v in enumerate(every))
        raise ValueError(f"weft.{what}: the ranks disagree ({per_rank}); every rank must pass the same arguments")
