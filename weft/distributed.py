"""weft as a torch.distributed backend: process groups whose collectives run on weft's ops.

    import weft, torch.distributed as dist
    dist.init_process_group(backend="weft")   # or "cpu:gloo,cuda:weft"; dist.new_group(ranks, backend="weft")

`import weft` registers the backend "weft" (`torch.distributed.Backend.register_backend`), so a torch program (DDP,
FSDP2, tensor parallelism over DeviceMesh groups) runs its collectives on weft unchanged. A weft process group is a
`torch.distributed.ProcessGroup` subclass (`WeftProcessGroup`) over a weft Group, whose process group is an
*internal* one made from the same store, rank and size (keys under "weft/"): gloo for cpu tensors, NCCL too for
cuda tensors on GPUs. On weft, over that Group: all_reduce, all_gather (list, into a tensor), reduce_scatter (list,
from a tensor) and broadcast, in place where c10d's are, and barrier (weft's device barrier). What weft refuses
(a TypeError/ValueError from an op's checks, raised before anything is written: a reduction or dtype it does not
take, a tensor on another device) and every other collective (all_to_all, send/recv, gather, scatter, reduce,
coalesced calls, and what C++ callers reach without a Python override) go to the internal group.

How the world is built. `init_process_group(backend="weft")` makes weft's world over the default group's
internal group (`weft.runtime.world.init_over`); torch's destroy_process_group() finalizes it. If weft is
initialised already (weft.init(), then new_group(..., backend="weft")), the group is a weft Group of the same
global ranks over its own internal group. Either way `group=` of weft's ops takes the weft process group itself.

Streams (GPUs). An op runs on the caller's current stream, after this group's previous op (calls on one group
complete in call order, as on NCCL's one stream per communicator); its Work's wait() makes the waiting stream wait
for it (a future over the device: c10d's semantics); barrier() returns once every member's stream has arrived.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from . import ops
from .runtime import world as _world
from .runtime.group import Group
from .runtime.subgroups import backend_type, registered_process_group, unregister

NAME = "weft"

# c10d's reductions by the name weft's ops take; the others (PREMUL_SUM, the bitwise ones) go to the internal group.
_REDUCTIONS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max",
               dist.ReduceOp.MIN: "min", dist.ReduceOp.PRODUCT: "product"}
# Call signatures weft refused are remembered (and go straight to the internal group) up to this many per group.
_MAX_REFUSED = 1024


class WeftProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on weft's ops over `group` (a weft Group), the rest
    on `internal` (a gloo / NCCL group of the same ranks). `calls` counts them: (collective, "weft" | "forwarded")."""

    def __init__(self, group: Group, internal: dist.ProcessGroup, made_world: bool):
        super().__init__(group.rank, group.size)
        self.group, self.internal = group, internal
        self.made_world = made_world
        self.calls: Counter = Counter()
        self._refused: set = set()
        self._cuda = group.device.type == "cuda"
        self._last = None  # cuda: the event after this group's last op on weft
        # What C++ callers reach without a Python override (coalesced calls, functional collectives) goes to the
        # internal group's backends; default: the weft device's.
        for device in internal._device_types:
            self._register_backend(device, backend_type(device), internal._get_backend(device))
        self._set_default_backend(backend_type(group.device))

    def getBackendName(self) -> str:
        return NAME

    def __repr__(self) -> str:
        return f"WeftProcessGroup({self.group!r})"

    # -- the collectives on weft ------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        op = _REDUCTIONS.get(opts.reduceOp.op)
        if len(tensors) != 1 or op is None:
            return self._forward("allreduce", self.internal.allreduce, tensors, opts)
        x = tensors[0]
        return self._run("allreduce", (x, op), lambda: ops.all_reduce(x, op=op, out=x, group=self.group), tensors,
                         self.internal.allreduce, tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllgatherOptions()
        if len(input_tensors) != 1 or len(output_tensors) != 1 or len(output_tensors[0]) != self.group.size:
            return self._forward("allgather", self.internal.allgather, output_tensors, input_tensors, opts)
        x, outs = input_tensors[0], output_tensors[0]
        if any(o.shape != x.shape or o.dtype != x.dtype for o in outs):  # uneven: gloo's to judge
            return self._forward("allgather", self.internal.allgather, output_tensors, input_tensors, opts)

        def on_weft():
            rows = ops.all_gather(_apart(x.reshape(1, x.numel()), outs), group=self.group)
            for o, row in zip(outs, rows):
                o.copy_(row.view(x.shape))
        return self._run("allgather", (x, len(outs)), on_weft, output_tensors,
                         self.internal.allgather, output_tensors, input_tensors, opts)

    def _allgather_base(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        n, w = input.numel(), self.group.size
        forward = getattr(self.internal, "all_gather_single", None) or self.internal._allgather_base
        if output.numel() != w * n or not output.is_contiguous() or output.dtype != input.dtype:
            return self._forward("all_gather_into_tensor", forward, output, input, opts)
        # In place (x is its slice of out, as FSDP2 calls it): weft's all_gather takes x apart from out.
        return self._run("all_gather_into_tensor", (input, output),
                         lambda: ops.all_gather(_apart(input.reshape(1, n), [output]), out=output.view(w, n),
                                                group=self.group),
                         [output], forward, output, input, opts)

    all_gather_single = _allgather_base  # its name from torch 2.13

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = _REDUCTIONS.get(opts.reduceOp.op)
        if (len(output_tensors) != 1 or len(input_tensors) != 1 or len(input_tensors[0]) != self.group.size
                or op is None):
            return self._forward("reduce_scatter", self.internal.reduce_scatter, output_tensors, input_tensors,
                                 opts)
        out, parts = output_tensors[0], input_tensors[0]
        if any(p.shape != out.shape or p.dtype != out.dtype for p in parts):
            return self._forward("reduce_scatter", self.internal.reduce_scatter, output_tensors, input_tensors,
                                 opts)

        def on_weft():
            stacked = torch.stack([p.reshape(-1) for p in parts])
            out.copy_(ops.reduce_scatter(stacked, op=op, group=self.group).view(out.shape))
        return self._run("reduce_scatter", (out, op, len(parts)), on_weft, output_tensors,
                         self.internal.reduce_scatter, output_tensors, input_tensors, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = _REDUCTIONS.get(opts.reduceOp.op)
        m, w = output.numel(), self.group.size
        forward = getattr(self.internal, "reduce_scatter_single", None) or self.internal._reduce_scatter_base
        if (op is None or input.numel() != w * m or not input.is_contiguous() or not output.is_contiguous()
                or output.dtype != input.dtype):
            return self._forward("reduce_scatter_tensor", forward, output, input, opts)
        # output may be input's block of this rank (NCCL's in place): weft's reduce_scatter takes that as it is.
        return self._run("reduce_scatter_tensor", (input, output, op),
                         lambda: ops.reduce_scatter(input.view(w, m), op=op, out=output.view(1, m), group=self.group),
                         [output], forward, output, input, opts)

    reduce_scatter_single = _reduce_scatter_base  # its name from torch 2.13

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        if len(tensors) != 1 or opts.rootTensor != 0:
            return self._forward("broadcast", self.internal.broadcast, tensors, opts)
        x, root = tensors[0], opts.rootRank  # a group rank, in c10d's Backend API as in weft's ops
        return self._run("broadcast", (x, root), lambda: ops.broadcast(x, root=root, group=self.group), tensors,
                         self.internal.broadcast, tensors, opts)

    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()

        def on_weft():
            ops.device_barrier(group=self.group)
            if self._cuda:  # c10d's barrier holds the host until every member has arrived
                torch.cuda.current_stream(self.group.device).synchronize()
        return self._run("barrier", (), on_weft, [], self.internal.barrier, opts)

    # -- running and forwarding ---------------------------------------------------------------------------------

    def _run(self, name, signature_of, on_weft, result, forward, *args):
        """`on_weft()`, and a Work whose value is `result`; or `forward(*args)` where weft refuses the call (its
        checks raise before anything is written, on every rank alike: the same signature). A refused signature
        goes straight to the internal group from then on."""
        key = (name, *(_signature(a) for a in signature_of))
        if key not in self._refused:
            if self._cuda and self._last is not None:
                torch.cuda.current_stream(self.group.device).wait_event(self._last)
            try:
                on_weft()
            except (TypeError, ValueError):
                if len(self._refused) >= _MAX_REFUSED:
                    self._refused.clear()
                self._refused.add(key)
            else:
                self.calls[name, "weft"] += 1
                return self._done(result)
        return self._forward(name, forward, *args)

    def _forward(self, name, forward, *args):
        self.calls[name, "forwarded"] += 1
        return forward(*args)

    def _done(self, result):
        """A finished Work: on GPUs its future records the current stream, and waiting on it (Work.wait, the
        future's callbacks) makes the waiting stream wait for this op."""
        if not self._cuda:
            future = torch.futures.Future()
        else:
            self._last = torch.cuda.Event()
            self._last.record(torch.cuda.current_stream(self.group.device))
            future = torch.futures.Future(devices=[self.group.device])
        future.set_result(result)
        return _create_work_from_future(future)

    def shutdown(self):
        """destroy_process_group: weft's side first (the world's finalize, or this group's workspaces), then the
        internal group (which destroy_process_group() of the world shuts down once more: a no-op)."""
        w = self.group.world
        if self.made_world:
            if _world.is_initialized() and _world.get() is w:
                _world.finalize()
        else:
            for name in [n for n, g in w.groups.items() if g is self.group]:
                del w.groups[name]
            self.group.release()
        unregister(self.internal)
        self.internal.shutdown()


def _signature(a):
    """What a refusal depends on in one of a call's arguments."""
    if isinstance(a, torch.Tensor):
        return a.shape, a.dtype, a.device, a.is_contiguous()
    return a


def _apart(x: torch.Tensor, outs) -> torch.Tensor:
    """`x`, or a copy of it where it shares memory with an output (an in-place all-gather)."""
    if any(x.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in outs):
        return x.clone()
    return x


# -- making groups ------------------------------------------------------------------------------------------------

def _create(options, pg_options) -> WeftProcessGroup:
    """The backend's creator (c10d's extended API): on every member, at init_process_group / new_group."""
    if pg_options is not None:
        raise ValueError(f"the {NAME} backend takes no pg_options, got {pg_options!r}")
    rank, size, name = options.group_rank, options.group_size, options.group_id
    global_ranks = list(options.global_ranks_in_group)  # empty for the default group
    made_world = not global_ranks
    if made_world and _world.is_initialized():
        raise RuntimeError(f"init_process_group(backend={NAME!r}): weft is initialised already; call "
                           "weft.finalize() first, or make weft groups with new_group(..., backend='weft')")
    if not made_world and not _world.is_initialized():
        raise RuntimeError(f"new_group(backend={NAME!r}) needs weft's world: call weft.init() on every rank first "
                           f"(or init_process_group(backend={NAME!r}))")
    # torch's destroy_process_group() shuts every registered group down in reverse order of their names: "(" sorts
    # below digits and letters, so a weft group is shut down (its world finalized over the internal group) first.
    internal = registered_process_group(dist.PrefixStore(f"{NAME}/", options.store), rank, size, options.timeout,
                                        f"({NAME}){name}", global_ranks or list(range(size)))
    try:
        if made_world:
            group = _world.init_over(internal, rank, size)
        else:
            w = _world.get()
            group = Group(w, internal, tuple(global_ranks), w.heap_size, w.workspace_bytes)
            w.groups[group.name] = group
        group.world.groups[name] = group  # an op's group= may name the weft process group: this Group
    except BaseException:
        unregister(internal)
        raise
    return WeftProcessGroup(group, internal, made_world)


def register() -> None:
    """Register the "weft" backend with torch.distributed (at `import weft`; again is a no-op)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
