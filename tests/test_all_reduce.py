"""all_reduce (one_shot, two_shot, auto), reduce_scatter and broadcast on cpu ranks.

Every rank builds every rank's input from a seed, so each rank checks its
result against a torch reference on its own. Outputs are poisoned with NaN
before each call; calls follow each other with fresh data and no host
barrier (ranks skewed on purpose), so the epoch flags and the staging
buffer protection are exercised. Results must also be bit-identical across
ranks (and between one_shot and two_shot, which sum in the same order).
"""
import pytest

from weft.testing import run_ranks
from weft.testing.checks import rejects

DTYPES = ("float32", "bfloat16", "float16")
TOL = {"float32": dict(rtol=1e-6, atol=1e-6), "bfloat16": dict(rtol=1e-2, atol=1e-2),
       "float16": dict(rtol=2e-3, atol=2e-3)}
ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}  # a lost signal fails with a message instead of hanging
TIMEOUT = 150


# -- helpers run on the ranks ----------------------------------------------------

def _inputs(seed, shape, dtype_name, w):
    import torch

    dtype = getattr(torch, dtype_name)
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed * 64 + r)).to(dtype) for r in range(w)]


def _bits(t):
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _digest(t):
    import hashlib

    return hashlib.sha1(_bits(t).numpy().tobytes()).hexdigest()


def _skew(me, call, w):
    """A different rank arrives late at each call."""
    import time

    if w > 1 and me == call % w:
        time.sleep(0.02)


def _all_reduce_cases(cases, calls):
    """cases: (method, dtype name, shape, mode), mode "out" | "inplace" | "none" | "symm_out" (out from
    weft.empty: two-shot pushes straight into it) | "symm_inplace" (x from weft.empty, reduced in place)."""
    import zlib

    import torch

    import weft
    from weft.kernels.all_reduce import all_reduce

    me, w = weft.rank(), weft.world_size()
    digests = {}
    for method, dtype_name, shape, mode in cases:
        for call in range(calls):
            seed = zlib.crc32(repr((dtype_name, tuple(shape), mode, call)).encode()) % 100_000  # same for every method
            xs = _inputs(seed, shape, dtype_name, w)
            acc = torch.zeros(shape, dtype=torch.float32)
            for t in xs:
                acc += t.float()
            ref = acc.to(xs[0].dtype)
            x = xs[me].clone()
            _skew(me, call, w)
            if mode in ("inplace", "symm_inplace"):
                if mode == "symm_inplace":
                    x = weft.empty(shape, x.dtype).copy_(x)
                got = all_reduce(x, method=method, out=x)
                assert got is x
            elif mode in ("out", "symm_out"):
                out = torch.full(shape, float("nan"), dtype=x.dtype)
                if mode == "symm_out":
                    out = weft.empty(shape, x.dtype).fill_(float("nan"))
                got = all_reduce(x, method=method, out=out)
                assert got is out
            else:
                got = all_reduce(x, op="sum", method=method)
            if mode not in ("inplace", "symm_inplace"):
                assert torch.equal(x, xs[me]), "input was modified"
            assert got.shape == ref.shape and got.dtype == ref.dtype
            torch.testing.assert_close(got, ref, **TOL[dtype_name],
                                       msg=lambda m: f"{method} {dtype_name} {shape} {mode} call {call}: {m}")
            digests[(method, dtype_name, tuple(shape), mode, call)] = _digest(got)
    return digests


def _check_same_everywhere(results):
    """Every rank got the same bits; one_shot and two_shot agree bit for bit."""
    first = results[0]
    for r, d in enumerate(results[1:], 1):
        assert d == first, f"rank {r} differs from rank 0"
    by_key = {}
    for (method, *rest), digest in first.items():
        if method in ("one_shot", "two_shot"):
            by_key.setdefault(tuple(rest), set()).add(digest)
    for key, ds in by_key.items():
        assert len(ds) == 1, f"one_shot and two_shot differ for {key}"


# -- all_reduce ---------------------------------------------------------------------

def _cases(methods, dtypes, shapes, modes):
    """Every (method, dtype, mode); shapes cycle, the same for every method (so methods can be compared)."""
    out = []
    for m in methods:
        i = 0
        for d in dtypes:
            for mode in modes:
                out.append((m, d, shapes[i % len(shapes)], mode))
                i += 1
    return out


def test_all_reduce_2_ranks_every_method_dtype_mode():
    # Odd and even element counts: one-shot and two-shot send whole 4-byte words as LL words (16-bit dtypes
    # need an even count), anything else by the push path; (20000,) fp32 is above all_reduce.ll_max_bytes.
    cases = _cases(("one_shot", "two_shot", "auto"), DTYPES, [(1,), (7, 3), (1000,), (33, 5), (2, 7), (1001,)],
                   ("out", "inplace", "none", "symm_out", "symm_inplace"))
    cases += [(m, "float32", (9001,), "out") for m in ("one_shot", "two_shot")]  # several programs and blocks
    cases += [(m, "float32", (20000,), "out") for m in ("one_shot", "two_shot")]
    _check_same_everywhere(run_ranks(_all_reduce_cases, 2, cases, 2, timeout=TIMEOUT, env=ENV))


def test_all_reduce_3_ranks():  # 4 ranks: test_every_op_on_every_group_layout
    w = 3
    cases = _cases(("one_shot", "two_shot"), DTYPES, [(1001,), (5, 7), (2,)], ("out", "inplace", "symm_out"))
    cases += [("two_shot", "bfloat16", (3, 1001), "symm_inplace"), ("two_shot", "float32", (9001,), "symm_out")]
    cases += [("auto", "bfloat16", (4097,), "none"), ("two_shot", "float32", (9001,), "out")]
    _check_same_everywhere(run_ranks(_all_reduce_cases, w, cases, 2, timeout=TIMEOUT, env=ENV))


@pytest.mark.long  # 20 s here; 2 and 3 ranks run in CI
def test_all_reduce_8_ranks_small():
    cases = _cases(("one_shot", "two_shot", "auto"), DTYPES, [(37,), (259,), (3, 5)], ("out",))
    cases += [("two_shot", "float32", (37,), "inplace"), ("two_shot", "float16", (259,), "symm_inplace")]
    _check_same_everywhere(run_ranks(_all_reduce_cases, 8, cases, 2, timeout=TIMEOUT, env=ENV))


def _one_shot_paths():
    import torch

    import weft
    from weft import tuning
    from weft.kernels.all_reduce import all_reduce

    ll_max_bytes = tuning.value("all_reduce.ll_max_bytes", weft.world().device, weft.world_size())
    small = torch.ones(ll_max_bytes // 4)
    large = torch.ones(ll_max_bytes // 4 + 4)
    for x in (small, large):
        assert torch.equal(all_reduce(x, method="one_shot"), x * weft.world_size())
    return sorted(p.path for k, p in weft.world().plans.items() if k[0] == "all_reduce")


def test_one_shot_takes_ll_path_up_to_its_limit():
    assert run_ranks(_one_shot_paths, 2, timeout=TIMEOUT, env=ENV) == [["ll", "one_shot"]] * 2


def _two_shot_paths():
    """Two-shot on random data at both sides of its LL limits (lowered, so the interpreter stays quick),
    into a plain and into a symmetric out; returns the context kinds that served each call."""
    import torch

    import weft
    from weft import tuning
    from weft.kernels import all_reduce as ar

    me, w = weft.rank(), weft.world_size()
    kinds = []
    lowered = {"all_reduce.ll_two_shot_max_bytes": 4096, "all_reduce.ll_two_shot_symmetric_max_bytes": 2048}
    with tuning.overrides(lowered):
        for seed, (numel, symmetric) in enumerate([(1024, False), (1028, False), (512, True), (516, True)]):
            xs = _inputs(300 + seed, (numel,), "float32", w)
            ref = torch.stack(xs).sum(0)
            out = weft.empty((numel,), torch.float32) if symmetric else torch.empty(numel)
            out.fill_(float("nan"))
            before = set(weft.world().plans)
            torch.testing.assert_close(ar.all_reduce(xs[me], method="two_shot", out=out), ref, rtol=1e-6, atol=1e-6)
            kinds += [weft.world().plans[k].path for k in set(weft.world().plans) - before if k[0] == "all_reduce"]
    return kinds


def test_two_shot_takes_ll_path_up_to_its_limits():
    expected = ["ll_two_shot", "two_shot", "ll_two_shot", "two_shot"]
    assert run_ranks(_two_shot_paths, 3, timeout=TIMEOUT, env=ENV) == [expected] * 3


def _auto_choice():
    import torch

    from weft.kernels import all_reduce as ar

    return [(nbytes, w, ar._auto_method(nbytes, torch.device("cpu"), w))
            for nbytes in (8 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20) for w in (2, 4, 8)]


def test_auto_crossover():
    choice = {(b, w): m for b, w, m in _auto_choice()}
    assert choice[(8 << 10, 8)] == "one_shot" and choice[(512 << 10, 8)] == "two_shot"
    assert choice[(1 << 20, 8)] == "two_shot" and choice[(4 << 20, 8)] == "two_shot"
    assert choice[(512 << 10, 4)] == "one_shot" and choice[(1 << 20, 4)] == "two_shot"  # measured on 4 H200s
    assert choice[(1 << 20, 2)] == "one_shot" and choice[(4 << 20, 2)] == "one_shot"  # measured on 2 H200s


# -- reduce_scatter -------------------------------------------------------------------

def _reduce_scatter_cases(cases, calls):
    """cases: (dtype name, rows per rank m, trailing shape, mode): mode "out", "none", or "inplace"
    (out = my own row block of x, as NCCL's in-place reduce_scatter)."""
    import torch

    import weft
    from weft.kernels.all_reduce import reduce_scatter

    me, w = weft.rank(), weft.world_size()
    digests = {}
    for ci, (dtype_name, m, tail, mode) in enumerate(cases):
        shape = (w * m, *tail)
        for call in range(calls):
            xs = _inputs(1000 + ci * 10 + call, shape, dtype_name, w)
            acc = torch.zeros((m, *tail), dtype=torch.float32)
            for t in xs:
                acc += t[me * m:(me + 1) * m].float()
            ref = acc.to(xs[0].dtype)
            x = xs[me].clone()
            _skew(me, call, w)
            if mode == "out":
                out = torch.full((m, *tail), float("nan"), dtype=x.dtype)
                got = reduce_scatter(x, out=out)
                assert got is out
            elif mode == "inplace":
                got = reduce_scatter(x, out=x[me * m:(me + 1) * m])
                assert got.data_ptr() == x[me * m].data_ptr()
            else:
                got = reduce_scatter(x, op="sum")
            if mode != "inplace":
                assert torch.equal(x, xs[me]), "input was modified"
            torch.testing.assert_close(got, ref, **TOL[dtype_name],
                                       msg=lambda s: f"{dtype_name} m={m} {tail} {mode} call {call}: {s}")
            digests[(dtype_name, m, tail, mode, call)] = _digest(got)
    return digests


@pytest.mark.parametrize("w", [2, 3])  # 4 ranks: test_every_op_on_every_group_layout
def test_reduce_scatter(w):
    # Every (dtype, shape, mode) at one of the two world sizes: 3 ranks the even-numbered, 2 the others.
    cases = [(d, m, tail, mode) for d in DTYPES for (m, tail) in [(1, ()), (3, (7,)), (257, ())]
             for mode in ("out", "none", "inplace")][(1 if w == 2 else 0)::2]
    cases.append(("float32", 2049, (), "out"))  # several blocks per program, 16-byte vector path off (odd)
    cases.append(("bfloat16", 1024, (4,), "out"))  # vector path on
    run_ranks(_reduce_scatter_cases, w, cases, 2, timeout=TIMEOUT, env=ENV)




# -- broadcast -------------------------------------------------------------------------

def _broadcast_cases(cases, roots):
    """cases: (dtype name, shape); each is broadcast once from every root in `roots`, back to back."""
    import torch

    import weft
    from weft.kernels.all_reduce import broadcast

    me, w = weft.rank(), weft.world_size()
    digests = {}
    for ci, (dtype_name, shape) in enumerate(cases):
        for call, root in enumerate(roots):
            root = root % w
            dtype = getattr(torch, dtype_name)
            want = (torch.randn(shape, generator=torch.Generator().manual_seed(ci * 100 + call)) * 100).to(dtype)
            if me == root:
                x = want.clone()
            elif dtype.is_floating_point:
                x = torch.full(shape, float("nan"), dtype=dtype)
            else:
                x = torch.full(shape, -1, dtype=dtype)
            _skew(me, call, w)
            got = broadcast(x, root=root)
            assert got is x
            assert torch.equal(x, want), f"{dtype_name} {shape} root {root} call {call}"
            digests[(dtype_name, shape, call)] = _digest(x)
    return digests


@pytest.mark.parametrize("w", [2, 3])  # 4 ranks: test_every_op_on_every_group_layout
def test_broadcast(w):
    cases = [("float32", (1001,)), ("bfloat16", (7, 3)), ("float16", (4099,)), ("int64", (5,)), ("int8", (1001,)),
             ("float32", (3000,))]
    roots = [0, w - 1, 1, 1, 0]  # the root changes between calls
    results = run_ranks(_broadcast_cases, w, cases, roots, timeout=TIMEOUT, env=ENV)
    assert all(r == results[0] for r in results)


def _reduce_scatter_and_broadcast_8_ranks():
    _reduce_scatter_cases([("bfloat16", 3, (5,), "out")], 2)
    return _broadcast_cases([("float16", (37,))], [0, 7, 3])


def test_reduce_scatter_and_broadcast_8_ranks():  # 1 rank: groups of one in test_every_op_on_every_group_layout
    """Both at 8 ranks in one run: starting 8 ranks costs as much as their small cases."""
    results = run_ranks(_reduce_scatter_and_broadcast_8_ranks, 8, timeout=TIMEOUT, env=ENV)
    assert all(r == results[0] for r in results)


# -- bad inputs: rejected before anything is written --------------------------------------

def _bad_inputs():
    import torch
    import torch.distributed as dist

    import weft
    from weft.kernels.all_reduce import all_reduce, broadcast, reduce_scatter

    world = weft.world()
    me, w = weft.rank(), weft.world_size()
    x = torch.randn(10)
    out = torch.full((10,), float("nan"))
    used, contexts = world.heap.used, len(world.contexts)
    g = [x, out]
    # all_reduce
    rejects(lambda: all_reduce(x.to(torch.complex64), out=out), TypeError, "x", g)
    rejects(lambda: all_reduce([1.0, 2.0], out=out), TypeError, "x", g)
    rejects(lambda: all_reduce(x, op="xor", out=out), ValueError, "op", g)
    rejects(lambda: all_reduce(x, op=dist.ReduceOp.BAND, out=out), ValueError, "op", g)
    rejects(lambda: all_reduce(x, op=dist.ReduceOp.PREMUL_SUM, out=out), ValueError, "op", g)
    rejects(lambda: all_reduce(x, method="three_shot", out=out), ValueError, "method", g)
    rejects(lambda: all_reduce(x, out=torch.full((11,), float("nan"))), ValueError, "out", g)
    rejects(lambda: all_reduce(x, out=out.to(torch.float16)), TypeError, "out", g)
    shared = torch.randn(12)
    rejects(lambda: all_reduce(shared[:10], out=shared[2:]), ValueError, "out", g + [shared])  # overlaps x
    # reduce_scatter
    xr = torch.randn(w * 3 + 1, 2)
    outr = torch.full((3, 2), float("nan"))
    gr = [xr, outr]
    if w > 1:
        rejects(lambda: reduce_scatter(xr, out=outr), ValueError, "x", gr)  # rows not divisible by w
    rejects(lambda: reduce_scatter(torch.randn(()), out=outr), ValueError, "x", gr)
    xr = torch.randn(w * 3, 2)
    gr = [xr, outr]
    rejects(lambda: reduce_scatter(xr.to(torch.complex128), out=outr), TypeError, "x", gr)
    rejects(lambda: reduce_scatter(xr, op="prod", out=outr), ValueError, "op", gr)
    rejects(lambda: reduce_scatter(xr, op=dist.ReduceOp.BXOR, out=outr), ValueError, "op", gr)
    rejects(lambda: reduce_scatter(xr, out=torch.full((3, 3), float("nan"))), ValueError, "out", gr)
    rejects(lambda: reduce_scatter(xr, out=outr.to(torch.bfloat16)), TypeError, "out", gr)
    if w > 1:  # out inside x but not at a row block boundary
        rejects(lambda: reduce_scatter(xr, out=xr.view(-1)[1:7].view(3, 2)), ValueError, "out", gr)
    # broadcast
    xb = torch.full((6,), float("nan")) if me else torch.randn(6)
    for root in (-1, w, "0", True, 0.0, None):
        rejects(lambda: broadcast(xb, root=root), ValueError, "root", [xb])
    rejects(lambda: broadcast("x", root=0), TypeError, "x", [xb])
    # Nothing was allocated by the rejected calls, and the ops still work afterwards.
    assert world.heap.used == used and len(world.contexts) == contexts
    xs = _inputs(7, (10,), "float32", w)
    got = all_reduce(xs[me].clone(), out=out)
    torch.testing.assert_close(got, sum(t for t in xs), rtol=1e-6, atol=1e-6)
    got = reduce_scatter(torch.ones(w * 3, 2), out=outr)
    assert torch.equal(got, torch.full((3, 2), float(w)))
    big = torch.full((20,), float("nan"))  # a strided out is written through a contiguous temporary
    got = all_reduce(xs[me].clone(), out=big[::2])
    torch.testing.assert_close(got, sum(t for t in xs), rtol=1e-6, atol=1e-6)
    assert got.data_ptr() == big.data_ptr() and big[1::2].isnan().all()
    want = torch.arange(6.0)
    xb = want.clone() if me == w - 1 else torch.zeros(6)
    assert torch.equal(broadcast(xb, root=w - 1), want)
    nc = torch.full((6, 2), 7.0)  # a column of a matrix: broadcast in place through a contiguous temporary
    if me == w - 1:
        nc[:, 0] = want
    assert torch.equal(broadcast(nc[:, 0], root=w - 1), want) and (nc[:, 1] == 7.0).all()


@pytest.mark.parametrize("w", [1, 2])
def test_bad_inputs_rejected_before_writing(w):
    run_ranks(_bad_inputs, w, timeout=TIMEOUT, env=ENV)


# -- every reduction op and dtype, against torch.distributed (gloo) ------------------------------------------

ALL_DTYPES = ("float32", "bfloat16", "float16", "float64", "int8", "uint8", "int32", "int64")
OP_NAMES = ("sum", "avg", "max", "min", "product")
FLOAT_TOL = dict(TOL, float64=dict(rtol=1e-12, atol=1e-12))


def _op_inputs(dtype_name, op, shape, seed, w):
    """Every rank's x for `op`: floats around 0 with NaN, +inf and -inf in the first elements (near 1 for product,
    which stays finite); integers over the whole range of the 8- and 32-bit types and up to 2**62 for int64
    (sums wrap), small ones for product."""
    import torch

    dtype = getattr(torch, dtype_name)
    xs = []
    for r in range(w):
        g = torch.Generator().manual_seed(seed * 64 + r)
        if dtype.is_floating_point:
            x = torch.randn(shape, generator=g, dtype=torch.float64)
            x = 1 + x / 8 if op == "product" else x  # gloo rounds 16-bit partial sums: keep them near 1
            flat = x.view(-1)
            if r == 1:
                flat[0] = flat[2] = float("nan")  # NaN alone, and NaN against -inf
            if r == 0:
                flat[1], flat[2] = float("inf"), float("-inf")
            xs.append(x.to(dtype))
        elif op == "product":
            xs.append(torch.randint(-3, 4, shape, generator=g).to(dtype))
        else:
            bits = {torch.int64: 62}.get(dtype, dtype.itemsize * 8)
            lo, hi = (0, 2 ** bits) if dtype == torch.uint8 else (-2 ** (bits - 1), 2 ** (bits - 1))
            xs.append(torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype))
    return xs


def _gloo_reduce(kind, x, op, pg, rows=None):
    """The process group's all_reduce (kind "all_reduce") or reduce_scatter of x with `op`. An integer average,
    which gloo refuses, is the choice weft documents (NCCL's): the wrapped sum divided toward zero."""
    import torch
    import torch.distributed as dist

    from weft.testing.reference import reduce_scatter_ref

    int_avg = op == "avg" and not x.is_floating_point()
    red = dist.ReduceOp.SUM if int_avg else getattr(dist.ReduceOp, op.upper())
    if kind == "all_reduce":
        res = x.clone()
        dist.all_reduce(res, op=red, group=pg)
    else:
        res = torch.empty((rows, *x.shape[1:]), dtype=x.dtype)
        reduce_scatter_ref(res, x, pg, op=red)
    if int_avg:
        res = torch.div(res, dist.get_world_size(pg), rounding_mode="trunc")
    return res


def _torch_reduce(xs, op):
    """torch's own elementwise reduction over the ranks' tensors (NaN propagating in max / min)."""
    import functools

    import torch

    combine = {"max": torch.maximum, "min": torch.minimum}[op]
    return functools.reduce(combine, xs)


def _check_reduced(got, ref, dtype_name, op, what, exact=False):
    import torch

    assert got.shape == ref.shape and got.dtype == ref.dtype, what
    if got.is_floating_point() and op in ("sum", "avg", "product") and not exact:
        torch.testing.assert_close(got, ref, **FLOAT_TOL[dtype_name], equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:  # integers, max and min, and a group of one: bit for bit
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _every_op_and_dtype():
    """all_reduce (one-shot and two-shot, LL words and push) and reduce_scatter of every op and dtype, in one
    launch; ops named by string and by ReduceOp in turn."""
    import contextlib

    import torch
    import torch.distributed as dist

    import weft
    from weft import tuning
    from weft.kernels.all_reduce import all_reduce, reduce_scatter

    me, w = weft.rank(), weft.world_size()
    pg = weft.world().group
    no_ll = {"all_reduce.ll_max_bytes": 0, "all_reduce.ll_two_shot_max_bytes": 0,
             "all_reduce.ll_two_shot_symmetric_max_bytes": 0}
    for ll in (True, False):  # the LL kernels take the float dtypes of an even element count
        dtypes = ALL_DTYPES[:3] if ll else ALL_DTYPES
        shape = (3, 14) if ll else (5, 7)
        with contextlib.nullcontext() if ll else tuning.overrides(no_ll):
            weft.world().plans.clear()
            for di, dtype_name in enumerate(dtypes):
                for oi, op in enumerate(OP_NAMES):
                    given = op if (di + oi) % 2 else getattr(dist.ReduceOp, op.upper())
                    method = ("one_shot", "two_shot")[(di + oi + ll) % 2]
                    xs = _op_inputs(dtype_name, op, shape, 100 * di + oi + 1000 * ll, w)
                    ref = _gloo_reduce("all_reduce", xs[me], op, pg)
                    if xs[me].is_floating_point() and op in ("max", "min"):
                        ref.view(-1)[:3] = _torch_reduce(xs, op).view(-1)[:3]  # where gloo drops NaN
                    out = torch.full(shape, float("nan")).to(xs[me].dtype)
                    got = all_reduce(xs[me], op=given, method=method, out=out)
                    _check_reduced(got, ref, dtype_name, op, f"all_reduce {method} {dtype_name} {op} ll={ll}")
                    if ll:  # reduce_scatter has no LL form
                        continue
                    rs = _op_inputs(dtype_name, op, (w * 2, 7), 100 * di + oi + 7, w)
                    ref = _gloo_reduce("reduce_scatter", rs[me], op, pg, rows=2)
                    if rs[me].is_floating_point() and op in ("max", "min"):
                        ref.view(-1)[:3] = _torch_reduce(rs, op)[2 * me:2 * me + 2].reshape(-1)[:3]
                    got = reduce_scatter(rs[me], op=given)
                    _check_reduced(got, ref, dtype_name, op, f"reduce_scatter {dtype_name} {op}")
            paths = {p.path for k, p in weft.world().plans.items() if k[0] == "all_reduce"}
            assert paths == ({"ll", "ll_two_shot"} if ll else {"one_shot", "two_shot"}), paths
            weft.world().plans.clear()


def test_auto_gives_the_kernels_only_the_measured_op_dtype_pairs():
    """Every (op, dtype) has its auto choice in every shipped table: the kernels for the measured float sums,
    the process group's collective for the pairs not measured yet."""
    from weft import tuning

    for w in (2, 4, 8):
        table = tuning.table_for("all_reduce", "H200", w)
        for op in OP_NAMES:
            flags = table.values[f"all_reduce.kernel_dtypes.{op}"]
            assert sorted(flags) == sorted(ALL_DTYPES), (w, op)
            assert {d for d, kernels in flags.items() if kernels} == \
                ({"float32", "bfloat16", "float16"} if op == "sum" else set()), (w, op)


def test_every_op_and_dtype_matches_gloo():
    run_ranks(_every_op_and_dtype, 2, timeout=TIMEOUT, env=ENV)


# -- groups: every op of the family on the standard layouts ------------------------------------------------------

def _group_call(kind, group, seed):
    """One call of `kind` on `group` (a layout's), with fresh inputs and a poisoned output, checked against
    torch.distributed over the group's process group."""
    import random

    import torch
    import torch.distributed as dist

    import weft
    from weft.runtime.world import resolve
    from weft.testing.reference import all_gather_ref

    g = resolve(group)
    pg, size = g.process_group, g.size
    gen = torch.Generator().manual_seed(seed * 16 + weft.rank())
    pick = random.Random(seed)  # the call's choices, the same on every member
    dtype_name = pick.choice(("float32", "bfloat16", "int64"))
    dtype = getattr(torch, dtype_name)

    def poisoned(shape):
        t = torch.empty(shape, dtype=dtype)
        return t.fill_(float("nan")) if dtype.is_floating_point else t.view(torch.uint8).fill_(0xAB).view(dtype)

    def fresh(shape, op="sum"):
        if op == "product":
            return (1 + torch.randn(shape, generator=gen) / 8).to(dtype) if dtype.is_floating_point else \
                torch.randint(-3, 4, shape, generator=gen).to(dtype)
        return torch.randn(shape, generator=gen).to(dtype) if dtype.is_floating_point else \
            torch.randint(-1000, 1000, shape, generator=gen).to(dtype)

    what = f"{kind} on {g!r} ({dtype_name})"
    if kind == "all_reduce":
        op = pick.choice(OP_NAMES)
        given = op if pick.random() < 0.5 else getattr(dist.ReduceOp, op.upper())
        method = pick.choice(("auto", "one_shot", "two_shot", "nccl"))
        x = fresh((7, 3), op)
        ref = _gloo_reduce("all_reduce", x, op, pg)
        if pick.random() < 0.5:  # in place
            assert weft.ops.all_reduce(x, op=given, method=method, out=x, group=group) is x
            got = x
        else:
            out = poisoned((7, 3))
            assert weft.ops.all_reduce(x, op=given, method=method, out=out, group=group) is out
            got = out
        _check_reduced(got, ref, dtype_name, op, f"{what} {op} {method}", exact=size == 1)
    elif kind == "reduce_scatter":
        op = pick.choice(OP_NAMES)
        method = pick.choice(("auto", "two_shot", "nccl"))
        x = fresh((size * 3, 5), op)
        ref = _gloo_reduce("reduce_scatter", x, op, pg, rows=3)
        out = poisoned((3, 5))
        assert weft.ops.reduce_scatter(x, op=op, out=out, method=method, group=group) is out
        _check_reduced(out, ref, dtype_name, op, f"{what} {op} {method}", exact=size == 1)
    elif kind == "broadcast":
        root = pick.randrange(size)  # a group rank
        want = fresh((5, 3))
        dist.broadcast(want, group=pg, group_src=root)
        x = want.clone() if g.rank == root else poisoned((5, 3))
        assert weft.ops.broadcast(x, root=root, group=group) is x
        assert torch.equal(x, want), f"{what} root {root}"
    else:
        x = fresh((3, 5))
        ref = torch.empty((size * 3, 5), dtype=dtype)
        all_gather_ref(ref, x, pg)
        out = poisoned((size * 3, 5))
        assert weft.ops.all_gather(x, out=out, group=group) is out
        assert torch.equal(out, ref), what
        assert torch.equal(weft.ops.all_gather(x, group=group), ref), what


KINDS = ("all_reduce", "reduce_scatter", "broadcast", "all_gather")


def _on_every_layout(iterations):
    import random

    import torch

    import weft
    from weft.runtime.world import resolve
    from weft.testing.groups import layouts

    groups = layouts()
    calls = [(name, kind) for name in sorted(groups) for kind in KINDS]
    for it in range(iterations):
        order = list(calls)
        random.Random(it).shuffle(order)  # the same order on every rank
        for ci, (name, kind) in enumerate(order):
            _group_call(kind, groups[name], it * 100 + ci)
    # A group of one made no heap and no workspace: its calls were copies, with no kernel.
    one = resolve(groups["one"])
    assert one._heap is None and not one.contexts
    # Traced with a group: one operator call by the group's name; and its backward over the same group.
    pairs = groups["pairs"]
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(weft.rank()))
    compiled = torch.compile(lambda t: weft.ops.all_reduce(t * 2, op="max", group=pairs), fullgraph=True)
    assert torch.equal(compiled(x), weft.ops.all_reduce(x * 2, op="max", group=pairs))
    xg = x.clone().requires_grad_()
    weft.ops.all_reduce(xg, group=pairs).mul(x).sum().backward()
    torch.testing.assert_close(xg.grad, weft.ops.all_reduce(x, group=pairs), rtol=0, atol=0)


@pytest.mark.long  # 42 s here; in CI the reductions run over groups in tests/test_nodes.py and test_distributed_backend.py
def test_every_op_on_every_group_layout():
    run_ranks(_on_every_layout, 4, 2, timeout=TIMEOUT, env=ENV)


def _beside_a_leftover_rank(iterations):
    """Ranks 0 and 1 run the family on their group while rank 2 runs its own group of one: no op of the pair
    waits on rank 2."""
    import weft

    pair = weft.new_group([0, 1])
    one = weft.new_subgroups(1)
    group = pair if pair is not None else one
    for it in range(iterations):
        for ci, kind in enumerate(KINDS):
            _group_call(kind, group, it * 10 + ci)


def test_a_group_runs_beside_a_leftover_rank():
    run_ranks(_beside_a_leftover_rank, 3, 2, timeout=TIMEOUT, env=ENV)
