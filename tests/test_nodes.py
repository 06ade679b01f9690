"""Nodes (weft/runtime/topology.py, the network primitives, the hierarchical collectives): 4 cpu ranks as 2
simulated nodes of 2 (WEFT_LOCAL_WORLD_SIZE=2), and one slower case of 6 ranks as 3 nodes of 2. Across nodes
only the network primitives work: a kernel's symm_at to another node's rank raises, so an op that cheats fails
here."""
import pytest
import triton
import triton.language as tl

import weft.language as wl
from weft.testing import run_ranks

TWO_NODES = {"WEFT_LOCAL_WORLD_SIZE": "2"}


@triton.jit
def same_node_kernel(out, heap, W: tl.constexpr):
    peers = tl.arange(0, W)
    tl.store(out + peers, wl.same_node(peers, heap).to(tl.int32))


# A put with its signal into slot `me` of every rank, then the wait on my own flags.
@triton.jit
def exchange_kernel(src, recv, flags, heap, n, epoch, W: tl.constexpr):
    me = wl.rank(heap)
    for q in range(W):
        wl.putmem_signal_block(recv + me * n, src, n * 4, flags + me, epoch, wl.SIGNAL_SET, q, heap)
    for q in range(W):
        wl.signal_wait_until(flags + q, wl.CMP_GE, epoch)


@triton.jit
def get_kernel(dst, src, n, peer, heap):
    wl.getmem_block(dst, src, n * 4, peer, heap)


@triton.jit
def cheat_kernel(x, out, peer, heap):
    tl.store(out, tl.load(wl.symm_at(x, peer, heap)))


def _topology_and_language():
    import torch

    import weft

    w = weft.world()
    assert w.nodes == ((0, 1), (2, 3)) and w.topology.spans_nodes
    evens, odds = weft.new_group([0, 2]), weft.new_group([1, 3])
    rail = evens or odds
    pair = weft.new_subgroups(2)
    assert rail.nodes == ((0,), (1,)) and pair.nodes == ((0, 1),) and not pair.topology.spans_nodes

    seen = torch.full((4,), -1, dtype=torch.int32)
    same_node_kernel[(1,)](seen, w.heap.descriptor, W=4)
    assert seen.tolist() == [int(r // 2 == w.rank // 2) for r in range(4)]

    # Across nodes: every rank's put with its signal into slot `me` of every rank, then the wait on my flags.
    n = 5
    src = weft.empty((n,), torch.float32)
    recv = weft.zeros((4 * n,), torch.float32)
    flags = weft.zeros((4,), torch.int32)
    for epoch in (1, 2):
        src.copy_(torch.randn(n, generator=torch.Generator().manual_seed(10 * w.rank + epoch)))
        weft.barrier()
        exchange_kernel[(1,)](src, recv, flags, w.heap.descriptor, n, epoch, W=4)
        want = torch.cat([torch.randn(n, generator=torch.Generator().manual_seed(10 * r + epoch)) for r in range(4)])
        assert torch.equal(recv, want)
        got = torch.full((n,), float("nan"))
        far = (w.rank + 2) % 4
        get_kernel[(1,)](got, src, n, far, w.heap.descriptor)
        assert torch.equal(got, want[far * n:(far + 1) * n])
        weft.barrier()

    out = torch.zeros(1)
    cheat_kernel[(1,)](src, out, w.rank ^ 1, w.heap.descriptor)  # my node's other rank: allowed
    far = (w.rank + 2) % 4
    with pytest.raises(Exception, match=rf"rank {w.rank} \(node {w.rank // 2}\) translated a pointer to rank "
                                        rf"{far} \(node {far // 2}\)"):
        cheat_kernel[(1,)](src, out, far, w.heap.descriptor)
    weft.barrier()
    return True


def test_topology_and_network_primitives_on_two_nodes():
    assert all(run_ranks(_topology_and_language, 4, env=TWO_NODES, timeout=240))
