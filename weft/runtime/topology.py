"""Which ranks share a node: the world's nodes, and a group's.

Inside a node peers are reached by loads and stores through the heap's peer mappings (NVLink on GPUs); across
nodes only through the network primitives (`putmem*`, `getmem*`, `signal_op`, `signal_wait_until`), which
the heap descriptor lets the language check: after the W bases it holds each member's node id,

    [my_rank, W, base_0, ..., base_{W-1}, node_0, ..., node_{W-1}]

so `wl.same_node(peer, heap)` is two loads, and the interpreter's `symm_at` raises on an off-node peer.

Ranks per node: WEFT_LOCAL_WORLD_SIZE (simulated nodes on one machine: `weft run -n 4 --local-world-size 2`),
else torchrun's LOCAL_WORLD_SIZE, else all ranks on one node. torchrun numbers ranks node by node, so with L
ranks per node world rank r is on node r // L (every node runs the same number of ranks).
"""
from __future__ import annotations

import os

from . import settings


def local_world_size(world_size: int) -> int:
    """Ranks per node in a world of `world_size` ranks (see the module docstring); ValueError when it does not
    divide the world size."""
    local = settings.get("WEFT_LOCAL_WORLD_SIZE")
    source = "WEFT_LOCAL_WORLD_SIZE"
    if local is None:
        text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        source = "LOCAL_WORLD_SIZE"
        try:
            local = int(text) if text else world_size
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE={text!r}: expected an integer > 0 (set by the launcher)") from None
    if local <= 0 or world_size % local:
        raise ValueError(f"{source}={local}: the ranks per node must divide the world size {world_size}")
    return local


def world_nodes(world_size: int) -> tuple[int, ...]:
    """The node id of every world rank."""
    local = local_world_size(world_size)
    return tuple(r // local for r in range(world_size))


class Topology:
    """The nodes of a group's members. `node_of[i]`: the node id of group rank i; `nodes`: the group ranks on
    each node the group spans, nodes in order of their first member (a tuple of tuples); `spans_nodes`: more
    than one; `node_index[i]`: which entry of `nodes` holds group rank i, `local_index[i]`: its place there;
    `uniform`: every node holds as many members (what the hierarchical ops take)."""

    def __init__(self, node_of):
        self.node_of = tuple(node_of)
        order: dict[int, list[int]] = {}
        for i, node in enumerate(self.node_of):
            order.setdefault(node, []).append(i)
        self.nodes = tuple(tuple(members) for members in order.values())
        self.spans_nodes = len(self.nodes) > 1
        self.node_index = [0] * len(self.node_of)
        self.local_index = [0] * len(self.node_of)
        for k, members in enumerate(self.nodes):
            for j, i in enumerate(members):
                self.node_index[i], self.local_index[i] = k, j
        self.uniform = len({len(m) for m in self.nodes}) == 1

    def __repr__(self) -> str:
        return f"Topology(nodes={[list(m) for m in self.nodes]})"
