"""The op infrastructure every host op uses: the group a call runs over, argument checks, plans cached per
call signature, direct kernel launches, and one bounded workspace per op family and group.

Every op takes `group=None` (the world): `resolve(group)` gives the Group (weft.runtime.group) whose heap,
workspaces and plans the call uses; its kernels see group ranks only.

An op call is split in two:
- the **plan** (a `Plan` subclass, one per family or op): everything that depends only on the call's
  signature (shapes, dtypes, layouts, alignment, output kind, method): argument checks, the method
  choice, workspace views, launch parameters, compiled kernels. Made once per signature and group, on
  the first call, and kept in `group.plans` (bounded: the oldest plans are dropped past MAX_PLANS);
- the **call**: a dictionary lookup of the plan by the signature, the few checks the signature does
  not cover, and the launches (`plan.run(...)`, or the named entry points of a plan two ops share).
A call whose signature differs in anything the checks look at (dtype, device, shape, contiguity)
misses the cache and is checked in full before anything is written.

Workspaces: each op family owns one symmetric workspace of `group.workspace_bytes` per group, created
collectively (among the group's members) on its first call there (the only time an op allocates or
makes a host barrier) and reused by every later call whatever its size; messages that do not fit go
through in passes.

The cross-rank signature check: a plan of a collective has a `fingerprint` (a non-zero 31-bit CRC of its
`signature_text`: the op, the group size and everything its protocol depends on: sizes, dtype, method,
root, ...; not what may legitimately differ across members, such as pointer alignment where the protocol does
not depend on it), which its kernels publish to the members and compare with theirs (weft.language.signals:
`sign`, `check_signed`). A mismatch is recorded in the group's `SignatureWord` and raised as
weft.SignatureMismatch on every member: on the cpu backend by the call itself, on GPUs at the family's next
call or weft.check_errors(). Each rank puts its plans' texts in the store at plan creation, under their
fingerprints, so the error names both. Members in collectives of different families at the same point time out
in their checks' waits; on the cpu backend that timeout is raised as a SignatureMismatch naming both calls
(SignatureWord.elsewhere, from the families' signature words: the cold path only).

Operators (`torch.ops.weft.X`) take the group by name (`group_name`), as torch's symmetric-memory ops do;
their fake implementations read the group's size with `group_size(name)`.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import triton
from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg

from .. import tuning
from ..runtime import backend, errors, process_group
from ..runtime import world as _world
from ..runtime.errors import SignatureMismatch
from ..runtime.world import resolve  # noqa: F401  (the families resolve their `group=` through here)

# Plans kept per group; a program calling with ever new shapes evicts the oldest.
MAX_PLANS = 4096


def world_or_raise():
    return _world.get()


def group_name(group) -> str:
    """The name a traced call passes to an operator for its `group=` argument."""
    return resolve(group).name


def group_size(name: str) -> int:
    """The size of the group an operator names: what its fake implementation's shapes come from."""
    return resolve(name).size


def rows_divisible(x: torch.Tensor, world_size: int) -> None:
    if x.dim() == 0 or x.shape[0] % world_size:
        raise ValueError(f"x has shape {tuple(x.shape)}: its rows are not divisible by the group size {world_size}")


def matmul_operands(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """A fake implementation's check of two matmul operands' shapes."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{a_name} {tuple(a.shape)} and {b_name} {tuple(b.shape)} are not 2-D operands of a matmul")


# -- checks ---------------------------------------------------------------------

def check_tensor(name: str, t, world, dtypes=None, contiguous=True) -> None:
    """Raise TypeError/ValueError naming `name` unless `t` is usable on this rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != world.device:
        raise ValueError(f"{name} is on {t.device}, but this rank's device is {world.device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_out(out, shape, dtype, world) -> None:
    check_tensor("out", out, world, contiguous=False)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")


def check_method(method: str, methods) -> None:
    if method not in methods:
        raise ValueError(f"method must be one of {', '.join(repr(m) for m in methods)}, got {method!r}")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of `a` and `b` intersect (contiguous tensors)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def as_words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as the widest integer words that tile them (pure data movement is bit-exact). `t` is
    contiguous (its size-1 dimensions may carry any stride)."""
    flat = t.reshape(-1)
    flat = flat.as_strided((flat.numel(),), (1,)).view(torch.uint8)
    nbytes = flat.numel()
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0 and t.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat.view(torch.int8)


def signature(t: torch.Tensor) -> tuple:
    """What a plan depends on in a tensor argument: shape, dtype, device, contiguity, 16-byte alignment."""
    return t.shape, t.dtype, t.device, t.is_contiguous(), t.data_ptr() & 15


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (ops skip their host-synced checks then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def out_kind(group, out, x=None) -> str:
    """"none", "x" (in place), "symmetric" (from weft.empty) or "plain": what a plan does with `out`. A group of
    one has no use for a symmetric output: its heap is not made for the question."""
    if out is None:
        return "none"
    if x is not None and out is x:
        return "x"
    return "symmetric" if group.size > 1 and group.heap.contains(out) else "plain"


# -- plans ------------------------------------------------------------------------

class Plan:
    """What every call of one signature does on one group. The first such call makes it: a subclass's
    `__init__(group, <the call's arguments>)` checks them in full (raising before anything is written) and
    prepares the method choice, workspace views and launches; every call then runs it, through `run` or, where
    two ops share one plan (EP dispatch and combine), through named entry points. A plan keeps no caller
    tensor (their memory may be reused by the next call's)."""

    def __init__(self, group):
        self.group = group

    def sign(self, name: str, /, **parts) -> int:
        """Set this plan's `fingerprint` and `signature_text` from the op's name and what the members must agree
        on (`parts`, in the order given); returns the fingerprint, which the plan's kernels take as an argument."""
        fields = ", ".join(f"{k}={v}" for k, v in (("W", self.group.size), *parts.items()))
        self.signature_text = text = f"{name}({fields})"
        self.fingerprint = fingerprint(text)
        if self.group.size > 1:
            _publish(self.fingerprint, text)
        return self.fingerprint


def fingerprint(text: str) -> int:
    """The fingerprint of a signature text: its CRC-32 folded into 31 bits, never 0 (the same in every process,
    unlike Python's hash)."""
    return (zlib.crc32(text.encode()) & 0x7FFFFFFF) or 1


# Signature texts this process has put in the store (and its own, for the error message), by fingerprint.
_TEXTS: dict[int, str] = {}


def _store_key(fp: int) -> str:
    return f"weft/signature/{fp:08x}"


def _publish(fp: int, text: str) -> None:
    if _TEXTS.get(fp) != text:
        _TEXTS[fp] = text
        dist.distributed_c10d._get_default_store().set(_store_key(fp), text)


def _text_of(fp: int) -> str:
    """The signature text of a fingerprint: this process's, else what a peer put in the store."""
    if fp in _TEXTS:
        return _TEXTS[fp]
    try:
        store = dist.distributed_c10d._get_default_store()
        if store.check([_store_key(fp)]):
            return store.get(_store_key(fp)).decode()
    except Exception:  # noqa: BLE001 - the message still names the fingerprint
        pass
    return "?"


def handle_group(handle, group, cls, op: str):
    """The group the second op of a pair (a combine) runs over: the group of the first one's call (its plan's),
    whose handle it takes. `group`, if given, must be that one."""
    if not isinstance(handle, cls):
        raise TypeError(f"handle must be what {op} returned, got {type(handle).__name__}")
    if group is not None and resolve(group) is not handle.plan.group:
        raise ValueError(f"group is {resolve(group)!r}, but the handle's {op} ran over {handle.plan.group!r}")
    return handle.plan.group


def plan(world, key, make):
    """The plan for this call: cached under `key()` (the call's signature) in `world.plans` (the group's),
    else made by `make()`, which checks the arguments in full. Arguments that cannot make a key (not tensors,
    unhashable, no data) go straight to `make()`, whose checks reject them."""
    try:
        k = key()
        found = world.plans.get(k)
    except Exception:  # noqa: BLE001 - whatever it is, make() names the bad argument
        k, found = None, None
    if found is None:
        found = make()
        if k is not None:
            if len(world.plans) >= MAX_PLANS:
                del world.plans[next(iter(world.plans))]
            world.plans[k] = found
    return found


def workspace(world, family: str, make):
    """The op family's workspace, made by `make(world)` on first use (collectively: every rank calls ops in
    the same order). Making it allocates and synchronises, so it cannot happen inside CUDA-graph capture."""
    return world.context(family, lambda: make(world))


def zero_everywhere(world, *tensors) -> None:
    """Zero a new workspace's flags, counters and LL words on this rank, then a host barrier, so that no peer
    signals into words this rank has not zeroed yet: the one host barrier an op family makes."""
    for t in tensors:
        t.zero_()
    world.barrier()


# -- device-side errors ---------------------------------------------------------------

class ErrorWord:
    """Words where kernels record a bad argument value they found (data the host cannot check without a sync),
    read by the host with no sync: on GPUs pinned host memory, which the kernels store to through its address
    (unified addressing maps it for the device), so a record shows up once the kernel has run; on the cpu
    backend plain memory. Made zero. `tensor` (`words` int64): what the kernels take; a kernel records by
    storing word 0 (non-zero) last. `describe(words)` makes the exception of a record. With `group`, the check
    is registered in its error_checks, so weft.check_errors() raises it too. (The MoE family's
    RoutingErrorWord is this mechanism with one word.)"""

    def __init__(self, group, describe, words: int = 1):
        device = group.device if group is not None else None
        if device is not None and device.type == "cuda":
            self.tensor = torch.zeros(words, dtype=torch.int64, pin_memory=True)
        else:
            self.tensor = torch.zeros(words, dtype=torch.int64)
        self.host = self.tensor.numpy()  # the host's view: a read is a load, no torch op
        self.describe = describe
        if group is not None:
            group.error_checks.append(self.raise_recorded)

    def take(self):
        """The exception of what was recorded since the last one taken, if anything, else None. The words are
        cleared: the next valid call works."""
        if not self.host[0]:
            return None
        if self.tensor.is_pinned():
            torch.cuda.synchronize()  # an error: the record's every word, whole (no sync otherwise)
        words = [int(v) for v in self.host]
        self.host[:] = 0
        return self.describe(words)

    def raise_recorded(self) -> None:
        error = self.take()
        if error is not None:
            raise error


class SignatureWord(ErrorWord):
    """The group's record of a signature mismatch a kernel found (signals.check_signed): [1, peer, mine, theirs],
    raised as weft.SignatureMismatch. Families register their signature words (`register`), with their epoch
    counter (wl.next_epoch) where a mismatch can make members take different numbers of epochs (different pass
    counts). Before raising, every member resynchronises them: after a host barrier, each such counter is set to
    the largest epoch any member reached (every flag, LL word and signature word of the past then carries an
    older epoch than any later launch's) and every family is untripped, so that the next matching call works.
    Every involved member raises (each compares every member's word), so the resynchronisation's collectives
    pair up."""

    def __init__(self, group):
        super().__init__(group, self._mismatch, words=4)
        if group.device.type != "cuda":  # a plan keeps no memory outside the heap: the cpu word is the heap's
            self.tensor = group.heap.empty((4,), torch.int64).zero_()
            self.host = self.tensor.numpy()
        self.group = group
        self.families: list = []  # (signature words, epoch counter or None)

    def register(self, sig: torch.Tensor, counter: torch.Tensor | None = None) -> None:
        self.families.append((sig, counter))

    def _mismatch(self, words) -> SignatureMismatch:
        _, peer, mine, theirs = words
        self.resync()
        g = self.group
        text = _text_of(mine)
        op = text.split("(", 1)[0]
        return SignatureMismatch(
            f"weft.ops.{op}: the members of {g!r} called it with plans that differ: rank {g.rank}: {text} "
            f"[{mine:08x}]; rank {peer}: {_text_of(theirs)} [{theirs:08x}]. Every member must call a collective "
            f"with the same arguments (shapes, dtypes, op, method, root).")

    def resync(self) -> None:
        g = self.group
        g.barrier()  # every member's launches of the mismatched calls are done
        counters = [counter for _, counter in self.families if counter is not None]
        epochs = torch.tensor([int(counter[0].item()) >> 32 for counter in counters], dtype=torch.int64,
                              device=g.device)
        if g.size > 1 and counters:
            dist.all_reduce(epochs, op=dist.ReduceOp.MAX, group=g.process_group)
        for counter, epoch in zip(counters, epochs.tolist()):
            counter.fill_(epoch << 32)
        for sig, _ in self.families:
            sig[-1] = 0
        g.barrier()


    def elsewhere(self) -> SignatureMismatch | None:
        """Cold path, a wait timed out (cpu backend): whether a member is in a call of another family than this
        rank. Each member's newest signature word in each family (every member signs into every member's words) is
        compared with this rank's: a member whose newest word in one family is of a later epoch than this rank's,
        while this rank's in another is later than the member's, called a collective of the first family where
        this rank called one of the second. None otherwise (or once the group's words are unreadable)."""
        g, n = self.group, self.group.size
        newest, seen = [], set()  # per family: (epoch, fingerprint) of each member's newest word
        for sig, _ in self.families:
            if id(sig) not in seen:
                seen.add(id(sig))
                words = sig[:2 * n].tolist()
                newest.append([max((words[q], words[n + q]), key=lambda v: v >> 32) for q in range(n)])
        for peer in range(n):
            theirs = [f[peer] for f in newest if f[peer] >> 32 > f[g.rank] >> 32]
            mine = [f[g.rank] for f in newest if f[g.rank] >> 32 > f[peer] >> 32]
            if theirs and mine:
                mine_fp, theirs_fp = mine[0] & 0xFFFFFFFF, theirs[0] & 0xFFFFFFFF
                text = _text_of(mine_fp)
                return SignatureMismatch(
                    f"weft.ops.{text.split('(', 1)[0]}: the members of {g!r} called different collectives at the same "
                    f"point: rank {peer} is in {_text_of(theirs_fp)} [{theirs_fp:08x}] while rank {g.rank} waits in "
                    f"{text} [{mine_fp:08x}]. Every member must call the group's collectives in the same order. (Found "
                    f"when a wait timed out: the calls did not complete, and the group's later calls are undefined.)")
        return None


def _another_family() -> SignatureMismatch | None:
    """The cross-family report of a wait timeout (errors.timeout_reports): SignatureWord.elsewhere of any group of
    this process's world."""
    if not _world.is_initialized():
        return None
    for group in list(_world.get().groups.values()):
        words = group.contexts.get("signatures")
        if words is not None and group.size > 1:
            found = words.elsewhere()
            if found is not None:
                return found
    return None


errors.timeout_reports.append(_another_family)


def signatures(group) -> SignatureWord:
    """The group's SignatureWord (made on first use)."""
    return group.context("signatures", lambda: SignatureWord(group))


def signature_words(group, world_size: int) -> torch.Tensor:
    """A family workspace's signature words in the group's heap: [2][W] LL words and the tripped word, zeroed by
    the workspace's zero_everywhere."""
    return group.heap.empty((2 * world_size + 1,), torch.int64)


# -- launches ---------------------------------------------------------------------

class Launch:
    """A kernel launch with its grid, constexprs and options fixed, for the plans.

    On GPUs the kernel is compiled once, for the specialisation of the first call's arguments
    (`JITFunction.warmup`), and then called straight through its launcher: no argument binding and no
    cache-key hashing per call (a plain `kernel[grid](...)` costs ~20 us of host time). The plan's key
    must therefore cover what Triton specialises on: integer arguments not listed in `do_not_specialize`
    (their value is fixed per plan) and pointer alignment (`signature`). A compiled kernel takes any
    tensor's address for a pointer argument, whatever its dtype, so a plan may pass the caller's tensors
    as they are. Under the interpreter (cpu backend) it is the plain JIT call, which needs tensors of the
    kernel's pointer types.
    """

    def __init__(self, fn, grid, args, constexprs: dict, num_warps: int = 4, num_stages: int | None = None):
        self.fn, self.grid = fn, tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = constexprs
        self.options = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps,
                                                                                  num_stages=num_stages)
        names = fn.arg_names[len(args):]
        if list(names) != list(constexprs):
            raise TypeError(f"{fn.__name__}: constexprs must follow the runtime arguments in order: {names}")
        self.tail = tuple(constexprs.values())
        self.kernel = self.c_launch = None
        # What a plan passes for a pointer argument: the tensor itself under the interpreter (which needs
        # tensors), its address on GPUs (a compiled kernel takes any address, and as an integer the launcher
        # makes no driver query for it: cuPointerGetAttribute per tensor argument).
        self.address = _itself if backend.INTERPRET else torch.Tensor.data_ptr
        if not backend.INTERPRET:
            kernel = fn.warmup(*args, grid=self.grid, **self.options, **constexprs)
            self.kernel = kernel.result() if hasattr(kernel, "result") else kernel
            self.run, self.function, self.meta = self.kernel.run, self.kernel.function, self.kernel.packed_metadata
            self.device = torch.cuda.current_device()
            # The launch function under Triton's Python launcher (C, or its tensor-descriptor unpacking), where
            # that launcher adds nothing else: no scratch memory to allocate for the kernel.
            launcher = self.run
            if not getattr(launcher, "global_scratch_size", 1) and not getattr(launcher, "profile_scratch_size", 1):
                self.c_launch, self.descriptors = _unwrap_descriptors(launcher.launch)
                self.c_head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None)
                self.encoded = {}  # descriptor position -> (its tensor's address, its encoded arguments)

    def arguments(self, args) -> tuple:
        """`args` as the launch takes them (`address` of each tensor, the rest as given): what a plan takes once of
        the arguments every call passes alike."""
        return tuple(self.address(a) if isinstance(a, torch.Tensor) else a for a in args)

    def __call__(self, *args) -> None:
        if self.kernel is None:
            self.fn[self.grid](*args, **self.options, **self.constexprs)
            return
        self._launch(torch._C._cuda_getCurrentRawStream(self.device), args)

    def on(self, stream, *args) -> None:
        """The launch on `stream` (a torch.cuda.Stream) rather than the current one: no stream context to enter
        and leave (a few µs of host time). Under the interpreter, which has no streams, the plain call."""
        if self.kernel is None:
            self.fn[self.grid](*args, **self.options, **self.constexprs)
            return
        self._launch(stream.cuda_stream, args)

    def _launch(self, stream: int, args: tuple) -> None:
        g = self.grid
        enter = triton.knobs.runtime.launch_enter_hook
        if enter is None or not getattr(enter, "calls", True):  # torch installs an empty HookChain
            if self.c_launch is not None:
                if self.descriptors:
                    args = self._encode(args)
                self.c_launch(g[0], g[1], g[2], stream, self.function, *self.c_head, self.meta, None, None, None,
                              *args, *self.tail)
            else:
                self.run(g[0], g[1], g[2], stream, self.function, self.meta, None, None, None, *args, *self.tail)
        else:  # a profiler is listening: give it what the JIT would
            meta = self.kernel.launch_metadata(g, stream, *args, *self.tail)
            self.run(g[0], g[1], g[2], stream, self.function, self.meta, meta, enter,
                     triton.knobs.runtime.launch_exit_hook, *args, *self.tail)

    def _encode(self, args: tuple) -> list:
        """The arguments with each tensor descriptor replaced by its encoded TMA arguments, encoded again only
        when its tensor's address changed since this launch's last call: a weight or a workspace keeps its
        encoding, and encoding (cuTensorMapEncodeTiled) is most of a descriptor's host cost."""
        flat, prev = [], 0
        for i, meta in self.descriptors:
            d = args[i]
            key = (d.base.data_ptr(), id(d))
            hit = self.encoded.get(i)
            if hit is None or hit[0] != key:
                hit = self.encoded[i] = (key, _make_tensordesc_arg(d, meta))
            flat.extend(args[prev:i])
            flat.extend(hit[1])
            prev = i + 1
        flat.extend(args[prev:])
        return flat


def _itself(t):
    return t


def _unwrap_descriptors(launch):
    """Triton wraps the C launch function of a kernel that takes tensor descriptors in a Python function that
    encodes every descriptor on every call. Returns (C launch function, [(argument position, TMA metadata)])
    where every descriptor has TMA metadata (whose encoding holds no tensor, so it may be kept), else
    (launch, None). Reads the wrapper's closure: triton is pinned (3.6.0)."""
    code = getattr(launch, "__code__", None)
    if code is None or "launcher" not in code.co_freevars:
        return launch, None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
    metas = cells.get("tensordesc_meta")
    if not metas or any(m is None for m in metas):
        return launch, None
    return cells["launcher"], list(zip(sorted(cells["tensordesc_indices"]), metas))


# -- the process group's own collectives (what `auto` falls back to) ----------------------

def nccl_from(key: str, group) -> float:
    """The message size (bytes per rank) from which `auto` takes the process group's collective: the measured
    crossover `key` of weft.tuning for the group's size (inf: never). Never on the cpu backend, whose kernels
    are what the tests check, nor on a group of one."""
    if group.device.type != "cuda" or group.size == 1:
        return float("inf")
    return tuning.value(key, group.device, group.size)


nccl_all_gather = process_group.all_gather_into
nccl_reduce_scatter = process_group.reduce_scatter_into
