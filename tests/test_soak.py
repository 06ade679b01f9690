"""Soak: many calls of random collective ops, sizes, dtypes and groups on 3 cpu ranks with random per-rank
delays (WEFT_TEST_DELAY), every result checked against torch, heap use, RSS (and GPU memory) constant over the second half.

Every rank draws the same op, shapes, dtype and layout from the call's number, and builds every member's input
from (call, rank) seeds, so each rank computes its reference alone (no collective beside the op under test).
Inputs are small integers in floating point: sums and products are exact, so reductions compare bit for bit.
CI runs SOAK_CALLS_CI calls (under 40 s); WEFT_SOAK_CALLS=10000 runs the full soak. On GPUs the same soak runs
from tests/test_gpu_faults.py (`_soak(calls, device)`), the inputs made on the CPU and moved to the rank's GPU.
"""
import os
import random

import torch

from weft.testing import run_ranks

SOAK_CALLS_CI = 12
WORLD = 3
DELAY = "all:0.1:10000"  # every rank, one stall point in ten, up to 10 ms
DTYPES = (torch.float32, torch.bfloat16)
RSS_SLACK = 16 << 20  # allocator noise; a leak of a plan or buffer per call grows far past it over a soak


def _members(group, world_size: int) -> list:
    """The world ranks of `group` (a weft Group, a torch ProcessGroup, or None: the world), in group order."""
    import torch.distributed as dist

    if group is None:
        return list(range(world_size))
    if isinstance(group, dist.ProcessGroup):
        return dist.get_process_group_ranks(group)
    return list(group.ranks)


_DEVICE = [torch.device("cpu")]  # where the cases' tensors live: soak() sets it


def _ints(seed: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).to(dtype).to(_DEVICE[0])


# Each case: (rng, call, members, me, group kwargs) -> None, asserting its result. `rng` is the call's generator
# (the same draws on every rank); inputs of rank r come from _ints((call, r) seeds).

def _all_gather(rng, call, members, me, group):
    import weft

    shape, dtype = (rng.choice((1, 3, 8)), rng.choice((5, 16))), rng.choice(DTYPES + (torch.int32,))
    xs = [_ints(call * 64 + r, shape, dtype) for r in members]
    out = torch.empty((len(members) * shape[0], shape[1]), dtype=dtype, device=_DEVICE[0])
    out.view(torch.uint8).fill_(0xAB)
    got = weft.ops.all_gather(xs[members.index(me)], out=out, method=rng.choice(("push", "pull", "auto")), **group)
    assert torch.equal(got, torch.cat(xs)), f"all_gather {shape} {dtype} over {members}"


def _all_reduce(rng, call, members, me, group):
    import weft

    shape, dtype = (rng.choice((1, 7, 130)),), rng.choice(DTYPES)
    xs = [_ints(call * 64 + r, shape, dtype) for r in members]
    got = weft.ops.all_reduce(xs[members.index(me)], method=rng.choice(("one_shot", "two_shot", "auto")), **group)
    assert torch.equal(got, sum(x.float() for x in xs).to(dtype)), f"all_reduce {shape} {dtype}"


def _reduce_scatter(rng, call, members, me, group):
    import weft

    m, cols, dtype = rng.choice((1, 4)), rng.choice((3, 16)), rng.choice(DTYPES)
    xs = [_ints(call * 64 + r, (len(members) * m, cols), dtype) for r in members]
    i = members.index(me)
    got = weft.ops.reduce_scatter(xs[i], **group)
    assert torch.equal(got, sum(x.float() for x in xs).to(dtype)[i * m:(i + 1) * m]), f"reduce_scatter {m} {dtype}"


def _broadcast(rng, call, members, me, group):
    import weft

    shape, dtype, root = (rng.choice((1, 9, 64)),), rng.choice(DTYPES), rng.randrange(len(members))
    xs = [_ints(call * 64 + r, shape, dtype) for r in members]
    got = weft.ops.broadcast(xs[members.index(me)], root=root, **group)
    assert torch.equal(got, xs[root]), f"broadcast {shape} {dtype} root {root}"


def _ag_gemm(rng, call, members, me, group):
    import weft

    m, n, k = rng.choice((4, 16)), rng.choice((8, 24)), rng.choice((8, 16))
    shards = [_ints(call * 64 + r, (m, k), torch.float32) for r in members]
    b = _ints(call * 64 + 63, (k, n), torch.float32)
    got = weft.ops.ag_gemm(shards[members.index(me)], b, method=rng.choice(("overlap", "baseline")), **group)
    assert torch.equal(got, torch.cat(shards) @ b), f"ag_gemm {m}x{n}x{k}"


def _gemm_rs(rng, call, members, me, group):
    import weft

    w, i = len(members), members.index(me)
    rows, n, k = rng.choice((1, 4)) * w, rng.choice((8, 24)), rng.choice((8, 16))
    a = [_ints(call * 64 + r, (rows, k), torch.float32) for r in members]
    b = [_ints(call * 64 + 32 + r, (k, n), torch.float32) for r in members]
    got = weft.ops.gemm_rs(a[i], b[i], **group)
    full = sum(ar @ br for ar, br in zip(a, b))
    m = rows // w
    assert torch.equal(got, full[i * m:(i + 1) * m]), f"gemm_rs {rows}x{n}x{k}"


def _ulysses(rng, call, members, me, group):
    import weft

    w, i = len(members), members.index(me)
    s, heads, d, dtype = rng.choice((1, 5)), w * rng.choice((1, 2)), rng.choice((4, 8)), rng.choice(DTYPES)
    xs = [_ints(call * 64 + r, (s, heads, d), dtype) for r in members]
    got = weft.ops.ulysses_all_to_all(xs[i], scatter="heads", **group)
    h = heads // w
    assert torch.equal(got, torch.cat([x[:, i * h:(i + 1) * h] for x in xs])), f"ulysses {s} {heads} {d} {dtype}"


def _ep(rng, call, members, me, group):
    """ep_dispatch then ep_combine of the received rows as they came: each token comes back times the number
    of ranks it went to."""
    import weft

    w, i = len(members), members.index(me)
    tokens, hidden, experts, k = rng.choice((1, 6)), rng.choice((8, 24)), 2 * w, 2
    dtype = rng.choice(DTYPES)
    local = experts // w
    xs, idxs = [], []
    for r in members:
        g = torch.Generator().manual_seed(call * 64 + r)
        xs.append(_ints(call * 64 + r, (tokens, hidden), dtype))
        idxs.append(torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(_DEVICE[0]))
    wts = torch.ones(tokens, k, device=_DEVICE[0])
    recv_x, _, _, _, handle = weft.ops.ep_dispatch(xs[i], idxs[i], wts, experts, **group)
    expected = torch.cat([x[(idx // local == i).any(1)] for x, idx in zip(xs, idxs)])
    assert torch.equal(recv_x, expected), f"ep_dispatch {tokens} {hidden} {dtype}"
    got = weft.ops.ep_combine(recv_x, handle)
    ranks_reached = torch.stack([(idxs[i] // local == r).any(1) for r in range(w)]).sum(0)
    assert torch.equal(got, (xs[i].float() * ranks_reached[:, None]).to(dtype)), f"ep_combine {tokens} {dtype}"


CASES = {"all_gather": _all_gather, "all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
         "broadcast": _broadcast, "ag_gemm": _ag_gemm, "gemm_rs": _gemm_rs, "ulysses_all_to_all": _ulysses,
         "ep": _ep}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gpu_bytes() -> int:
    """The caching allocator's bytes in use on this rank's GPU (0 on the cpu backend)."""
    return torch.cuda.memory_allocated() if _DEVICE[0].type == "cuda" else 0


def _heaps(layouts) -> dict:
    import weft

    used = {"world": weft.world().heap.used}
    for name, g in layouts.items():
        heap = getattr(g, "heap", None) if g is not None and hasattr(g, "ranks") else None
        if heap is not None:
            used[name] = heap.used
    return used


def _soak(calls: int, device: str = "cpu"):
    import weft
    from weft.testing.groups import layouts

    _DEVICE[0] = torch.device(device)
    me, w = weft.rank(), weft.world_size()
    groups = layouts()
    schedule = [(op, name) for op in CASES for name in groups]  # every op on every layout of weft.testing.groups

    def run(call, op, name):
        group = groups[name]
        CASES[op](random.Random(call), call, _members(group, w), me, {"group": group})

    for call, (op, name) in enumerate(schedule):  # warm-up: every op on every layout once
        run(call, op, name)
    # Memory is compared from the soak's middle on: a family's workspace is made at its first use, and a method
    # the warm-up did not draw (methods are drawn at random) may come later; then nothing may grow.
    heaps, rss = _heaps(groups), None
    for call in range(len(schedule), len(schedule) + calls):
        op, name = random.Random(call).choice(schedule)  # the same on every rank
        run(call, op, name)
        if call == len(schedule) + calls // 2:
            heaps, rss, gpu_bytes = _heaps(groups), _rss(), _gpu_bytes()
    assert _heaps(groups) == heaps, "heap use grew in the second half of the soak"
    if rss is not None:
        assert _gpu_bytes() <= gpu_bytes + RSS_SLACK, f"GPU memory grew by {(_gpu_bytes() - gpu_bytes) >> 20} MiB"
        assert _rss() - rss <= RSS_SLACK, f"RSS grew by {(_rss() - rss) >> 20} MiB in the second half of the soak"
    return True


def test_soak_random_ops_groups_sizes_and_dtypes_with_delays():
    calls = int(os.environ.get("WEFT_SOAK_CALLS", SOAK_CALLS_CI))
    env = {"WEFT_WAIT_TIMEOUT_S": "60", "WEFT_TEST_DELAY": os.environ.get("WEFT_TEST_DELAY") or DELAY}
    assert all(run_ranks(_soak, WORLD, calls, timeout=max(300, calls), env=env))
