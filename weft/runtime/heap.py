"""The symmetric heap: one block of memory per rank, the same layout on all.

Every rank allocates the same sequence of sizes, so an allocation sits at one
byte offset in every rank's block. `descriptor` is what kernels receive as
their `heap` argument, an int64 tensor on the device:

    [my_rank, world_size, base_0, base_1, ..., base_{W-1}, node_0, ..., node_{W-1}, pe_0, ..., pe_{W-1}]

where base_r is where rank r's block starts *in this process's address
space*, node_r the node rank r runs on (weft.runtime.topology), and pe_r
its world rank, which is its NVSHMEM PE number (torch bootstraps NVSHMEM
over the world: `wl.network_pe`).
`weft.language.symm_at` translates a pointer with it, to a rank of this
node only; `wl.same_node` compares the node ids.

The block's last `tail_bytes` (the tail) are outside the allocator: at the same offset on every rank whatever
the members allocated, and zero since the block was made (it is zeroed before the members' rendezvous, so no
peer's write can precede it). A workspace that some members make without the others lives there with no
collective step: p2p's, made at the first send or receive by its two ends alone (weft/kernels/p2p.py).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .subgroups import member_process_group

ALIGN = 256  # bytes; TMA and 16-byte vector accesses need far less, peers agree on it


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class SymmetricHeap:
    """Bump allocator over this rank's block; `peer_block(r)` views rank r's."""

    def __init__(self, rank: int, world_size: int, size: int, device: torch.device,
                 local: torch.Tensor, bases: list[int], peer_block, tail_bytes: int = 0, node_of=None,
                 world_ranks=None):
        self.rank, self.world_size, self.size, self.device = rank, world_size, size, device
        if not 0 <= tail_bytes <= size or tail_bytes % ALIGN:
            raise ValueError(f"tail_bytes must be a multiple of {ALIGN} in [0, {size}], got {tail_bytes}")
        self.tail_bytes = tail_bytes
        if any((b - bases[rank]) % ALIGN for b in bases):
            # symm_at moves a pointer by whole ALIGN blocks, which keeps its alignment visible to Triton.
            raise RuntimeError(f"the heaps' bases {[hex(b) for b in bases]} are not {ALIGN} bytes apart")
        self.local = local  # uint8 tensor over this rank's block
        self.bases = bases
        self._peer_block = peer_block
        self.used = 0
        self.node_of = tuple(node_of) if node_of is not None else (0,) * world_size
        self.world_ranks = tuple(world_ranks) if world_ranks is not None else tuple(range(world_size))
        self.descriptor = torch.tensor([rank, world_size, *bases, *self.node_of, *self.world_ranks],
                                       dtype=torch.int64, device=device)

    # -- allocation ---------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Reserve `nbytes`; returns the byte offset (the same on every rank)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        need = _round_up(max(nbytes, 1), ALIGN)
        room = self.size - self.tail_bytes
        if self.used + need > room:
            raise MemoryError(
                f"weft symmetric heap is full: asked for {nbytes} bytes, {room - self.used} of "
                f"{room} left on rank {self.rank} (raise WEFT_HEAP_SIZE or weft.init(heap_size=...))")
        off = self.used
        self.used += need
        return off

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must be non-negative, got {shape}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        off = self.alloc(nbytes)
        return self.local[off:off + nbytes].view(dtype).view(shape)

    def tail(self) -> torch.Tensor:
        """The tail (module doc): this rank's last tail_bytes, uint8, zero until a workspace there writes it."""
        return self.local[self.size - self.tail_bytes:]

    # -- lookup -------------------------------------------------------------
    def offset_of(self, t: torch.Tensor) -> int | None:
        """Byte offset of `t` in this rank's block, or None if it lives elsewhere."""
        p = t.data_ptr()
        base = self.bases[self.rank]
        # Addresses first (cheap, and unique across devices in a process); the device only when inside.
        if base <= p and p + t.numel() * t.element_size() <= base + self.size and t.device == self.device:
            return p - base
        return None

    def contains(self, t: torch.Tensor) -> bool:
        return self.offset_of(t) is not None

    def peer(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Host-side view of rank `rank`'s copy of the symmetric tensor `t`."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(t).__name__}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        off = self.offset_of(t)
        if off is None:
            raise ValueError("tensor is not allocated from the weft symmetric heap (use weft.empty/zeros)")
        if not t.is_contiguous():
            raise ValueError("tensor must be contiguous to view it on a peer")
        nbytes = t.numel() * t.element_size()
        return self._peer_block(rank)[off:off + nbytes].view(t.dtype).view(t.shape)


# -- cpu: one shared-memory file holding every rank's block -------------------

def cpu_heap(rank: int, world_size: int, size: int, group, tail_bytes: int = 0, node_of=None,
             world_ranks=None) -> SymmetricHeap:
    """`rank` and `world_size` are the process group's (a group's heap is among its members). Rank 0 makes an anonymous shared-memory file (memfd: it never has a name in /dev/shm, so a rank killed
    at any point leaves nothing behind); every rank maps it whole (MAP_SHARED) through rank 0's descriptor
    (/proc/<pid>/fd/<fd>); once all have, rank 0 closes it and the mappings alone keep the memory.
    Simulated nodes (`node_of`) share the file too: it is the simulated network, which the language lets only
    the network primitives use across nodes."""
    total = size * world_size
    name = [None]
    fd = None
    try:
        if rank == 0:
            fd = os.memfd_create("weft-heap")
            os.ftruncate(fd, total)
            name[0] = f"/proc/{os.getpid()}/fd/{fd}"
        dist.broadcast_object_list(name, group=group, group_src=0)
        whole = torch.from_file(name[0], shared=True, size=total, dtype=torch.uint8)
        local = whole[rank * size:(rank + 1) * size]
        # No zeroing: a new memfd reads as zeros, and its pages are made on first touch (zeroing 64 MiB a rank
        # cost ~0.2 s of every cpu init). The barrier: every rank has mapped the file before rank 0 closes it.
        dist.barrier(group=group)
    finally:
        if fd is not None:
            os.close(fd)
    base = whole.data_ptr()
    bases = [base + r * size for r in range(world_size)]
    return SymmetricHeap(rank, world_size, size, torch.device("cpu"), local, bases,
                         lambda r: whole[r * size:(r + 1) * size], tail_bytes, node_of, world_ranks)


# -- one rank: a plain block, no peers to map ------------------------------------

def local_heap(size: int, device: torch.device, node_of=None, world_ranks=None) -> SymmetricHeap:
    """The heap of a group of one (a TP=1 replica, a stage of one): device memory no peer maps."""
    block = torch.zeros(size, dtype=torch.uint8, device=device)
    return SymmetricHeap(0, 1, size, device, block, [block.data_ptr()], lambda r: block, node_of=node_of,
                         world_ranks=world_ranks)


# -- cuda: one torch symmetric-memory block per rank -------------------------

def cuda_heap(rank: int, world_size: int, size: int, group, device: torch.device, tail_bytes: int = 0,
              node_of=None, world_ranks=None) -> SymmetricHeap:
    """Among members on several nodes, the blocks are mapped among each node's members only (torch symmetric
    memory maps peers through CUDA IPC, which does not cross machines): an off-node member's base is 0 and its
    block has no host view; the hierarchical ops reach other nodes through the process group."""
    import torch.distributed._symmetric_memory as symm_mem

    node_of = tuple(node_of) if node_of is not None else (0,) * world_size
    mine = [i for i in range(world_size) if node_of[i] == node_of[rank]]
    block = symm_mem.empty(size, dtype=torch.uint8, device=device)
    node_group = group
    if len(mine) < world_size:
        if world_ranks is None:
            raise ValueError("cuda_heap: members on several nodes need their world ranks")
        # Only this node's members take part (the other nodes make theirs at the same time).
        node_group = member_process_group(group, "heap-node", [world_ranks[i] for i in mine])
    block.zero_()  # before the rendezvous: a peer's first write into this block comes after it
    torch.cuda.synchronize(device)
    bases = [0] * world_size
    if len(mine) == 1:  # alone on its node: no peer to map (and NVSHMEM's rendezvous refuses a group of one)
        handle = None
        bases[rank] = block.data_ptr()
    else:
        handle = symm_mem.rendezvous(block, node_group.group_name)
        for j, i in enumerate(mine):
            bases[i] = int(handle.buffer_ptrs[j])

    def peer_block(r):
        if r not in mine:
            raise ValueError(f"rank {r} of the group is on node {node_of[r]}, not this rank's node {node_of[rank]}: "
                             "its heap block is not mapped here")
        return block if r == rank else handle.get_buffer(mine.index(r), (size,), torch.uint8, 0)

    heap = SymmetricHeap(rank, world_size, size, device, block, bases, peer_block, tail_bytes, node_of,
                         world_ranks)
    heap.node_group = node_group
    heap.handle = handle  # keeps the rendezvous (and the peer mappings) alive
    torch.cuda.synchronize(device)
    return heap
