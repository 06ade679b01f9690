"""The EP ops on a group that spans nodes: ep_dispatch / ep_combine and ep_dispatch_ll / ep_combine_ll (fp8
included) in DeepEP's two hops, the network to the same place on the target node, then NVLink to the expert's
rank, each token sent once per target node. Torch ops and the hierarchy's exchanges (weft/kernels/hierarchical.py);
the single-node kernels are not used (they reach every member with symm_at).

With N nodes of L members (member (k, j): the j-th of node k; group rank r holds experts [r E / W, (r + 1) E / W)):
1. the rail hop (network): member (k, j) sends rail member (k', j) each of its tokens that has an expert on
   node k', once, as one block of C rows per node (C: max_tokens_per_rank for LL, the group's largest token
   count for HT; padding rows marked), through the rail's all-to-all (hierarchical._rail_all_to_all: the
   network kernel on the cpu backend, NCCL on the rail's process group on GPUs); its own node's block stays;
2. the node hop (NVLink): member (k', j) forwards each row it holds to the members of its node that hold one of
   the row's experts, one block of N C rows per member, by all_to_all_single on the node's process group;
3. each member sorts what it received by (source rank, source token), the single-node op's order, and lays the
   rows out as that op's outputs.
A row is [topk_idx (int64, k) | topk_weights (fp32, k; HT only) | source rank, source token (int32; token -1:
padding) | the token's bytes (fp8: its e4m3 bytes and scales, quantized on the sender by fp8_rows_torch, the
kernel's bits)]. The dispatch moves bytes: its outputs are the single-node op's bit for bit (rows past `counts`
aside, undefined in both).

The combine goes back along the dispatch's routes: each member's partial per received row (LL: the weighted
sum of its experts' rows of y, fp32 rounded to y's dtype, as the single-node kernel does; HT: its y row) to the
member that forwarded the row, which sums its node's partials in node-rank order in fp32; those fp32 node sums
over the rail (twice the bytes of 16-bit rows, one rounding less) to the token's rank, which adds the N node sums
in node order in fp32 and rounds once. The single-node op sums all W ranks at once: the same within the dtype's
tolerance, not bit for bit. LL's combine first sends the tokens' weights forward along the same routes (the
experts' ranks weigh their outputs).

Host syncs: LL none (fixed-size blocks). HT one before the rail hop, for the group's largest token count and
whether any member's topk_idx has a bad row (then every member raises, as the single-node op without
max_recv_tokens does), and without max_recv_tokens one more for the rows received. LL treats a bad row as the
single-node op does until it raises (entries outside the experts as none, an expert named twice once, combined
once per naming) but raises nothing across nodes. Memory per call: a few buffers of W C rows (LL: recv's size).
Eager only: the traced operators (torch.compile, autograd) raise on a group that spans nodes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import hierarchical
from ..common import Plan, check_tensor, plan, resolve, signature
from ..pointwise import fp8_rows_torch
from . import ep_ll  # its RecvHook and LL checks (ep_ll imports this module: attributes read at call time)
from .routing import INDEX_DTYPES, _check_routing


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """(R, ...) as (R, bytes), contiguous."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], t.shape[1:].numel() * t.element_size())


def _field(rows: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [lo, hi) of each row as `dtype` (R, (hi - lo) / size)."""
    return rows[:, lo:hi].contiguous().view(dtype)


class Routes:
    """Where one dispatch's rows went, for its combine: rail_src (N, C), my token in each slot of the block to
    rail member n (T: padding); fwd_src (L, N C), the rail row in each slot of the block to node member j (N C:
    padding); order, the received rows sorted (source rank, source token)."""

    def __init__(self, tokens, rail_src, fwd_src, order):
        self.tokens, self.rail_src, self.fwd_src, self.order = tokens, rail_src, fwd_src, order


class NodesHandle:
    """What ep_combine / ep_combine_ll need of a dispatch across nodes: its plan, routes, rows received (HT: R),
    row_of (LL: each sorted row's k flat recv rows, -1 none), and whether its receive ran (LL's hook)."""

    def __init__(self, plan, routes, rows=None, row_of=None, received=True):
        self.plan, self.routes, self.rows, self.row_of, self.received = plan, routes, rows, row_of, received


class NodesPlan(Plan):
    """One dispatch signature's layout across nodes (the row's fields) and the two hops; `ll` picks the op."""

    def __init__(self, group, x, topk_idx, num_experts, ll: bool, fp8: bool, weights: bool):
        super().__init__(group)
        h = hierarchical.hierarchy(group)
        if h is None:
            raise ValueError(f"the EP ops across nodes need as many members of the group on every node, got "
                             f"{group.topology.nodes}")
        topo = group.topology
        self.h, self.ll, self.fp8 = h, ll, fp8
        self.num_experts, self.local = num_experts, num_experts // group.size
        self.k, self.hidden, self.dtype, self.idx_dtype = topk_idx.shape[1], x.shape[1], x.dtype, topk_idx.dtype
        self.nodes, self.mine = len(topo.nodes), topo.node_index[group.rank]
        self.node_ranks = torch.tensor(topo.nodes[self.mine], device=group.device)
        self.node_of_rank = torch.tensor([topo.node_index[r] for r in range(group.size)], device=group.device)
        # Row layout, every field at a multiple of its size: idx int64, weights fp32, ids int32 pairs, data.
        self.w_at = 8 * self.k
        self.ids_at = self.w_at + (4 * self.k if weights else 0)
        self.data_at = self.ids_at + 8
        self.groups = self.hidden // 128 if fp8 else 0
        self.data_bytes = self.hidden + 4 * self.groups if fp8 else self.hidden * x.element_size()
        self.row_bytes = (self.data_at + self.data_bytes + 7) // 8 * 8
        pad = torch.zeros((1, self.row_bytes), dtype=torch.uint8, device=group.device)
        pad[:, :self.w_at] = 255  # idx -1
        pad[:, self.ids_at:self.data_at] = 255  # source rank and token -1
        self.pad = pad
        self.pending = group.context("ep_nodes_pending", dict)  # LL op -> its hook not yet run

    # -- the hops -----------------------------------------------------------------------------------------------

    def _rail(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks (N, ...) for each rail member -> (N, ...) from each (my own block stays)."""
        n = self.nodes
        got = torch.empty_like(blocks)
        got[self.mine] = blocks[self.mine]
        hierarchical._rail_all_to_all(self.h.rail, blocks.view(n, -1), got.view(n, -1), self.mine)
        return got

    def _node(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks (L, ...) for each node member -> (L, ...) from each (all_to_all_single on the node's group)."""
        if self.h.node is None:
            return blocks
        got = torch.empty_like(blocks)
        dist.all_to_all_single(got, blocks, group=self.h.node.process_group)
        return got

    def _forward(self, rows: torch.Tensor, pad: torch.Tensor, routes: Routes) -> torch.Tensor:
        """Rows (T, B) of my tokens along the routes: (L N C, B) received, in arrival order (not yet sorted)."""
        blocks = torch.cat([rows, pad])[routes.rail_src]  # (N, C, B)
        rail_rows = self._rail(blocks).view(-1, rows.shape[1])
        return self._node(torch.cat([rail_rows, pad])[routes.fwd_src]).view(-1, rows.shape[1])

    def _backward(self, partial: torch.Tensor, routes: Routes) -> torch.Tensor:
        """partial (L N C, H) per received row in arrival order -> (T, H) fp32: the node sums in node-rank order
        (by the forwarding member), over the rail, added in node order."""
        L, hdim = self.h.local_size, partial.shape[1]
        got = self._node(partial.view(L, -1, hdim))
        rail_rows = routes.fwd_src.shape[1]
        acc = torch.zeros((rail_rows + 1, hdim), dtype=torch.float32, device=partial.device)
        for j in range(L):
            acc.index_add_(0, routes.fwd_src[j], got[j].float())
        back = self._rail(acc[:rail_rows].view(self.nodes, -1, hdim))
        out = torch.zeros((routes.tokens + 1, hdim), dtype=torch.float32, device=partial.device)
        for n in range(self.nodes):
            out.index_add_(0, routes.rail_src[n], back[n])
        return out[:routes.tokens]

    # -- dispatch -----------------------------------------------------------------------------------------------

    def _rows(self, x, topk_idx, topk_weights, idx):
        """My tokens as rows of bytes (T, row_bytes)."""
        t = x.shape[0]
        parts = [_bytes(idx)]
        if topk_weights is not None:
            parts.append(_bytes(topk_weights))
        me = torch.full((t,), self.group.rank, dtype=torch.int32, device=x.device)
        parts.append(_bytes(torch.stack([me, torch.arange(t, dtype=torch.int32, device=x.device)], dim=1)))
        if self.fp8:
            q, scales = fp8_rows_torch(x)
            parts += [_bytes(q), _bytes(scales)]
        else:
            parts.append(_bytes(x))
        used = sum(p.shape[1] for p in parts)
        if used < self.row_bytes:
            parts.append(torch.zeros((t, self.row_bytes - used), dtype=torch.uint8, device=x.device))
        return torch.cat(parts, dim=1)

    def _send(self, x, topk_idx, topk_weights, cap: int):
        """The rail hop of a dispatch with blocks of `cap` rows: (routes' rail_src, rows got from the rail)."""
        dev, t, n = x.device, x.shape[0], self.nodes
        idx = topk_idx.long()
        idx = torch.where((idx >= 0) & (idx < self.num_experts), idx, -1)  # outside the experts: none
        node = torch.where(idx >= 0, self.node_of_rank[(idx // self.local).clamp(min=0)], -1)
        to_node = (node[:, :, None] == torch.arange(n, device=dev)).any(dim=1)  # (T, N): once per node
        # Slot of each token in each node's block: its place among my tokens to that node (cap: padding).
        slot = torch.where(to_node, to_node.long().cumsum(0) - 1, cap).T
        rail_src = torch.full((n, cap + 1), t, dtype=torch.long, device=dev)
        rail_src.scatter_(1, slot, torch.arange(t, device=dev).expand(n, t))
        rail_src = rail_src[:, :cap]
        rows = self._rows(x, topk_idx, topk_weights, idx)
        got = self._rail(torch.cat([rows, self.pad])[rail_src])
        return rail_src, got.view(-1, self.row_bytes)

    def _receive(self, rail_src, rail_rows, tokens, cap):
        """The node hop and the sort: (Routes, the received rows sorted by (source rank, source token), padding
        last, and the number of real ones (a device tensor))."""
        dev, b, rail_n = rail_rows.device, self.row_bytes, rail_rows.shape[0]
        idx = _field(rail_rows, 0, self.w_at, torch.int64)
        rank = torch.where(idx >= 0, idx // self.local, -1)
        goes = (rank[:, :, None] == self.node_ranks).any(dim=1)  # (N C, L); padding rows name none
        slot = torch.where(goes, goes.long().cumsum(0) - 1, rail_n).T
        fwd_src = torch.full((self.h.local_size, rail_n + 1), rail_n, dtype=torch.long, device=dev)
        fwd_src.scatter_(1, slot, torch.arange(rail_n, device=dev).expand(self.h.local_size, rail_n))
        fwd_src = fwd_src[:, :rail_n]
        got = self._node(torch.cat([rail_rows, self.pad])[fwd_src]).view(-1, b)
        ids = _field(got, self.ids_at, self.data_at, torch.int32).long()
        real = ids[:, 1] >= 0
        key = torch.where(real, ids[:, 0] * cap + ids[:, 1], self.group.size * cap)
        order = torch.argsort(key, stable=True)
        return Routes(tokens, rail_src, fwd_src, order), got[order], real.sum()

    def _local(self, idx: torch.Tensor) -> torch.Tensor:
        """Global experts (R, k) as mine: local index, or -1."""
        lo = self.group.rank * self.local
        return torch.where((idx >= lo) & (idx < lo + self.local), idx - lo, -1)

    def _data(self, rows: torch.Tensor, at: int):
        """The token data of rows, from byte `at`: x's (R, hidden), or fp8's (q (R, hidden), scales (R, groups))."""
        if self.fp8:
            return (_field(rows, at, at + self.hidden, torch.float8_e4m3fn),
                    _field(rows, at + self.hidden, at + self.data_bytes, torch.float32))
        return _field(rows, at, at + self.data_bytes, self.dtype)

    def dispatch_ll(self, x, topk_idx, max_tokens: int, hook: bool):
        """ep_dispatch_ll's outputs (recv, counts, scales, handle[, hook])."""
        if "ep_dispatch_ll" in self.pending:
            raise RuntimeError("ep_dispatch_ll: the receive hook of the previous call (return_recv_hook=True) has "
                               "not run; call it first")
        dev, w, el = x.device, self.group.size, self.local
        cap_rows = w * max_tokens  # recv's rows per expert: every slot of the hops
        recv = torch.empty((el, cap_rows, self.hidden), dtype=torch.float8_e4m3fn if self.fp8 else self.dtype,
                           device=dev)
        scales = torch.empty((el, cap_rows, self.groups), dtype=torch.float32, device=dev) if self.fp8 else None
        counts = torch.empty((el,), dtype=torch.int32, device=dev)
        rail_src, rail_rows = self._send(x, topk_idx, None, max_tokens)
        handle = NodesHandle(self, None, received=not hook)

        def receive():
            routes, rows, _ = self._receive(rail_src, rail_rows, x.shape[0], max_tokens)
            local = self._local(_field(rows, 0, self.w_at, torch.int64))
            ee = torch.arange(el, device=dev)
            has = (local[:, :, None] == ee).any(dim=1)  # (rows, L): a token naming an expert twice once
            pos = has.long().cumsum(0) - 1
            dest = torch.where(has, ee * cap_rows + pos, el * cap_rows)
            # Each row's bytes to its experts' rows (index_put on bytes: fp8 has no CPU index_put); the padding
            # and the experts not named go to one spare row.
            data = rows[:, self.data_at:self.data_at + self.data_bytes]
            flat = torch.empty((el * cap_rows + 1, self.data_bytes), dtype=torch.uint8, device=dev)
            flat.index_put_((dest,), data[:, None, :].expand(-1, el, -1))
            got = self._data(flat[:-1], 0)
            if self.fp8:
                recv.view(-1, self.hidden).copy_(got[0])
                scales.view(-1, self.groups).copy_(got[1])
            else:
                recv.view(-1, self.hidden).copy_(got)
            counts.copy_(has.sum(dim=0))
            handle.routes = routes
            handle.row_of = torch.where(local >= 0, local * cap_rows + pos.gather(1, local.clamp(min=0)), -1)
            handle.received = True

        if not hook:
            receive()
            return recv, counts, scales, handle
        return recv, counts, scales, handle, ep_ll.RecvHook("ep_dispatch_ll", self.pending, receive)

    def dispatch_ht(self, x, topk_idx, topk_weights, max_recv):
        """ep_dispatch's outputs (recv_x, recv_topk_idx, recv_topk_weights, counts, handle)."""
        dev, el = x.device, self.local
        t = x.shape[0]
        idx = topk_idx.long()
        bad = ((idx < -1) | (idx >= self.num_experts)).any()
        srt = idx.sort(dim=1).values
        bad |= ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()
        info = torch.stack([torch.tensor(t, device=dev), bad.long()])
        dist.all_reduce(info, op=dist.ReduceOp.MAX, group=self.group.process_group)
        most, any_bad = info.tolist()  # the host sync: block sizes, and every member raises or none
        if any_bad:
            if bool(bad):
                raise ValueError("topk_idx names an expert twice or one outside [0, num_experts) (and not -1): "
                                 "nothing was sent")
            raise ValueError("topk_idx on another rank names an expert twice or one outside [0, num_experts): "
                             "nothing was sent")
        cap = max(most, 1)
        rail_src, rail_rows = self._send(x, topk_idx, topk_weights.float(), cap)
        routes, rows, real = self._receive(rail_src, rail_rows, t, cap)
        n = int(real) if max_recv is None else max_recv  # without max_recv_tokens: the second sync
        if n > rows.shape[0]:  # rows past the received ones: padding (x 0, idx -1, weights 0)
            more = torch.zeros((n - rows.shape[0], self.row_bytes), dtype=torch.uint8, device=dev)
            more[:] = self.pad
            rows = torch.cat([rows, more])
        rows = rows[:n]  # with max_recv_tokens, rows past it dropped (their combine gets nothing from here)
        local = self._local(_field(rows, 0, self.w_at, torch.int64))
        counts = (local[:, :, None] == torch.arange(el, device=dev)).sum(dim=(0, 1)).to(torch.int32)
        recv_w = _field(rows, self.w_at, self.ids_at, torch.float32)  # padding rows: 0
        handle = NodesHandle(self, routes, rows=n)
        return self._data(rows, self.data_at), local.to(self.idx_dtype), recv_w, counts, handle

    # -- combine ------------------------------------------------------------------------------------------------

    def _to_arrival(self, sorted_rows: torch.Tensor, routes: Routes) -> torch.Tensor:
        out = torch.empty_like(sorted_rows)
        out[routes.order] = sorted_rows
        return out

    def combine_ll(self, y, topk_weights, handle, hook: bool):
        if "ep_combine_ll" in self.pending:
            raise RuntimeError("ep_combine_ll: the receive hook of the previous call (return_recv_hook=True) has "
                               "not run; call it first")
        routes = handle.routes
        zero = torch.zeros((1, 4 * self.k), dtype=torch.uint8, device=y.device)
        w = self._forward(_bytes(topk_weights.float()), zero, routes)[routes.order].view(torch.float32)
        y_rows = y.reshape(-1, self.hidden)
        partial = torch.zeros((w.shape[0], self.hidden), dtype=torch.float32, device=y.device)
        for j in range(self.k):  # my experts' weighted rows of each token, in k order
            at = handle.row_of[:, j]
            partial += torch.where((at >= 0)[:, None], w[:, j, None] * y_rows[at.clamp(min=0)].float(), 0.0)
        total = self._backward(self._to_arrival(partial.to(self.dtype), routes), routes)
        if not hook:
            return total.to(self.dtype)
        out = torch.empty((routes.tokens, self.hidden), dtype=self.dtype, device=y.device)
        return out, ep_ll.RecvHook("ep_combine_ll", self.pending, lambda: out.copy_(total))

    def combine_ht(self, y, handle):
        routes = handle.routes
        arrived = routes.order.shape[0]
        take = min(handle.rows, arrived)
        partial = torch.zeros((arrived, self.hidden), dtype=self.dtype, device=y.device)
        partial[:take] = y[:take]  # rows past max_recv_tokens were dropped: nothing from here
        return self._backward(self._to_arrival(partial, routes), routes).to(self.dtype)


def ep_dispatch_ll(group, x, topk_idx, num_experts, max_tokens, fp8, hook):
    """ep_dispatch_ll on a spanning group (its arguments checked here as the single-node op checks them)."""
    def make():
        ep_ll.check_dispatch_ll(group, x, topk_idx, num_experts, max_tokens, fp8)
        return NodesPlan(group, x, topk_idx, num_experts, ll=True, fp8=fp8, weights=False)

    found = plan(group, lambda: ("ep_ll_nodes", signature(x), signature(topk_idx), num_experts, max_tokens, fp8),
                 make)
    if x.shape[0] > max_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, more than max_tokens_per_rank={max_tokens}")
    return found.dispatch_ll(x, topk_idx, max_tokens, hook)


def ep_combine_ll(y, topk_idx, topk_weights, handle: NodesHandle, hook: bool, group):
    p = _handle_plan(handle, group, "ep_dispatch_ll")
    if not handle.received:
        raise RuntimeError("ep_combine_ll: the handle's dispatch has not received yet (run its receive hook)")
    g, tokens = p.group, handle.routes.tokens
    shape = (p.local, g.size * handle.routes.rail_src.shape[1], p.hidden)
    check_tensor("y", y, g, dtypes=(p.dtype,), contiguous=False)
    if tuple(y.shape) != shape:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {shape} (recv's)")
    check_tensor("topk_idx", topk_idx, g, dtypes=INDEX_DTYPES, contiguous=False)
    check_tensor("topk_weights", topk_weights, g, dtypes=(torch.float32,), contiguous=False)
    if topk_idx.dim() != 2 or topk_idx.shape[1] != p.k or topk_idx.shape[0] != tokens:
        raise ValueError(f"topk_idx must be the dispatch's ({tokens}, {p.k}), got {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, expected {tuple(topk_idx.shape)}")
    return p.combine_ll(y, topk_weights, handle, hook)


def ep_dispatch(group, x, topk_idx, topk_weights, num_experts, max_recv):
    """ep_dispatch on a spanning group (its arguments checked here as the single-node op checks them)."""
    def make():
        _check_routing(group, x, topk_idx, num_experts, topk_weights)
        if max_recv is not None and (not isinstance(max_recv, int) or isinstance(max_recv, bool) or max_recv < 0):
            raise ValueError(f"max_recv_tokens must be None or an int >= 0, got {max_recv!r}")
        return NodesPlan(group, x, topk_idx, num_experts, ll=False, fp8=False, weights=True)

    found = plan(group, lambda: ("ep_nodes", signature(x), signature(topk_idx), signature(topk_weights), num_experts,
                                 max_recv), make)
    return found.dispatch_ht(x, topk_idx, topk_weights, max_recv)


def ep_combine(y, handle: NodesHandle, group):
    p = _handle_plan(handle, group, "ep_dispatch")
    check_tensor("y", y, p.group, dtypes=(p.dtype,), contiguous=False)
    if tuple(y.shape) != (handle.rows, p.hidden):
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {(handle.rows, p.hidden)} (recv_x's)")
    return p.combine_ht(y, handle)


def eager_only(group_name: str, op: str) -> None:
    """The traced operators take the single-node path's handles (routes as tensors): none across nodes yet."""
    if resolve(group_name).topology.spans_nodes:
        raise ValueError(f"{op} on a group that spans nodes runs eagerly only (not under torch.compile or "
                         f"autograd): its handle holds the routes of both hops")


def _handle_plan(handle, group, op: str) -> NodesPlan:
    if group is not None and resolve(group) is not handle.plan.group:
        raise ValueError(f"group is {resolve(group)!r}, but the handle's {op} ran over {handle.plan.group!r}")
    if handle.plan.ll != (op == "ep_dispatch_ll"):
        raise TypeError(f"handle must be what {op} returned, got another op's")
    return handle.plan
