"""Mixture-of-experts through the symmetric heap: routing, expert-parallel dispatch and combine, grouped GEMMs,
and tensor-parallel MoE. One idea per module, each op next to its kernels:

- routing: the router (router_topk), the routing layout (routing_layout), and the checks of topk_idx
  (check_routing_values on the host; on the device check_rows and the error word the ops raise from).
- ep_ht: high-throughput EP (prefill), ep_dispatch / ep_combine: each token once to every rank that holds one
  of its experts, offsets from a device-side count exchange, one host sync (none with max_recv_tokens).
- ep_ll: low-latency EP (decode), ep_dispatch_ll / ep_combine_ll: one launch each, LL words, no host sync,
  CUDA-graph capturable; return_recv_hook=True splits either op into a send and a receive hook.
- ep_nodes: the EP ops (both) on a group that spans nodes: each token once per target node over the rail's
  all-to-all, then the node's all-to-all to its experts' ranks (docs/nodes.md).
- ep_workspace: the symmetric workspace the EP ops share, and the rows as their kernels move them.
- grouped_gemm: grouped_gemm, the experts' GEMM between dispatch and combine (bf16 / fp16 / fp32, and fp8 with
  block scales: fp8_blocks), and the grouped GEMM tile the tensor-parallel ops use.
- group_layout: GroupLayout, every (token, expert) pair's row sorted by expert on the device, and the weighted
  top-k sum that brings a token's rows back together.
- tp: tensor-parallel MoE over sequence-parallel tokens, ag_group_gemm / group_gemm_rs.
- routed: routed_gemm / routed_gemm_sum, the tensor-parallel ops' one-rank form as local ops (the grouped MLP
  of an EP rank's received rows).

The collective ops (EP and tensor-parallel) take `group=None` (the world) and run over that group's ranks: W is
its size, and experts are split contiguously over its ranks: group rank r owns experts [r * L, (r + 1) * L),
L = E / W. Each group has its own workspaces, error words and plans; the operators take the group by name.
`topk_idx` (tokens x k) names each token's experts (-1: none); a row must not name an expert twice. The ops
check the rows on the device as they read them (no host sync): a bad row is recorded in an error word and
raised as a ValueError by the family's next op on that rank (routing). So is a count, row number or layout a
peer sent that does not fit this rank's call: every index that comes from a tensor is bounds-checked before
it addresses memory.
"""
from .ep_ht import HTHandle, ep_combine, ep_dispatch
from .ep_ll import LLHandle, RecvHook, ep_combine_ll, ep_dispatch_ll
from .group_layout import GroupLayout
from .grouped_gemm import fp8_blocks, grouped_gemm
from .routed import routed_gemm, routed_gemm_sum
from .routing import Layout, check_routing_values, router_topk, router_topk_torch, routing_layout
from .tp import ag_group_gemm, group_gemm_rs

__all__ = ["router_topk", "router_topk_torch", "routing_layout", "Layout", "check_routing_values", "ep_dispatch",
           "ep_combine", "HTHandle", "ep_dispatch_ll", "ep_combine_ll", "LLHandle", "RecvHook", "grouped_gemm",
           "fp8_blocks", "GroupLayout", "ag_group_gemm", "group_gemm_rs", "routed_gemm", "routed_gemm_sum"]
