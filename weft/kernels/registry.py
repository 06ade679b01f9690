"""One declaration per op: from it come the public `weft.ops.X`, the PyTorch operator `torch.ops.weft.X` (schema,
fake implementation, autograd) and the op's entry in `weft.ops.__all__`.

An op family declares each op once, in its own module, beside the implementation:

    @declare_op(tensors=("x", "out"), collective=True)
    def all_gather(x, out=None, method="auto", group=None):   # the implementation: eager, plain tensors, any layout
        ...

    @all_gather.define                                   # torch.ops.weft.all_gather: schema from the annotations
    def all_gather_op(x: Tensor, group_name: str, method: str = "auto") -> Tensor:
        return fresh(all_gather.eager(x, method=method, group=group_name), x)

    @all_gather_op.register_fake                         # torch.library's own API from here on
    def _(x, group_name, method="auto"):
        return x.new_empty((group_size(group_name) * x.shape[0], *x.shape[1:]))

    @all_gather.traced                                   # the public call when torch must see the operator
    def _(x, out=None, method="auto", group=None):
        return into(out, torch.ops.weft.all_gather(x, group_name(group), method))

`@declare_op` replaces the implementation by the public function: a plain function with the implementation's
signature, defaults and docstring, generated once, that calls the implementation directly (a custom op's dispatch costs
7-21 us per call) unless the call is traced (torch.compile, export, make_fx, a fake-tensor mode) or autograd has to
record it (grad mode and an input among `tensors` that requires grad): then it takes the `traced` route, which
reaches the operator. The implementation stays reachable as `.eager`, the declaration as `.definition`.

An op with no `traced` route calls its first operator with the public call's arguments unchanged (the operator then
has the public signature). `collective=True` says every member of a group takes part: the op must have a `group`
parameter defaulting to None (the world; operators take the group by name), and its operators are marked as having
side effects: a graph pass must not drop a collective whose result one rank does not use, or the others wait for
that rank for ever (fx's dead-code elimination and inductor's both keep them).

The family modules are imported by `load_families()`; `weft.ops` is what they declared, nothing written by hand.
Helper types that ops return or take (GroupLayout) are exported beside the ops with `export`, and are not operators:
they are Python classes, not functions of tensors.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Callable

import torch

from ..runtime.group import GroupLike

# name -> declaration, in declaration order; and the helper types `weft.ops` exports beside the ops.
OPS: dict[str, "OpDef"] = {}
EXPORTS: dict[str, object] = {}

_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_grad_enabled = torch.is_grad_enabled


class OpDef:
    """An op's declaration: its implementation, its operators, its traced route."""

    def __init__(self, eager: Callable, tensors: tuple, collective: bool):
        self.name, self.eager, self.tensors, self.collective = eager.__name__, eager, tensors, collective
        self.operators: list = []  # torch.library CustomOpDefs, the first one the op's own
        self.traced_call: Callable | None = None
        self.public = _public_function(self)

    def define(self, fn: Callable | None = None, *, name: str | None = None, mutates_args=()):
        """Make `fn` (annotated: the schema is inferred from it, as torch.library.custom_op does) the operator
        torch.ops.weft.<name> (default: the op's name; a variant such as the in-place `all_reduce_` names itself).
        Returns torch's CustomOpDef: register_fake, register_autograd on it."""
        def make(fn):
            custom = torch.library.custom_op(f"weft::{name or self.name}", fn, mutates_args=mutates_args)
            custom.weft_name = name or self.name
            if self.collective:
                torch.fx.node.has_side_effect(custom._opoverload)
            self.operators.append(custom)
            return custom
        return make if fn is None else make(fn)

    def traced(self, fn: Callable) -> Callable:
        """The public call's route when it is traced or differentiated: same signature as the op, reaching the
        operator(s) (torch.ops.weft.*, looked up at call time)."""
        self.traced_call = fn
        return fn

    def call_traced(self, *args, **kwargs):
        if self.traced_call is not None:
            return self.traced_call(*args, **kwargs)
        return getattr(torch.ops.weft, self.operators[0].weft_name)(*args, **kwargs)


def _public_function(d: OpDef) -> Callable:
    """The public function of an op: the implementation's exact signature, so the direct path adds only the
    `traced` test (generated source, not *args forwarding: no packing, and help() shows the real signature)."""
    sig = inspect.signature(d.eager)
    params, call, star = [], [], False
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{d.name}: an op's parameters are named, not *args/**kwargs")
        if p.kind == p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        params.append(p.name)
        call.append(f"{p.name}={p.name}" if p.kind == p.KEYWORD_ONLY else p.name)
    for t in d.tensors:
        if t not in sig.parameters:
            raise TypeError(f"{d.name}: tensors names {t!r}, which is not a parameter")
    if d.collective and (sig.parameters.get("group") is None or sig.parameters["group"].default is not None):
        raise TypeError(f"{d.name}: a collective op takes `group=None` (the group it runs over; None: the world)")
    # Whether the call must go through torch.ops.weft: under torch.compile/export (dynamo: is_compiling() folds to
    # True), under a dispatch mode (make_fx, AOT autograd tracing a backward, FakeTensorMode), or when autograd has
    # to record it (grad mode on and an input among `tensors` that requires grad). Written out for these parameters:
    # no argument packing on the eager path (a generator over *tensors cost ~1.3 us a call more on a
    # loaded 2-core host).
    grad = " or ".join(f"({t} is not None and {t}.requires_grad)" for t in d.tensors)
    test = "_is_compiling() or _dispatch_modes()" + (f" or (({grad}) and _grad_enabled())" if grad else "")
    src = (f"def {d.name}({', '.join(params)}):\n"
           f"    try:\n"
           f"        route = {test}\n"
           f"    except AttributeError:  # not a tensor: the implementation's checks name the argument\n"
           f"        route = False\n"
           f"    if route:\n"
           f"        return _definition.call_traced({', '.join(call)})\n"
           f"    return _eager({', '.join(call)})\n")
    scope = {"_is_compiling": _is_compiling, "_dispatch_modes": _dispatch_modes, "_grad_enabled": _grad_enabled,
             "_definition": d, "_eager": d.eager}
    exec(compile(src, f"<weft op {d.name}>", "exec"), scope)  # noqa: S102 - source built from a signature
    fn = scope[d.name]
    fn.__defaults__, fn.__kwdefaults__ = d.eager.__defaults__, d.eager.__kwdefaults__
    fn.__doc__, fn.__module__, fn.__qualname__ = d.eager.__doc__, d.eager.__module__, d.eager.__qualname__
    # The implementation's annotations (strings under `from __future__ import annotations`, which get_type_hints
    # resolves in the implementation's module through __wrapped__), and a collective's bare `group` the type it takes.
    fn.__annotations__ = dict(d.eager.__annotations__)
    if "group" in sig.parameters and sig.parameters["group"].annotation is inspect.Parameter.empty:
        fn.__annotations__["group"] = GroupLike
        sig = sig.replace(parameters=[p.replace(annotation=GroupLike) if p.name == "group" else p
                                      for p in sig.parameters.values()])
    fn.__signature__ = sig
    fn.__wrapped__ = d.eager
    fn.eager, fn.definition = d.eager, d
    fn.define, fn.traced = d.define, d.traced
    return fn


def declare_op(*, tensors: tuple = (), collective: bool = False):
    """Declare the decorated implementation as an op (see the module doc). `tensors`: the parameters whose
    requires_grad decides whether autograd must record the call; `collective`: every member of the op's `group`
    takes part."""
    def declare(eager: Callable) -> Callable:
        if eager.__name__ in OPS:
            raise ValueError(f"op {eager.__name__!r} is declared twice ({OPS[eager.__name__].eager.__module__} "
                             f"and {eager.__module__})")
        d = OpDef(eager, tuple(tensors), collective)
        OPS[d.name] = d
        return d.public
    return declare


def export(obj):
    """Export a helper type (not an op) through weft.ops."""
    EXPORTS[obj.__name__] = obj
    return obj


def load_families() -> None:
    """Import every module of weft.kernels, so that every op is declared."""
    from .. import kernels

    for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + "."):
        importlib.import_module(info.name)
    missing = [name for name, d in OPS.items() if not d.operators]
    if missing:
        raise TypeError(f"ops declared without an operator: {', '.join(missing)}")


# -- helpers for the operators' bodies and traced routes ------------------------------------------------------

def fresh(t: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy where it shares memory with an input (a custom op's outputs may not alias its inputs; on one
    rank some ops hand their input back)."""
    return t.clone() if any(t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr() for i in inputs) else t


def into(out, result):
    """A traced call's `out`: the operator's result copied into it (what functionalization makes of it)."""
    if out is None:
        return result
    out.copy_(result)
    return out


def no_config(config) -> None:
    if config is not None:
        raise TypeError("config cannot be given to a traced or differentiated call (torch.ops.weft takes none)")
