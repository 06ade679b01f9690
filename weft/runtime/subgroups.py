"""torch.distributed process groups that weft registers itself: under a name of its choosing, made by their
members alone.

`member_process_group` makes the process groups that some ranks make without the others: the hierarchical ops'
node and rail groups (weft/kernels/hierarchical.py, on a group's first op there) and a spanning heap's node
groups (heap.cuda_heap). Not torch's `new_group(ranks, use_local_synchronization=True)`: that names the group,
and so its keys in the store, after its ranks and the number of process groups this process has registered; a
group that only some ranks made earlier (`new_group([0, 3])`: torch registers it on its members only; a group's
heap, a user group's hierarchy) leaves the members with different counts, and each then waits for ever under
keys the others never write. Here the name is what every member holds whatever came before: the parent group's
name (the same on all its members), what the group is for, its ranks, and how many times they made it before.

`registered_process_group` builds such a group (gloo, and NCCL too on GPUs) and registers it where
torch.distributed looks groups up (collectives, symmetric-memory rendezvous by name, destroy_process_group);
weft's torch.distributed backend (weft.distributed) makes its internal groups with it. `unregister` undoes it.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo
from torch.distributed import distributed_c10d as c10d

from . import backend, settings


def backend_type(device: torch.device):
    """torch's backend type for a device's collectives: NCCL on GPUs, gloo on cpu."""
    return dist.ProcessGroup.BackendType.NCCL if device.type == "cuda" else dist.ProcessGroup.BackendType.GLOO


def registered_process_group(store, rank: int, size: int, timeout, name: str,
                             global_ranks: list[int]) -> dist.ProcessGroup:
    """A gloo (and on GPUs NCCL) group of the world ranks `global_ranks`, this process being its `rank`, under the
    keys of `store`, registered with torch.distributed under `name` so that its host collectives and
    symmetric-memory rendezvous find it. Collective over its members only (gloo connects them now; NCCL at its
    first collective)."""
    pg = dist.ProcessGroup(store, rank, size)
    gloo = ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    config = "gloo"
    if backend.BACKEND == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.global_ranks_in_group = global_ranks
        options.group_name = name
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, size, options)
        nccl._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        config = "cpu:gloo,cuda:nccl"
    pg._set_default_backend(backend_type(torch.device(backend.BACKEND)))
    pg._set_group_name(name)
    pg._set_group_desc(name)
    world = c10d._world
    world.pg_map[pg] = (config, store)
    world.pg_names[pg] = name
    world.pg_group_ranks[pg] = {g: i for i, g in enumerate(global_ranks)}
    world.pg_backend_config[pg] = config
    world.pg_to_tag[pg] = f"ptd:{name}"
    world.tags_to_pg.setdefault(f"ptd:{name}", []).append(pg)
    c10d._register_process_group(name, pg)
    return pg


def unregister(pg) -> None:
    """Take a group `registered_process_group` made out of torch.distributed's tables (a no-op once
    destroy_process_group() of the world cleared them)."""
    world = c10d._world
    if pg not in world.pg_map:
        return
    name = world.pg_names.pop(pg)
    for table in (world.pg_map, world.pg_group_ranks, world.pg_backend_config):
        table.pop(pg, None)
    tag = world.pg_to_tag.pop(pg, None)
    if tag is not None and pg in world.tags_to_pg.get(tag, []):
        world.tags_to_pg[tag].remove(pg)
    c10d._unregister_process_group(name)


def member_process_group(parent: dist.ProcessGroup, purpose: str, world_ranks) -> dist.ProcessGroup:
    """The process group of the world ranks `world_ranks` (this rank among them, every one a member of `parent`),
    made by them alone, named "<parent's name>/<purpose>:<ranks>/<generation>": the same on every member whatever
    groups some ranks made before. `purpose` tells apart groups of the same ranks made from the same parent for
    different uses; a caller makes each (parent, purpose, ranks) once per world. Keys under "weft-subgroup/<name>/"
    in the default group's store."""
    ranks = sorted(world_ranks)
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"member_process_group: world rank {me} is not among the ranks {ranks}")
    base = f"{parent.group_name}/{purpose}:{'_'.join(map(str, ranks))}"
    default_store = c10d._get_default_store()
    # A later world over the same store (weft.init over a process group it does not own) makes the same group
    # again: each making takes the next generation, so it never reads the last one's keys. Every member adds 1, and
    # the adds of one making all come before any of the next (a finalize and an init lie between).
    generation = (default_store.add(f"weft-subgroup/{base}/made", 1) - 1) // len(ranks)
    name = f"{base}/{generation}"
    store = dist.PrefixStore(f"weft-subgroup/{name}/", default_store)
    timeout = datetime.timedelta(seconds=settings.init_timeout_s())
    return registered_process_group(store, ranks.index(me), len(ranks), timeout, name, ranks)
