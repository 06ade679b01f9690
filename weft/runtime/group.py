"""A group: ranks that run ops together, with their own symmetric heap, workspaces and plans.

Every op runs over one group (`group=None`: the world). Kernels see only their group: the heap descriptor a
group hands them is [my rank in the group, group size, base of member 0, ..., base of member size-1], so
`wl.rank`, `wl.num_ranks` and `wl.symm_at` are group-relative and no kernel knows groups exist. After the
bases come the members' node ids (weft.runtime.topology), for `wl.same_node`, then their world ranks (their
NVSHMEM PE numbers, for the network primitives' NVSHMEM form: `wl.network_pe`).

A group's heap is its own block per member (the world's is made at init; another group's on its first use,
collectively among its members: the first op, `empty` or `barrier` they call on it), so members allocate in
the same order without the ranks outside taking part. Op families keep one workspace per group
(`contexts`), plans are cached per group (`plans`): calls on different groups never share a flag or a buffer,
so they interleave freely, and run concurrently on different streams where the caller does so. On the NVSHMEM
rail (WEFT_RAIL=nvshmem) every heap is an `nvshmem_malloc`, collective over the whole world: a group that spans
nodes and is not the world cannot make its heap there (`check_heap_route` raises before anything collective).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import backend
from .heap import ALIGN, SymmetricHeap, cpu_heap, cuda_heap, local_heap
from .topology import Topology


class Group:
    """Ranks that run ops together. `rank` is this process's rank in the group, `size` the number of members,
    `ranks` their world ranks in group order (group rank i is world rank ranks[i]; in world order, as torch.distributed
    numbers a group's ranks), `name` the torch process
    group's name (what `torch.ops.weft` operators take), `process_group` the torch.distributed group. `nodes`: the
    group ranks on each node the group spans (one tuple per node), `topology` the rest of that
    (weft.runtime.topology.Topology). `heap_makers`: the world ranks that make its heap at the same point (default
    its members; the hierarchical ops' node and rail groups: every member of the group they split)."""

    def __init__(self, world, process_group, ranks: tuple[int, ...], heap_size: int, workspace_bytes: int,
                 heap: SymmetricHeap | None = None, heap_makers: tuple[int, ...] | None = None):
        self.world = world
        self.process_group = process_group
        self.name = process_group.group_name
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(world.rank)
        self.topology = Topology(world.node_ids[r] for r in self.ranks)
        self.nodes = self.topology.nodes
        self.device = world.device
        self.backend = backend.BACKEND
        self.heap_size, self.workspace_bytes = heap_size, workspace_bytes
        self._heap = heap
        self.heap_makers = tuple(heap_makers) if heap_makers is not None else self.ranks
        self.contexts: dict = {}  # op family -> its workspace in this group's heap
        self.plans: dict = {}  # call signature -> the call's Plan (weft.kernels.common)
        self.barriers = 0  # host barriers made so far: ops make none once their workspaces exist
        # The barrier's one word, made now: NCCL's own barrier allocates a tensor per call and keeps it, which
        # a workspace first made under CUDA-graph trees' warm-up (in their pool) would leave behind there.
        self._barrier_word = torch.zeros(1, dtype=torch.int32, device=self.device) \
            if self.device.type == "cuda" else None

    def __deepcopy__(self, memo):
        return self  # a group is shared state, never copied (a model copied by deepcopy keeps its groups)

    def __repr__(self) -> str:
        return f"weft.Group(ranks={list(self.ranks)}, rank={self.rank}, name={self.name!r})"

    @property
    def error_checks(self) -> list:
        """The world's device-error checks (weft.check_errors runs them all, whichever group recorded one)."""
        return self.world.error_checks

    @property
    def heap(self) -> SymmetricHeap:
        """This group's symmetric heap, made on first use (collectively among the members)."""
        if self._heap is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self!r}: its symmetric heap is made collectively on first use; use the group "
                                   "once outside CUDA-graph capture before capturing")
            check_heap_route(self.world.rail_route, self.heap_makers, self.world.node_ids)
            self._heap = make_heap(self.rank, self.size, self.heap_size, self.process_group, self.device,
                                   self.workspace_bytes, self.topology.node_of, self.ranks)
        return self._heap

    def context(self, key, make):
        """The op context cached under `key` (the op's name, or a tuple led by it), created (collectively among
        the members) on first use. Creation allocates and synchronises, so it cannot happen inside CUDA-graph
        capture."""
        ctx = self.contexts.get(key)
        if ctx is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                op = key[0] if isinstance(key, tuple) else key
                raise RuntimeError(f"weft.ops.{op}: its workspace is created collectively on first use; call it "
                                   "once outside CUDA-graph capture (same shapes) before capturing")
            ctx = self.contexts[key] = make()
        return ctx

    def barrier(self) -> None:
        """Host barrier: every member has reached it and its queued device work is done."""
        self.barriers += 1
        if self.size == 1:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            dist.all_reduce(self._barrier_word, group=self.process_group)
            torch.cuda.synchronize(self.device)
        else:
            dist.barrier(group=self.process_group)

    def release(self) -> None:
        """Drop the workspaces and plans (finalize): what kept device memory and compiled launches alive."""
        self.contexts.clear()
        self.plans.clear()


def check_heap_route(rail_route: str, ranks, node_ids) -> None:
    """Raise a ValueError where the world ranks `ranks`, making a heap alone, cannot on the world's `rail_route`;
    `node_ids[r]`: the node of world rank r (the world's size is its length). On "nvshmem" every heap is an
    `nvshmem_malloc`, collective over every rank of the world: ranks that span nodes but are not the whole world
    would wait for ranks that never join it. Host-only, from values every member holds: it raises on every member,
    before any collective step."""
    ranks = tuple(ranks)
    nodes = sorted({node_ids[r] for r in ranks})
    if rail_route != "nvshmem" or len(nodes) < 2 or len(set(ranks)) == len(node_ids):
        return
    raise ValueError(f"a group of {len(ranks)} ranks (world ranks {sorted(ranks)}) spans {len(nodes)} nodes and is "
                     f"not the world of {len(node_ids)} ranks: on the NVSHMEM rail (WEFT_RAIL=nvshmem) its heap "
                     "would be an nvshmem_malloc, collective over the whole world, which the ranks outside the group "
                     "never join (a hang). Run its ops on the world (group=None), or unset WEFT_RAIL for the NCCL "
                     "rail, where a group's heap is made by its members alone")


def make_heap(rank: int, size: int, nbytes: int, process_group, device: torch.device,
              workspace_bytes: int = 0, node_of=None, world_ranks=None) -> SymmetricHeap:
    """A symmetric heap of `nbytes` per member among the `size` members of `process_group` (collective);
    `node_of[i]`: the node of member i (default: one node), `world_ranks[i]` its world rank. Of a group of two or
    more, its last `workspace_bytes` (rounded up to the alignment) are the heap's tail: the p2p workspace, which
    the two ends of a transfer make alone (weft/runtime/heap.py)."""
    node_of = tuple(node_of) if node_of is not None else (0,) * size
    if size == 1:
        return local_heap(nbytes, device, node_of, world_ranks)
    tail = min(-(-workspace_bytes // ALIGN) * ALIGN, nbytes // 2 // ALIGN * ALIGN)
    if device.type == "cuda":
        return cuda_heap(rank, size, nbytes, process_group, device, tail, node_of, world_ranks)
    return cpu_heap(rank, size, nbytes, process_group, tail, node_of, world_ranks)


# What an op's or weft's `group=` argument takes (world.resolve turns it into a Group): None (the world), a weft
# Group, a torch.distributed ProcessGroup this rank belongs to, or a group's name.
GroupLike = Group | dist.ProcessGroup | str | None
