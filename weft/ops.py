"""weft's ops: every op that the families in weft/kernels declare (weft/kernels/registry.py), nothing written here.

`weft.ops.X` calls the implementation directly; a call that is traced (torch.compile, export, make_fx, a fake-tensor
mode) or that autograd must record goes through the PyTorch operator `torch.ops.weft.X`, whose dispatch costs more
than the op's own host time. Every op is such an operator. Helper types that ops return or take (GroupLayout) are
exported beside them: they are classes, not functions of tensors, so they are not operators.
"""
from __future__ import annotations

from .kernels import registry as _registry

_registry.load_families()
globals().update({name: d.public for name, d in _registry.OPS.items()})
globals().update(_registry.EXPORTS)

__all__ = [*_registry.OPS, *_registry.EXPORTS]
