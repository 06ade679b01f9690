"""The ops of a group that spans nodes, in two levels: all_reduce, reduce_scatter, all_gather, ag_gemm, gemm_rs,
gemm_ar, sp_flash_decode and the Ulysses all-to-all (the EP ops: weft/kernels/moe/ep_nodes.py, with the rail
exchange below).

A group whose members run on several nodes (weft.runtime.topology) reaches another node only through the
network; inside a node its members keep NVLink. So each op splits into the node's own collective (weft's kernels
over the node's members) and one exchange among the *rail*: the members that have the same place on their nodes
(local index j of every node), one per node, which carries 1/L of the data per member where L is the members per
node:

- all_reduce: reduce_scatter inside the node (each member gets 1/L of the node's sum), all_reduce of that part
  over the rail, all_gather inside the node;
- reduce_scatter: the blocks reordered so that member j's part holds the blocks of rail j's members,
  reduce_scatter inside the node, reduce_scatter over the rail;
- all_gather: all_gather over the rail (one shard per node), all_gather inside the node, the blocks put back in
  group order. Bit for bit the flat op's result.
- ag_gemm (`AgGemm`): all_gather over the rail beside the node's overlapped ag_gemm of its own node's shards, then
  the node's ag_gemm of each other node's shards. Bit for bit the flat op's result.
- gemm_rs (`GemmRS`): the node's overlapped gemm_rs of the rows destined to each node (the other nodes' first),
  the node sums exchanged over the rail beside the last one, summed in node order.
- gemm_ar (`GemmAr`): the node's gemm_ar, then the rail's all_reduce of the node sums.
- sp_flash_decode (`SpFlashDecode`): each member's partial (out, lse) gathered by the hierarchical all_gather,
  merged by every member in group-rank order.
- ulysses_all_to_all (`UlyssesAllToAll`): the node's all-to-all of the blocks bound to each rail, then the
  rail's all-to-all of a node's blocks for each member. Bit for bit the flat op's result.

The rail exchange: on the cpu backend `network_exchange_kernel`, which moves data with the network primitives
only (`putmem_signal_block`, then a wait on its own flags), through a double-buffered workspace in the rail's
heap, in passes when larger; the rail's reductions are then summed on the host in rank order (the same bits on
every member). On GPUs the rail exchange is by default the rail's process group (NCCL: on InfiniBand between
nodes); with WEFT_RAIL=nvshmem (weft.init put every heap on NVSHMEM's symmetric memory) it is
`network_exchange_nvshmem_kernel`, the same protocol through the network primitives' NVSHMEM form, with its epochs
in device memory (CUDA-graph replays) and the reductions summed as on cpu. Either is ordered with the node's
kernels by stream order (ag_gemm's and gemm_rs's on a side stream, beside the node's kernels: see their classes).

The node and rail groups are made on the op's first call on the group, among its members only (named after the
group and their ranks, whatever groups some ranks made before: weft/runtime/subgroups.py), once per set of ranks
in a world, with a heap just large enough for the families' workspaces they use. A group whose nodes hold
different numbers of its members has no rails: its ops take the process group's collective (`nccl` method)
instead. The collectives call the node's reduce_scatter and all_gather through those ops' plans, made on their own
first call: no dispatch, group resolution or plan key per call (an eager call's host cost: docs/nodes.md,
scripts/probe_nodes_host.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import language as wl
from ..runtime import backend
from ..runtime.group import Group, check_heap_route
from ..runtime.streams import StreamSet
from ..runtime.subgroups import member_process_group
from .common import nccl_all_gather, nccl_reduce_scatter, workspace, zero_everywhere


@triton.jit(do_not_specialize=["nbytes", "src_stride", "slot_bytes", "epoch"])
def network_exchange_kernel(src, recv, flags, heap, nbytes, src_stride, slot_bytes, epoch, W: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Rank `me` puts bytes [q * src_stride, q * src_stride + nbytes) of `src` into slot `me` of `recv` on every
    rail member q (src_stride 0: one block for all, an all_gather; the block's size: an all-to-all), each put
    followed by its signal (release) in flag `me`; then waits (acquire) for every member's flag to reach
    `epoch`. Only network primitives: the members are on other nodes."""
    me = wl.rank(heap)
    for i in range(W):
        q = (me + i) % W  # each member starts with a different peer
        wl.putmem_signal_block(recv + me * slot_bytes, src + q * src_stride, nbytes, flags + me, epoch,
                               wl.SIGNAL_SET, q, heap, BLOCK)
    for q in range(W):
        wl.signal_wait_until(flags + q, wl.CMP_GE, epoch)


@triton.jit(do_not_specialize=["nbytes"])
def network_exchange_nvshmem_kernel(src, out, stage, recv, flags, counter, heap, nbytes, src_stride, slot_bytes,
                                    out_stride, chunk_bytes, W: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                                    BLOCK: tl.constexpr):
    """`network_exchange_kernel`'s protocol over NVSHMEM (GPUs, WEFT_RAIL=nvshmem), in programs (i, c): the
    block's bytes split into chunks of `chunk_bytes` (a multiple of 256), program (i, c) with i >= 1 moves chunk c
    between rank `me` and its peers at distance i: it stages chunk c of the block for q = me + i (bytes
    [q * src_stride, + nbytes) of `src`; src_stride 0: one block for all, an all_gather) in its own slot i - 1 of
    the symmetric `stage` (a network transport reads registered memory only), puts it into slot i - 1 of half
    epoch % 2 of q's `recv` with flag (i - 1, c) there SET to the epoch, then waits (GE epoch) for flag (i - 1, c)
    of its own, set by s = me - i, and copies that chunk to row s of `out` (row stride `out_stride`). Programs
    (0, c) copy chunk c of the own block straight from `src`. Every program puts before it waits, and the host
    keeps the grid within what the GPU holds at once, so no waiter keeps a putter from running.

    The epoch is the device `counter[0]` + 1: the last program to arrive on `counter[1]` stores it back (every
    program read it before arriving) and zeroes the arrivals, so epochs are monotonic and a CUDA graph's replays
    take new ones. Half e % 2 is written again by a member's call e + 2 only after its call e + 1 waited for my
    call e + 1's chunk 0 (every call has one), put after my call e (its last reader of that half) ended."""
    me = wl.rank(heap)
    i = tl.program_id(0)
    c = tl.program_id(1)
    epoch = tl.load(counter) + 1
    lo = c * chunk_bytes
    n = tl.minimum(chunk_bytes, nbytes - lo)
    if n > 0:
        if i == 0:
            wl.copy_bytes(out + me.to(tl.int64) * out_stride + lo, src + me.to(tl.int64) * src_stride + lo, n,
                          BLOCK)
        else:
            q = (me + i) % W
            s = (me + W - i) % W
            staged = stage + (i - 1) * slot_bytes + lo
            wl.copy_bytes(staged, src + q.to(tl.int64) * src_stride + lo, n, BLOCK)
            tl.debug_barrier()  # the block's stores to `stage` before the block-scoped put reads it
            slot = ((epoch % 2) * (W - 1) + i - 1).to(tl.int64) * slot_bytes + lo
            flag = flags + (i - 1) * MAX_CHUNKS + c
            wl.putmem_signal_block(recv + slot, staged, n, flag, epoch, wl.SIGNAL_SET, q, heap, BLOCK,
                                   NVSHMEM=True)
            wl.signal_wait_until(flag, wl.CMP_GE, epoch, NVSHMEM=True)
            wl.copy_bytes(out + s.to(tl.int64) * out_stride + lo, recv + slot, n, BLOCK)
    tl.debug_barrier()  # every thread has read the counter before this program arrives
    arrived = tl.atomic_add(counter + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(counter + 1, 0)
        tl.store(counter, epoch)


class RailWorkspace:
    """The rail exchange's workspace in the rail's heap: two halves (by call parity) of one slot per member, one
    flag per member (epochs, never reset: a flag may already show the next call's epoch, whose data goes to the
    other half), the call count on the host."""

    def __init__(self, rail: Group):
        w = rail.size
        self.slot_bytes = rail.workspace_bytes // 2 // w // 256 * 256
        self.recv = rail.heap.empty((2, w, self.slot_bytes), torch.uint8)
        self.flags = rail.heap.empty((w,), torch.int32)
        self.calls = 0
        zero_everywhere(rail, self.flags)


class NvshmemRailWorkspace:
    """The rail exchange's workspace over NVSHMEM, in the rail's heap (NVSHMEM's symmetric memory): two halves
    (by epoch parity) of one receive slot per other member (slot i - 1: from the member i before me), the staging
    slots of the puts (slot i - 1: to the member i after me), so a slot is a third of the workspace over the other
    members; one 64-bit signal word per (other member, chunk) (NVSHMEM's signals are uint64; epochs, never reset);
    and in device memory the epoch counter and the programs' arrival count (a replayed CUDA graph reads its epochs
    there). `max_chunks` keeps the grid, (members, chunks), within PROGRAMS."""

    PROGRAMS = 128  # at most this many programs at once: all resident on an H100 / H200 (132 SMs)
    MIN_CHUNK_BYTES = 16 << 10  # a program's share is at least this (then fewer chunks)

    def __init__(self, rail: Group):
        import torch.distributed._symmetric_memory as symm_mem

        if symm_mem.get_backend(rail.device) != "NVSHMEM":
            raise RuntimeError(f"{rail!r}: the NVSHMEM rail needs weft's heaps in NVSHMEM's symmetric memory "
                               "(weft.init() with WEFT_RAIL=nvshmem on a world that spans nodes)")
        w = rail.size
        self.max_chunks = max(1, self.PROGRAMS // w)
        self.slot_bytes = rail.workspace_bytes // 3 // (w - 1) // 256 * 256
        self.recv = rail.heap.empty((2, w - 1, self.slot_bytes), torch.uint8)
        self.stage = rail.heap.empty((w - 1, self.slot_bytes), torch.uint8)
        self.flags = rail.heap.empty((w - 1, self.max_chunks), torch.int64)
        self.counter = torch.zeros(2, dtype=torch.int32, device=rail.device)
        zero_everywhere(rail, self.flags)

    def chunking(self, nbytes: int) -> tuple[int, int]:
        """(chunk bytes, chunks) of a pass of `nbytes`: as many chunks as allowed of at least MIN_CHUNK_BYTES,
        each a multiple of 256 bytes (the programs' pointers keep the block's alignment)."""
        chunks = min(self.max_chunks, triton.cdiv(nbytes, self.MIN_CHUNK_BYTES))
        chunk = triton.cdiv(triton.cdiv(nbytes, chunks), 256) * 256
        return chunk, triton.cdiv(nbytes, chunk)


_nvshmem_kernel = None  # network_exchange_nvshmem_kernel through torch's requires_nvshmem (made on first use)


def _nvshmem_exchange_kernel():
    """The NVSHMEM exchange kernel as torch's `requires_nvshmem` wraps it: launched with NVSHMEM's device library
    linked in, `nvshmemx_cumodule_init` run on each new cubin (scripts/probe_nvshmem.py's route)."""
    global _nvshmem_kernel
    if _nvshmem_kernel is None:
        from torch.distributed._symmetric_memory import _nvshmem_triton

        _nvshmem_kernel = _nvshmem_triton.requires_nvshmem(network_exchange_nvshmem_kernel)
    return _nvshmem_kernel


def _nvshmem(rail: Group) -> bool:
    """Whether the rail's exchange is weft's kernel over NVSHMEM (GPUs, WEFT_RAIL=nvshmem at init)."""
    return rail.world.rail_route == "nvshmem"


def _rail_through_process_group(rail: Group) -> bool:
    """Whether the rail's exchange is its process group's collective (GPUs on the default route: NCCL), not weft's
    exchange kernel (the cpu backend's simulated network, or NVSHMEM with WEFT_RAIL=nvshmem)."""
    return not backend.INTERPRET and not _nvshmem(rail)


def _exchange_nvshmem(rail: Group, src: torch.Tensor, block_bytes: int, all_to_all: bool) -> torch.Tensor:
    """`_exchange` on GPUs over NVSHMEM: the kernel copies the received slots to the output itself (a CUDA graph
    knows no host-side call parity), in passes of one slot, each over (rail size, chunks) programs."""
    ws = workspace(rail, "rail_nvshmem", NvshmemRailWorkspace)
    kernel = _nvshmem_exchange_kernel()
    out = torch.empty((rail.size, block_bytes), dtype=torch.uint8, device=src.device)
    src = src.reshape(-1).view(torch.uint8)
    stride = block_bytes if all_to_all else 0
    for lo in range(0, block_bytes, ws.slot_bytes):
        hi = min(lo + ws.slot_bytes, block_bytes)
        chunk, chunks = ws.chunking(hi - lo)
        kernel[(rail.size, chunks)](src[lo:], out[:, lo:], ws.stage, ws.recv, ws.flags, ws.counter,
                                    rail.heap.descriptor, hi - lo, stride, ws.slot_bytes, block_bytes, chunk,
                                    W=rail.size, MAX_CHUNKS=ws.max_chunks, BLOCK=4096)
    return out


def _exchange(rail: Group, src: torch.Tensor, block_bytes: int, all_to_all: bool) -> torch.Tensor:
    """(rail size, block_bytes) uint8: row i is member i's block (all_gather: its `src`; all-to-all: row me of
    its `src`, which holds one block per member), through the network kernel in passes of one slot."""
    if _nvshmem(rail):
        return _exchange_nvshmem(rail, src, block_bytes, all_to_all)
    ws = workspace(rail, "rail", RailWorkspace)
    w = rail.size
    out = torch.empty((w, block_bytes), dtype=torch.uint8, device=src.device)
    src = src.reshape(-1).view(torch.uint8)
    stride = block_bytes if all_to_all else 0
    for lo in range(0, block_bytes, ws.slot_bytes):
        hi = min(lo + ws.slot_bytes, block_bytes)
        ws.calls += 1
        half = ws.recv[ws.calls % 2]
        network_exchange_kernel[(1,)](src[lo:], half, ws.flags, rail.heap.descriptor, hi - lo, stride,
                                      ws.slot_bytes, ws.calls, W=w, BLOCK=1024)
        out[:, lo:hi] = half[:, :hi - lo]  # before the next call's puts into this half (two calls on)
    return out


def _combine(rows: torch.Tensor, op: str) -> torch.Tensor:
    """The reduction of the rows of `rows` in row order (16-bit floats accumulated in fp32)."""
    acc = rows[0].float() if rows.dtype in (torch.float16, torch.bfloat16) else rows[0].clone()
    for row in rows[1:]:
        if op == "sum":
            acc += row
        elif op == "product":
            acc *= row
        elif op == "max":
            acc = torch.maximum(acc, row.to(acc.dtype))
        else:
            acc = torch.minimum(acc, row.to(acc.dtype))
    return acc.to(rows.dtype)


def _rail_all_reduce(rail: Group, part: torch.Tensor, op: str) -> torch.Tensor:
    if rail.size == 1:
        return part
    if _rail_through_process_group(rail):
        dist.all_reduce(part, op=getattr(dist.ReduceOp, op.upper()), group=rail.process_group)
        return part
    rows = _exchange(rail, part, part.numel() * part.element_size(), all_to_all=False)
    return _combine(rows.view(part.dtype).view(rail.size, -1), op)


def _rail_reduce_scatter(rail: Group, blocks: torch.Tensor, op: str) -> torch.Tensor:
    """blocks: (rail size, m); returns (m,), member i's row i reduced over the rail."""
    if rail.size == 1:
        return blocks[0]
    if _rail_through_process_group(rail):
        out = torch.empty(blocks.shape[1], dtype=blocks.dtype, device=blocks.device)
        nccl_reduce_scatter(out, blocks.reshape(-1), rail.process_group, op=getattr(dist.ReduceOp, op.upper()))
        return out
    rows = _exchange(rail, blocks, blocks.shape[1] * blocks.element_size(), all_to_all=True)
    return _combine(rows.view(blocks.dtype).view(rail.size, -1), op)


def _rail_all_gather(rail: Group, shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """shard: (m,) bytes of any dtype; returns (rail size, m), into `out` (contiguous) when given."""
    if rail.size == 1:
        return shard.view(1, -1) if out is None else out.copy_(shard.view(1, -1))
    if _rail_through_process_group(rail):
        if out is None:
            out = torch.empty((rail.size, shard.numel()), dtype=shard.dtype, device=shard.device)
        nccl_all_gather(out.view(-1), shard, rail.process_group)
        return out
    rows = _exchange(rail, shard, shard.numel() * shard.element_size(), all_to_all=False).view(shard.dtype)
    return rows if out is None else out.copy_(rows)


def _rail_all_to_all(rail: Group, blocks: torch.Tensor, rows: torch.Tensor, keep: int) -> None:
    """blocks: (rail size, m) contiguous; rows[i] = member i's blocks[me], for every member i but `keep` (this
    member's rail rank: its row is its own business, written by the caller). rows: (rail size, m), contiguous."""
    if _rail_through_process_group(rail):
        # NCCL's all-to-all of every row but my own (none sent to or received from myself: the caller may be
        # writing rows[keep] on another stream meanwhile).
        none = blocks.new_empty(0)
        dist.all_to_all([none if i == keep else rows[i] for i in range(rail.size)],
                        [none if i == keep else blocks[i] for i in range(rail.size)], group=rail.process_group)
        return
    got = _exchange(rail, blocks, blocks.shape[1] * blocks.element_size(), all_to_all=True).view(blocks.dtype)
    for i in range(rail.size):
        if i != keep:
            rows[i] = got[i]


# -- the node and rail groups -----------------------------------------------------------------------------------

class Hierarchy:
    """A spanning group's two levels, seen from this member: `node` (this node's members, a Group), `rail` (the
    members at this member's place on every node), and `rails[j]`: the group ranks of rail j in rail order."""

    def __init__(self, group: Group):
        # Before the node and rail groups' process groups: the NVSHMEM rail takes only the world's hierarchy.
        check_heap_route(group.world.rail_route, group.ranks, group.world.node_ids)
        topo = group.topology
        self.group = group
        mine = topo.nodes[topo.node_index[group.rank]]
        j = topo.local_index[group.rank]
        self.local_size = len(mine)
        # Rail order is world order, which for a group is group-rank order.
        self.rails = [sorted(members[i] for members in topo.nodes) for i in range(self.local_size)]
        # Every member makes its node's group first, then its rail's: the same order on every rank. The node's
        # heap holds seven workspaces: the reduce and all_gather families', ag_gemm's and gemm_rs's two (receive
        # and send), the Ulysses family's (with its flags) and gemm_ar's.
        from .ulysses import flag_bytes
        self.node = _subgroup(group, [group.ranks[i] for i in mine], extra_families=7,
                              extra_bytes=flag_bytes(len(mine))) if len(mine) > 1 else None
        self.rail = _subgroup(group, [group.ranks[i] for i in self.rails[j]], extra_families=1)
        # The side stream the rail's NCCL calls of ag_gemm and gemm_rs run on, beside the node's kernels.
        self.streams = StreamSet(group.device, 1) if group.device.type == "cuda" else None


def _subgroup(parent: Group, world_ranks: list[int], extra_families: int, extra_bytes: int = 0) -> Group:
    """The Group of `world_ranks` for the hierarchical ops (made among those ranks only, once per world), with a
    heap of `extra_families` workspaces, `extra_bytes` (flags beyond them), the heap's tail (the p2p workspace:
    weft/runtime/heap.py) and some room; its heap made by every member of `parent` at the same point (every member
    makes its node's and its rail's in turn)."""
    w = parent.world
    cache = w.__dict__.setdefault("hierarchy_groups", {})
    key = tuple(world_ranks)
    found = cache.get(key)
    if found is None:
        # Named after the parent and the ranks, never torch's local new_group: its name counts the groups each
        # process registered, which differs between members after a group only some of them made (a hang).
        pg = member_process_group(parent.process_group, "hierarchy", key)
        w.made_groups.append(pg)
        heap_size = (extra_families + 1) * parent.workspace_bytes + extra_bytes + (1 << 20)
        found = cache[key] = Group(w, pg, key, heap_size, parent.workspace_bytes, heap_makers=parent.ranks)
        w.groups[found.name] = found
    return found


def hierarchy(group: Group) -> Hierarchy | None:
    """The group's Hierarchy (made on first use, collectively among its members), or None when its nodes hold
    different numbers of its members (no rails)."""
    if not group.topology.uniform:
        return None
    return group.context("hierarchy", lambda: Hierarchy(group))


# -- the ops ------------------------------------------------------------------------------------------------------

def _finish_avg(t: torch.Tensor, size: int) -> torch.Tensor:
    """The average from the sum: an integer's divided toward zero (NCCL's), a float's divided."""
    if t.is_floating_point():
        return t.div_(size)
    return t.div_(size, rounding_mode="trunc")


class AllReduce:
    """all_reduce of n elements over a spanning group: node reduce_scatter, rail all_reduce, node all_gather.
    `run(x, out)` is the plan's run: `check(x, out)` first (the plan's own), the result into `out` when given.

    The node's reduce_scatter and all_gather are their plans, made on the first call and then run directly: no
    op dispatch, group resolution or plan key per call (host cost: docs/nodes.md). x goes to the node's
    reduce_scatter as it is when its n elements split evenly among the node's members (that op only reads it),
    else through a zero-padded copy."""

    def __init__(self, group: Group, h: Hierarchy, shape, op: str, check):
        self.group, self.h, self.shape, self.op, self.check = group, h, tuple(shape), op, check
        self.n = n = int(torch.Size(shape).numel())
        self.chunk = triton.cdiv(n, h.local_size)
        self.padded = self.chunk * h.local_size != n
        self.hop = "sum" if op == "avg" else op  # the op of both levels; avg divides once at the end
        self.node_rs = self.node_ag = None  # the node's plans' runs (first call)

    def run(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        self.check(x, out)
        if out is not None and self.h.local_size == 1 and out.is_contiguous():
            # One member per node: the rail's all_reduce (in place on GPUs) on `out` itself, x copied there
            # first (not at all in place): one copy fewer than reducing a copy of x and copying that to out.
            if out is not x:
                out.copy_(x)
            flat = out.view(-1)
            res = self.finish(_rail_all_reduce(self.h.rail, flat, self.hop))
            if res.data_ptr() != flat.data_ptr():  # the cpu backend's rail sums into a new tensor
                flat.copy_(res)
            return out
        res = self.reduce(x)
        return res if out is None else out.copy_(res)

    def finish(self, part: torch.Tensor) -> torch.Tensor:
        return _finish_avg(part, self.group.size) if self.op == "avg" else part

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The reduced values, a new contiguous tensor of x's shape."""
        h, n, chunk = self.h, self.n, self.chunk
        flat = x.reshape(-1)
        if h.local_size > 1:
            if self.padded:
                blocks = torch.empty((h.local_size, chunk), dtype=x.dtype, device=x.device)
                blocks.view(-1)[:n] = flat
                blocks.view(-1)[n:] = 0  # the padding's results are dropped; zeros keep them finite
            else:
                blocks = flat.view(h.local_size, chunk)
            if self.node_rs is None:
                from .all_reduce import ReduceScatterPlan
                self.node_rs = ReduceScatterPlan(h.node, blocks, self.hop, None, "auto").run
            part = self.node_rs(blocks, None)
        else:
            part = flat.clone()  # the rail's all_reduce is in place
        part = self.finish(_rail_all_reduce(h.rail, part, self.hop))
        if h.local_size > 1:
            part = part.view(1, chunk)
            if self.node_ag is None:
                from .all_gather import AllGatherPlan
                self.node_ag = AllGatherPlan(h.node, part, None, "auto").run
            part = self.node_ag(part, None).view(-1)
            if self.padded:
                part = part[:n]
        return part.view(self.shape)


class ReduceScatter:
    """reduce_scatter over a spanning group: blocks reordered by rail, node reduce_scatter, rail reduce_scatter.
    `run(x, out)` as AllReduce's, the node's reduce_scatter as there (its plan, made on the first call). With one
    member per node the rail order is group order: no reorder."""

    def __init__(self, group: Group, h: Hierarchy, shape, op: str, check):
        self.group, self.h, self.shape, self.op, self.check = group, h, tuple(shape), op, check
        self.hop = "sum" if op == "avg" else op
        order = [g for rail in h.rails for g in rail]
        self.order = None if order == list(range(group.size)) else torch.tensor(order, device=group.device)
        self.node_rs = None

    def run(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        self.check(x, out)
        res = self.reduce(x)  # a new tensor (the rail's result): an in-place out (a block of x) is safe
        return res if out is None else out.copy_(res)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        h, w = self.h, self.group.size
        blocks = x.reshape(w, -1)
        m = blocks.shape[1]
        if self.order is None:  # one member per node: the rail is the group, in its order
            mine = blocks if blocks.is_contiguous() else blocks.contiguous()
        else:
            stacked = blocks.index_select(0, self.order).view(h.local_size, -1)  # [rail j][rail member i]
            if self.node_rs is None:
                from .all_reduce import ReduceScatterPlan
                self.node_rs = ReduceScatterPlan(h.node, stacked, self.hop, None, "auto").run
            mine = self.node_rs(stacked, None).view(-1, m)
        res = _rail_reduce_scatter(h.rail, mine, self.hop).reshape(self.shape)
        if self.op == "avg":
            res = _finish_avg(res, w)
        return res


class AllGather:
    """all_gather over a spanning group: rail all_gather, node all_gather, blocks back in group order.
    `run(x, out)` as AllReduce's. With one member per node the rail's gather is the whole result, in group
    order: straight into the output; else the node's all_gather as AllReduce's (its plan, made on the first call)."""

    def __init__(self, group: Group, h: Hierarchy, shape, dtype: torch.dtype, check):
        self.group, self.h, self.shape, self.dtype, self.check = group, h, tuple(shape), dtype, check
        order = [g for rail in h.rails for g in rail]
        self.order = None if order == list(range(group.size)) else torch.tensor(order, device=group.device)
        self.node_ag = None

    def run(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        self.check(x, out)
        if out is not None and out.is_contiguous():
            self.gather(x, out)
            return out
        dst = torch.empty(self.shape, dtype=self.dtype, device=x.device)
        self.gather(x, dst)
        return dst if out is None else out.copy_(dst)

    def gather(self, x: torch.Tensor, dst: torch.Tensor) -> None:
        """Gather x into `dst` (contiguous, the op's output shape)."""
        h = self.h
        shard = x.reshape(-1)
        if not shard.is_contiguous():
            shard = shard.contiguous()
        if self.order is None:
            _rail_all_gather(h.rail, shard, dst.view(self.group.size, -1))
            return
        rail_rows = _rail_all_gather(h.rail, shard).view(1, -1)
        if self.node_ag is None:
            from .all_gather import AllGatherPlan
            self.node_ag = AllGatherPlan(h.node, rail_rows, None, "auto").run
        gathered = self.node_ag(rail_rows, None)
        dst.view(self.group.size, -1).index_copy_(0, self.order, gathered.view(self.group.size, -1))


class AgGemm:
    """ag_gemm (the overlap method) over a spanning group: the rail's all_gather of the shards brings every member
    the shards at its place on the other nodes, while the node's overlapped ag_gemm computes the rows of its own
    node's members; then the node's ag_gemm of each other node's shards (every member holds one of them, the
    node's gather brings it the rest), nodes in order from the next one. Every block goes straight into its rows
    of the output (a node's members are consecutive group ranks).

    What overlaps: on GPUs the rail's all_gather (NCCL, on the hierarchy's side stream) runs beside the node's
    ag_gemm of its own block (the main stream waits for it only before the first other node's block), and inside
    every node ag_gemm the node's gather runs under its GEMM (copy engines, NVLink). What does not: the other
    nodes' blocks start after the whole rail all_gather (one NCCL call, not chunk by chunk), and on the cpu backend
    everything runs in turn (rail exchange, then the node ag_gemms). Every row is the same GEMM tile code with the
    same tiling (the flat op's: `config`) over the same K order as in the flat op: bit for bit its result, except
    with one member per node, where a node's block is torch.matmul (as on a group of one)."""

    def __init__(self, group: Group, h: Hierarchy, a_shard: torch.Tensor, b: torch.Tensor, config,
                 return_gathered: bool):
        topo = group.topology
        self.group, self.h, self.config, self.return_gathered = group, h, config, return_gathered
        (self.m, self.k), self.n = a_shard.shape, b.shape[1]
        self.dtype, self.device = a_shard.dtype, a_shard.device  # a plan keeps no caller tensor
        self.node_count = len(topo.nodes)
        mine = topo.node_index[group.rank]
        self.order = [(mine + i) % self.node_count for i in range(self.node_count)]  # my node's block first

    def run(self, a_shard: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None):
        """The plan's run: c (W * m, N) into `out` (contiguous: the plan checked it) or a new tensor; with
        return_gathered (c, gathered A)."""
        h, m, k, nodes = self.h, self.m, self.k, self.node_count
        res = torch.empty((self.group.size * m, self.n), dtype=self.dtype, device=self.device) if out is None else out
        blocks = res.view(nodes, h.local_size * m, self.n)
        gathered = torch.empty((nodes, h.local_size * m, k), dtype=self.dtype, device=self.device) \
            if self.return_gathered else None
        shards = torch.empty((nodes, m * k), dtype=self.dtype, device=self.device)  # row i: rail member i's shard
        streams = h.streams
        if streams is None:
            _rail_all_gather(h.rail, a_shard.view(-1), shards)
        else:
            main, side = streams.current(), streams.sides[0]
            streams.wait(side, main)  # a_shard is written
            streams.run_on(side, main, _rail_all_gather, h.rail, a_shard.view(-1), shards)
        for step, node in enumerate(self.order):
            if step == 1 and streams is not None:
                streams.wait(main, side)  # the other nodes' shards are here
            shard = a_shard if step == 0 else shards[node].view(m, k)
            self._node_ag_gemm(shard, b, blocks[node], None if gathered is None else gathered[node])
        return (res, gathered.view(-1, k)) if self.return_gathered else res

    def _node_ag_gemm(self, shard, b, dst, gathered_dst):
        from .ag_gemm import ag_gemm

        if self.h.node is None:  # one member per node: its block is its shard's product
            torch.matmul(shard, b, out=dst)
            if gathered_dst is not None:
                gathered_dst.copy_(shard)
            return
        got = ag_gemm.eager(shard, b, method="overlap", out=dst, return_gathered=gathered_dst is not None,
                            config=self.config, group=self.h.node)
        if gathered_dst is not None:
            gathered_dst.copy_(got[1])


class GemmRS:
    """gemm_rs (the overlap method) over a spanning group: for each node k, the node's overlapped gemm_rs of the
    rows destined to node k's members (member j of my node gets my node's sum for node k's member j, the member
    of its rail on node k), the other nodes' blocks first, my node's last; then each member sends the rail the
    node sums it holds for the others (network: (N - 1) blocks of M / W rows per member, 1/L of the partials'
    bytes, as the hierarchical reduce_scatter's) and adds what it receives.

    Sum order: inside a node, the node's gemm_rs (its members' partials, each rounded to the dtype once, summed in
    fp32 in node-rank order, rounded); across nodes, the N node sums in node order, in fp32 for 16-bit dtypes,
    rounded once. The same on every call and on both backends; not the flat op's order (which sums all W
    partials in one fp32 sum), so it matches torch within the dtype's tolerance, not bit for bit.

    What overlaps: on GPUs the rail's exchange (NCCL's all-to-all on the hierarchy's side stream) starts when the
    other nodes' sums are done and runs beside the node's gemm_rs of my own node's block; inside each node gemm_rs
    the pushes run under the chunk GEMMs. What does not: the exchange waits for every other node's block (one
    NCCL call), and the final sum for the exchange; on the cpu backend everything runs in turn."""

    def __init__(self, group: Group, h: Hierarchy, a: torch.Tensor, b_shard: torch.Tensor, config):
        topo = group.topology
        self.group, self.h, self.config = group, h, config
        self.m, self.n = a.shape[0] // group.size, b_shard.shape[1]
        self.dtype, self.device = a.dtype, a.device  # a plan keeps no caller tensor
        self.node_count = nodes = len(topo.nodes)
        self.mine = mine = topo.node_index[group.rank]
        # A node's members are consecutive group ranks: the rows destined to node i are one slice of a.
        self.rows = [(members[0] * self.m, (members[-1] + 1) * self.m) for members in topo.nodes]
        self.others = [(mine + i) % nodes for i in range(1, nodes)]

    def run(self, a: torch.Tensor, b_shard: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The plan's run: my (M / W, N) rows of the sum, into `out` (any layout) or a new tensor."""
        h, m, n, nodes, mine = self.h, self.m, self.n, self.node_count, self.mine
        sums = torch.empty((nodes, m * n), dtype=self.dtype, device=self.device)  # row i: for node i's rail member
        rows = torch.empty((nodes, m * n), dtype=self.dtype, device=self.device)  # row i: node i's sum for me
        for node in self.others:
            self._node_gemm_rs(a, b_shard, node, sums[node])
        streams = h.streams
        if streams is None:
            _rail_all_to_all(h.rail, sums, rows, mine)
        else:
            main, side = streams.current(), streams.sides[0]
            streams.wait(side, main)  # the other nodes' sums are done
            streams.run_on(side, main, _rail_all_to_all, h.rail, sums, rows, mine)
        self._node_gemm_rs(a, b_shard, mine, rows[mine])
        if streams is not None:
            streams.wait(main, side)
        total = _combine(rows, "sum").view(m, n)
        return total if out is None else out.copy_(total)

    def _node_gemm_rs(self, a, b_shard, node, dst):
        """My node's sum for node `node`'s member at my place, into dst (m * n,)."""
        from .gemm_rs import gemm_rs

        lo, hi = self.rows[node]
        dst = dst.view(self.m, self.n)
        if self.h.node is None:  # one member per node: the node's sum is my own partial
            torch.matmul(a[lo:hi], b_shard, out=dst)
        else:
            gemm_rs.eager(a[lo:hi], b_shard, method="overlap", out=dst, config=self.config, group=self.h.node)


class SpFlashDecode:
    """sp_flash_decode over a spanning group: every member computes the partial (out, lse) of its KV slice as the
    flat op does (the split kernel, then its splits merged: flash_decode's merge kernel, in fp32), the W
    members' partials (batch * q_heads rows of head_dim + 1 fp32 words: small) are gathered by the group's
    all_gather (hierarchical: the rail's exchange, then the node's kernels; bit for bit), and every member
    merges them itself, in group-rank order: lse_max = max over members (an empty slice's lse is -inf and
    weighs nothing), then acc += exp(lse_r - lse_max) out_r and l += exp(lse_r - lse_max) for r = 0, 1, ...,
    W - 1 in fp32, out = acc / l rounded to q's dtype. The same code on the same gathered bits: every member
    gets the same bits. Not the flat op's bits (its merge is one vector sum over ranks in its kernel): the same
    attention within the dtype's tolerance. No passes (the all_gather goes through in its own), no workspace of
    its own: the all_gather's (node) and the rail exchange's are the only symmetric memory it uses.

    `run` is the plan's: a bad length or page an earlier call recorded is raised after this call's collective
    part, as the flat op does (the peers wait for this member's partials)."""

    def __init__(self, group: Group, q, k_cache, v_cache, seqlens, block_table, scale, max_len, page_size, errors):
        from . import flash_decode as fd
        from .common import Launch

        self.group, self.errors = group, errors
        batch, self.q_heads, self.head_dim = q.shape
        self.rows, self.max_len, self.paged = batch * self.q_heads, max_len, block_table is not None
        self.split, self.split_args, self.splits, self.split_unit = fd._split_launch(
            fd._prepare_q(q), k_cache, v_cache, seqlens, block_table, scale, max_len, page_size, errors, 1)
        part_out, part_lse = fd._partial_buffers(self.rows, self.splits, self.head_dim, q.device)
        local_out = torch.empty((self.rows, self.head_dim), dtype=torch.float32, device=q.device)
        local_lse = torch.empty((self.rows,), dtype=torch.float32, device=q.device)
        self.merge = Launch(fd.flash_decode_merge_kernel, (self.rows,),
                            (part_out, part_lse, seqlens, local_out, local_lse, max_len, self.split_unit, self.splits,
                             self.q_heads),
                            dict(D=self.head_dim, SPLIT_BLOCK=fd.SPLIT_BLOCK, RETURN_LSE=True), num_warps=4)

    def run(self, q, k_cache, v_cache, seqlens, block_table):
        from . import flash_decode as fd
        from .all_gather import all_gather

        q = fd._prepare_q(q)
        recorded = self.errors.take()
        rows, d, w = self.rows, self.head_dim, self.group.size
        part_out, part_lse = fd._partial_buffers(rows, self.splits, d, q.device)
        self.split(*self.split_args(q, k_cache, v_cache, seqlens, block_table if self.paged else seqlens, part_out,
                                    part_lse))
        local_out = torch.empty((rows, d), dtype=torch.float32, device=q.device)
        local_lse = torch.empty((rows,), dtype=torch.float32, device=q.device)  # natural log
        self.merge(part_out, part_lse, seqlens, local_out, local_lse, self.max_len, self.split_unit, self.splits,
                   self.q_heads)
        parts = all_gather.eager(torch.cat([local_out, local_lse[:, None]], dim=1), group=self.group)
        parts = parts.view(w, rows, d + 1)
        lse = parts[:, :, d]
        top = lse.amax(dim=0)
        top = torch.where(top == float("-inf"), 0.0, top)  # every slice empty: all weights 0, out 0
        acc = torch.zeros((rows, d), dtype=torch.float32, device=q.device)
        total = torch.zeros((rows,), dtype=torch.float32, device=q.device)
        for r in range(w):  # group-rank order, on every member
            weight = torch.exp(lse[r] - top)
            acc += weight[:, None] * parts[r, :, :d]
            total += weight
        out = (acc / torch.where(total > 0, total, 1.0)[:, None]).to(q.dtype).view(q.shape)
        if recorded is not None:
            raise recorded
        return out


class UlyssesAllToAll:
    """ulysses_all_to_all over a spanning group, in two levels. Member (k, j) (node k, place j; a node's members
    are consecutive group ranks) has one block of n = S * P rows for every member (k', j'), each row H / W *
    head_dim elements. First the node's all-to-all (the flat op on the node's group: weft's kernels, NVLink):
    member (k, j) sends its node's member j' every block destined to rail j' (the members (k', j') of every
    node k'); then the rail's all-to-all (the network): member (k, j') sends rail member (k', j') the L blocks
    its node holds for it, one message of L blocks per other node. Each member's bytes that must cross nodes,
    (N - 1) / N of its data, go over its own rail (its NIC) in N - 1 messages rather than (N - 1) L: each NIC
    carries 1/L of its node's traffic. The blocks are reordered around the exchanges so that both move contiguous
    blocks (scatter="heads": one copy between the two; "seq": one before the node's and one after the rail's).
    Pure data movement: bit for bit the flat op's result."""

    def __init__(self, group: Group, h: Hierarchy, seq: int, packed: int, head_block: int, shape, scatter: str,
                 method: str, dtype: torch.dtype):
        self.group, self.h, self.shape, self.scatter, self.method, self.dtype = group, h, tuple(shape), scatter, \
            method, dtype
        self.n, self.row = seq * packed, head_block  # rows per block, elements per row
        self.nodes = group.size // h.local_size
        self.mine = group.topology.node_index[group.rank]  # my rail rank

    def run(self, x: torch.Tensor) -> torch.Tensor:
        from .ulysses import ulysses_all_to_all

        h, n, row, nodes, mine = self.h, self.n, self.row, self.nodes, self.mine
        local = h.local_size
        x = x if x.is_contiguous() else x.contiguous()
        out = torch.empty(self.shape, dtype=self.dtype, device=x.device)
        if self.scatter == "heads":
            # x (n, N, L, row): row s of the block for member (k', j'). The node's heads all-to-all over j' gives
            # (L, n, N, row): row s of member (k, j)'s block for (k', me's place), from every node member j.
            got = x.view(n * nodes, local, row) if h.node is None else \
                ulysses_all_to_all.eager(x.view(n * nodes, local, row), "heads", method=self.method, group=h.node)
            blocks = got.view(local, n, nodes, row).permute(2, 0, 1, 3).contiguous().view(nodes, -1)  # by node k'
            # From rail member k: (L, n, row), the blocks of members (k, 0..L-1) for me: out (W, n, row) as is.
            rows = out.view(nodes, -1)
        else:
            # x (N, L, n, row): the block for member (k', j') whole. Blocks by place j' first, then the node's
            # seq all-to-all gives (N, n, L, row): for node k', row s of every node member j's block.
            by_place = x.view(nodes, local, n, row).transpose(0, 1).contiguous()
            got = by_place if h.node is None else \
                ulysses_all_to_all.eager(by_place.view(local * nodes * n, 1, row), "seq", method=self.method,
                                         group=h.node)
            blocks = got.view(nodes, -1)
            rows = torch.empty((nodes, n * local * row), dtype=self.dtype, device=x.device)
        rows[mine] = blocks[mine]
        _rail_all_to_all(h.rail, blocks, rows, mine)
        if self.scatter == "seq":  # from rail member k: (n, L, row); out (n, N, L, row)
            out.view(n, nodes, local, row).copy_(rows.view(nodes, n, local, row).transpose(0, 1))
        return out


class GemmAr:
    """gemm_ar over a spanning group: the node's gemm_ar (its fused kernel where the flat op would take it, over
    NVLink; torch.matmul with one member per node), then the rail's all_reduce of the node sums (the network: every
    member its rail's, the whole (M, N): decode-sized). Sum order: each node's sum as its gemm_ar makes it (fp32,
    rounded to the dtype), then the N node sums (on the cpu backend in node order in fp32, rounded once; on GPUs
    NCCL's all_reduce): within the dtype's tolerance of the flat op, the same bits on every member.
    `run(a, b_shard, out)` is the plan's run (`check` first)."""

    def __init__(self, group: Group, h: Hierarchy, method: str, check):
        self.group, self.h, self.method, self.check = group, h, method, check

    def run(self, a: torch.Tensor, b_shard: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        from .gemm_ar import gemm_ar

        self.check(a, b_shard, out)
        if self.h.node is None:  # one member per node: its partial is its node's sum
            part = torch.matmul(a, b_shard)
        else:
            part = gemm_ar.eager(a, b_shard, method=self.method, group=self.h.node)
        total = _rail_all_reduce(self.h.rail, part, "sum").view(part.shape)
        return total if out is None else out.copy_(total)


# The sm_90 compile check (weft.testing.compile): the cpu rail's kernel must stay compilable; the NVSHMEM one is
# compiled to a relocatable cubin (ptxas -c), its NVSHMEM calls left for libnvshmem_device.bc, linked in on GPUs.
COMPILE_CASES = [
    *[(network_exchange_kernel, dict(src="*u8", recv="*u8", flags="*i32", heap="*i64", nbytes="i32",
                                     src_stride="i32", slot_bytes="i32", epoch="i32"), dict(W=w, BLOCK=1024))
      for w in (2, 4)],
    *[(network_exchange_nvshmem_kernel,
       dict(src="*u8", out="*u8", stage="*u8", recv="*u8", flags="*i64", counter="*i32", heap="*i64", nbytes="i32",
            src_stride="i32", slot_bytes="i32", out_stride="i32", chunk_bytes="i32"),
       dict(W=w, MAX_CHUNKS=128 // w, BLOCK=4096),
       {"ptx_options": "-c", "unaligned": ("src", "out"), "divisible": ("slot_bytes", "chunk_bytes")})
      for w in (2, 4)],
]
