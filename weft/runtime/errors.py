"""weft's public errors, raised as themselves.

`WaitTimeout`: a device-side wait gave up (WEFT_WAIT_TIMEOUT_S). On the cpu backend the interpreter
raises it inside the kernel, and Triton's interpreter wraps every exception of a kernel, and again of
each `@triton.jit` function it passed through, in an InterpreterError; `unwrap_wait_timeouts()` makes
a kernel launch raise the WaitTimeout itself instead, so `except weft.WaitTimeout` catches it. On GPUs
the wait prints its report and traps: the launch's CUDA error surfaces at the next synchronisation.

`OffNodeAccess`: on the cpu backend, a kernel's `symm_at` to a rank on another node (weft.runtime.topology).
`SignatureMismatch`: the members of a group called a collective with plans that disagree (another op, shape,
dtype, method, root, ...): the cross-rank signature check (weft.kernels.common.SignatureWord) raises it on
every involved member, naming the op, both ranks and both plans.

`check_errors()`: synchronise, then raise whatever device-side error an op family has recorded. A family
that keeps an error word registers its check in `world.error_checks` when it makes its workspace.
"""
from __future__ import annotations

import functools


class WaitTimeout(RuntimeError):
    """A device-side wait did not complete within WEFT_WAIT_TIMEOUT_S. The message names the waiting rank,
    the op, the rank whose signal is missing, the expected and the seen value."""


class OffNodeAccess(RuntimeError):
    """A kernel translated a pointer with `symm_at` to a rank on another node (cpu backend: the interpreter's
    check). The message names the rank, the peer and both nodes; other nodes are reached only through the
    network primitives (putmem*, getmem*, signal_op, signal_wait_until)."""
class SignatureMismatch(ValueError):
    """Members of a group called a collective with disagreeing arguments (each rank's call is valid alone, the
    set of calls is not): a ValueError, as a bad argument is. Raised on every involved member, in place of a
    wrong result or a hang; the message names the op, this rank and the peer, and both plans' signatures."""


def _wait_timeout_in(error: BaseException) -> WaitTimeout | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, WaitTimeout):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


# What may explain a WaitTimeout better (cold path, cpu backend): functions that return an exception to raise in its
# place, or None. weft.kernels.common adds the cross-family check (a member in a collective of another family).
timeout_reports: list = []


def unwrap_wait_timeouts() -> None:
    """Make interpreted kernel launches raise a WaitTimeout from inside the kernel as itself (idempotent), or what
    a `timeout_reports` function makes of it."""
    from triton.runtime.errors import InterpreterError
    from triton.runtime.interpreter import InterpretedFunction

    launch = InterpretedFunction.run
    if getattr(launch, "weft_unwraps", False):
        return

    @functools.wraps(launch)
    def run(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        except InterpreterError as e:
            timeout = _wait_timeout_in(e)
            if timeout is None:
                raise
        # Raised outside the handler, so the InterpreterError chain (which holds it) is not its context.
        for report in timeout_reports:
            better = report()
            if better is not None:
                raise better from timeout
        raise timeout.with_traceback(timeout.__traceback__)

    run.weft_unwraps = True
    InterpretedFunction.run = run


def check_errors() -> None:
    """Wait for this rank's queued device work, then raise any error an op family recorded on the device
    (a bad topk_idx row, ...), each family's check in turn. A CUDA error (a trapped wait) raises here too."""
    import torch

    from . import world as _world

    w = _world.get()
    if w.device.type == "cuda":
        torch.cuda.synchronize(w.device)
    for check in list(w.error_checks):
        check()
