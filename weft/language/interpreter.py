"""Interpreter forms of the primitives that cannot be plain `tl` code.

Under TRITON_INTERPRET a kernel is ordinary Python, so a spin can sleep,
check a deadline and raise an error that names the rank and the flag. These
functions are called only inside `if INTERPRET:` branches, which the GPU
compiler never visits; the marker below keeps Triton's dependency scan (run
when a kernel is compiled) from rejecting them as unknown Python functions.

The test delay (WEFT_TEST_DELAY, tests only): the chosen ranks stall at random
before each access to a peer's memory (`symm_at` to another rank: every push,
pull and notify) and before each copy-engine copy the host issues (`stall`),
so that a consumer that forgets a wait reads data that has not arrived yet.
Read once per process (again after a fork); unset, a stall point costs one
comparison.
"""
import ctypes
import os
import random
import time

import numpy as np
import triton.language as tl

from ..runtime import settings
from ..runtime.errors import OffNodeAccess, WaitTimeout


def interpreter_only(fn):
    fn.__triton_builtin__ = True
    return fn


def _scalar(x):
    if isinstance(x, tl.constexpr):
        x = x.value
    if isinstance(x, tl.tensor):
        return np.asarray(x.handle.data).reshape(-1)[0].item()
    return x


_CMP = {0: ("==", lambda a, b: a == b), 1: ("!=", lambda a, b: a != b), 2: (">", lambda a, b: a > b),
        3: ("<=", lambda a, b: a <= b), 4: ("<", lambda a, b: a < b), 5: (">=", lambda a, b: a >= b)}


def _who(me, peer, op) -> str:
    me = int(_scalar(me))
    me = os.environ.get("RANK", "0") if me < 0 else me
    peer = int(_scalar(peer))
    return f"weft {_scalar(op)}: rank {me}", (f"rank {peer}" if peer >= 0 else "a peer")


@interpreter_only
def spin_wait(flag_ptr, count, value, cmp, me=-1, peer=0, op="wait", ranks=0):
    """Acquire-poll `count` consecutive flags until each satisfies `flag <cmp> value` (flag i is raised by
    rank `peer + i`, or with ranks > 0 by rank i % ranks)."""
    count, value, cmp, ranks = int(_scalar(count)), _scalar(value), int(_scalar(cmp)), int(_scalar(ranks))
    symbol, ok = _CMP[cmp]
    timeout = settings.wait_timeout_s()
    start = time.monotonic()
    seen = None
    for i in range(count):
        ptr = flag_ptr + i
        nap = 0.0
        while True:
            seen = _scalar(tl.atomic_add(ptr, 0, sem="acquire", scope="sys"))
            if ok(seen, value):
                break
            if timeout > 0 and time.monotonic() - start > timeout:
                who, _ = _who(me, peer, op)
                raise WaitTimeout(
                    f"{who} timed out after {timeout:g} s waiting for the signal of rank "
                    f"{i % ranks if ranks else int(_scalar(peer)) + i} "
                    f"(flag {i} of {count} at address 0x{_scalar(ptr):x}): expected flag {symbol} {value}, "
                    f"seen {seen}")
            # Ranks share few cores: back off so the rank we wait for can run.
            time.sleep(nap)
            nap = min(1e-3, nap * 2 + 2e-5)
    return tl.full([], seen, tl.int64) if seen is not None else tl.full([], 0, tl.int64)


@interpreter_only
def spin_wait_ll(ptrs, mask, epoch, me=-1, peer=-1, op="LL wait"):
    """Poll the 64-bit LL words at `ptrs` (where `mask`) until every high half equals `epoch`."""
    epoch = int(_scalar(epoch))
    timeout = settings.wait_timeout_s()
    start = time.monotonic()
    nap = 0.0
    while True:
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
        tags = np.asarray(words.handle.data).astype(np.int64) >> 32
        live = np.asarray(mask.handle.data).astype(bool) if isinstance(mask, tl.tensor) else True
        missing = np.flatnonzero((tags != epoch) & live)
        if missing.size == 0:
            return words
        if timeout > 0 and time.monotonic() - start > timeout:
            i = int(missing[0])
            addr = int(np.asarray(ptrs.handle.data).reshape(-1)[i])
            who, whom = _who(me, peer, op)
            raise WaitTimeout(
                f"{who} timed out after {timeout:g} s waiting for the LL words of {whom} ({missing.size} missing; "
                f"first: word {i} of a block at address 0x{addr:x}): expected epoch {epoch}, "
                f"seen {int(tags.reshape(-1)[i])}")
        time.sleep(nap)
        nap = min(1e-3, nap * 2 + 2e-5)


# The signature check's interpreter forms (signals.sign, signals.check_signed): the same words, read and written
# through their addresses, a few Python steps instead of a few dozen interpreted tensor ops per program.

def _address(ptr) -> int:
    return int(np.asarray(ptr.handle.data).reshape(-1)[0])


def _word(address: int) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(address)


def _members(heap) -> tuple[int, int, list[int]]:
    """(my rank, group size, every member's heap base) from a heap descriptor (weft.language.core)."""
    at = _address(heap)
    me, n = _word(at).value, _word(at + 8).value
    return me, n, [_word(at + 16 + 8 * q).value for q in range(n)]


@interpreter_only
def sign_words(sig, epoch, fp, heap):
    me, n, bases = _members(heap)
    epoch, fp = int(_scalar(epoch)), int(_scalar(fp))
    slot = _address(sig) + 8 * ((epoch % 2) * n + me)
    for q in range(n):
        if q != me:
            stall()
        _word(slot + bases[q] - bases[me]).value = (epoch << 32) | fp


@interpreter_only
def check_signed_words(sig, epoch, fp, heap, err, op="signature check"):
    """Await every member's signature word of `epoch`; on a mismatch record it in `err` and trip the family."""
    me, n, _ = _members(heap)
    epoch, fp = int(_scalar(epoch)), int(_scalar(fp))
    base = _address(sig)
    timeout = settings.wait_timeout_s()
    start = time.monotonic()
    for q in range(n):
        word = _word(base + 8 * ((epoch % 2) * n + q))
        nap = 0.0
        while word.value >> 32 != epoch:
            if timeout > 0 and time.monotonic() - start > timeout:
                raise WaitTimeout(
                    f"weft {_scalar(op)}: rank {me} timed out after {timeout:g} s waiting for the signature of rank "
                    f"{q}: expected epoch {epoch}, seen {word.value >> 32} (rank {q} runs no call of this op family)")
            time.sleep(nap)
            nap = min(1e-3, nap * 2 + 2e-5)
        theirs = word.value & 0xFFFFFFFF
        if theirs != fp:
            record = _address(err)
            for i, value in ((1, q), (2, fp), (3, theirs), (0, 1)):
                _word(record + 8 * i).value = value
            _word(base + 8 * 2 * n).value = 1
            return tl.full([], 0, tl.int1)
    return tl.full([], 1, tl.int1)


@interpreter_only
def monotonic_ns():
    return tl.full([], time.monotonic_ns(), tl.int64)


# The test delay: _UNREAD until this process's first stall point reads WEFT_TEST_DELAY, then None (off) or
# (probability, most seconds, this process's generator). A forked rank reads it anew (its env may differ).
_UNREAD = object()
_delay = _UNREAD


def _forget_delay():
    global _delay
    _delay = _UNREAD


os.register_at_fork(after_in_child=_forget_delay)


def _read_delay():
    global _delay
    config = settings.test_delay()
    if config is None or not config.stalls(int(os.environ.get("RANK", "0"))):
        _delay = None
    else:
        _delay = (config.probability, config.max_us * 1e-6, random.Random())  # seeded from os.urandom
    return _delay


def stall() -> None:
    """A stall point of the test delay (host code may call it too: the cpu copy engine's pushes)."""
    delay = _delay
    if delay is None:
        return
    if delay is _UNREAD:
        delay = _read_delay()
        if delay is None:
            return
    probability, most, rng = delay
    if rng.random() < probability:
        time.sleep(rng.random() * most)


def _int64_at(address: int) -> int:
    return ctypes.c_int64.from_address(address).value


@interpreter_only
def check_same_node(heap, me, peer):
    """Raise OffNodeAccess unless every rank of `peer` (a rank, or a block of ranks) is on `me`'s node: the heap
    descriptor's node ids (weft.runtime.heap), read straight from memory (one call, no interpreted loads)."""
    base = int(_scalar(heap))
    world = _int64_at(base + 8)
    me = int(_scalar(me))
    peers = np.asarray(peer.handle.data).reshape(-1) if isinstance(peer, tl.tensor) else [_scalar(peer)]
    mine = _int64_at(base + 8 * (2 + world + me))
    for p in peers:
        p = int(p)
        if 0 <= p < world and p != me:
            theirs = _int64_at(base + 8 * (2 + world + p))
            if theirs != mine:
                raise OffNodeAccess(
                    f"weft symm_at: rank {me} (node {mine}) translated a pointer to rank {p} (node {theirs}) of its "
                    f"group: symm_at reaches the ranks of its own node only; reach another node through the "
                    f"network primitives (putmem*, getmem*, signal_op, signal_wait_until)")


@interpreter_only
def stall_before_peer(me, peer):
    """`stall` when `peer` (a rank, or a block of ranks) is not only `me`: before an access to a peer."""
    if _delay is None:
        return
    peers = np.asarray(peer.handle.data) if isinstance(peer, tl.tensor) else _scalar(peer)
    if np.any(peers != _scalar(me)):
        stall()
