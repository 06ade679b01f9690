"""MoE on cpu ranks: routing layout, high-throughput and low-latency dispatch / combine.

Every rank builds every rank's routing from a shared seed and checks its own results against a torch
reference of the routing: dispatch bit for bit, combine against the weighted sum. Calls follow each other
with new routing and no host barrier, so the epochs and the halves are exercised.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 120


# -- helpers run on the ranks ----------------------------------------------------

def _routing(seed, w, tokens, experts, k, hidden, mode="random", dtype="bfloat16"):
    """Per rank: (x (T, hidden) of dtype, topk_idx int64 (T, k), topk_weights fp32 (T, k))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(w):
        t = tokens[r] if isinstance(tokens, (list, tuple)) else tokens
        x = torch.randn(t, hidden, generator=g).to(getattr(torch, dtype))
        if mode == "one":  # every token to expert 0 (and k - 1 others next to it)
            idx = torch.arange(k).repeat(t, 1)
        elif mode == "half":  # only experts of the first half: the rest receive nothing
            idx = torch.stack([torch.randperm(experts // 2, generator=g)[:k] for _ in range(t)]) if t else \
                torch.empty(0, k, dtype=torch.int64)
        else:
            idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]) if t else \
                torch.empty(0, k, dtype=torch.int64)
        idx = idx.reshape(t, k).long()
        if mode == "masked" and t:  # some slots without an expert
            idx[torch.rand(t, k, generator=g) < 0.3] = -1
        wts = torch.rand(t, k, generator=g)
        out.append((x, idx, wts))
    return out


def _ref_dispatch(inputs, me, experts, w):
    """Rows rank `me` receives: (x, local topk_idx, weights), by source rank then token; counts per expert."""
    import torch

    local = experts // w
    xs, idxs, ws = [], [], []
    for x, idx, wts in inputs:
        for t in range(x.shape[0]):
            row = idx[t]
            if ((row >= 0) & (row // local == me)).any():
                mine = (row >= 0) & (row // local == me)
                xs.append(x[t])
                idxs.append(torch.where(mine, row - me * local, -1))
                ws.append(wts[t])
    hidden = inputs[0][0].shape[1]
    k = inputs[0][1].shape[1]
    rx = torch.stack(xs) if xs else torch.empty(0, hidden, dtype=inputs[0][0].dtype)
    ri = torch.stack(idxs) if idxs else torch.empty(0, k, dtype=torch.int64)
    rw = torch.stack(ws) if ws else torch.empty(0, k)
    counts = torch.tensor([int((ri == e).sum()) for e in range(local)], dtype=torch.int32)
    return rx, ri, rw, counts


def _expert_out(x, e):
    """What expert e (global) makes of rows x: a scale, so that any row gives the same bits alone."""
    return (x.float() * ((e + 1) / 8)).to(x.dtype)


def _weighted(rows_x, rows_idx, rows_w, first):
    """sum_j w_j * expert(first + idx_j)(x) over idx_j >= 0, fp32 in j order, rounded to x's dtype."""
    import torch

    acc = torch.zeros(rows_x.shape, dtype=torch.float32)
    for j in range(rows_idx.shape[1]):
        for e in rows_idx[:, j].unique().tolist():
            if e < 0:
                continue
            sel = rows_idx[:, j] == e
            acc[sel] += rows_w[sel, j:j + 1] * _expert_out(rows_x[sel], first + e).float()
    return acc.to(rows_x.dtype)


def _bits(t):
    """t's elements as integers of their size (bit-exact comparisons, NaN included)."""
    import torch

    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _strided(x, idx, wts):
    """The same values in layouts that are not contiguous: x a column slice of a wider (and odd-offset) buffer,
    topk_idx and topk_weights transposes of (k, T) tensors."""
    import torch

    wide = torch.zeros(x.shape[0], x.shape[1] + 3, dtype=x.dtype)
    wide[:, 1:x.shape[1] + 1] = x
    return wide[:, 1:x.shape[1] + 1], idx.t().contiguous().t(), wts.t().contiguous().t()


def _members(group):
    """(this rank's rank in `group`, its size): the world's for None."""
    from weft.kernels.common import resolve

    g = resolve(group)
    return g.rank, g.size


def _ht_case(seed, tokens, experts, k, hidden, mode, max_recv=None, dtype="bfloat16", strided=False, group=None):
    """One ep_dispatch + ep_combine over `group` (every member builds every member's routing from the seed)
    against the reference: the dispatch bit for bit, the combine against the weighted sums in rank order."""
    import torch

    import weft

    me, w = _members(group)
    local = experts // w
    inputs = _routing(seed, w, tokens, experts, k, hidden, mode, dtype)
    x, idx, wts = inputs[me]
    if strided:
        x, idx, wts = _strided(x, idx, wts)
    rx, ri, rw, counts, handle = weft.ops.ep_dispatch(x, idx, wts, experts, max_recv_tokens=max_recv, group=group)
    ex, ei, ew, ec = _ref_dispatch(inputs, me, experts, w)
    n = ex.shape[0]
    tag = f"seed {seed} mode {mode} k {k} max_recv {max_recv} {dtype} hidden {hidden} strided {strided}"
    if max_recv is None:
        assert rx.shape[0] == n, tag
    else:
        assert rx.shape[0] == max_recv and n <= max_recv, tag
        assert (ri[n:] == -1).all() and (rw[n:] == 0).all() and (rx[n:] == 0).all(), tag
    assert torch.equal(_bits(rx[:n]), _bits(ex)), tag
    assert torch.equal(ri[:n], ei) and ri.dtype == idx.dtype, tag
    assert torch.equal(rw[:n], ew), tag
    assert torch.equal(counts, ec), tag
    # Each rank's weighted sum over its local experts; back at the source, summed over ranks in rank order.
    y = _weighted(rx, ri, rw, me * local)
    if strided:
        y = _strided(y, idx, wts)[0]
    out = weft.ops.ep_combine(y, handle, group=group)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(w):
        mine = (idx >= 0) & (idx // local == r)
        part = _weighted(x, torch.where(mine, idx - r * local, -1), wts, r * local)
        acc += torch.where(mine.any(1, keepdim=True), part.float(), 0.0)
    assert torch.equal(_bits(out), _bits(acc.to(x.dtype))), tag


def _ll_fp8_case(seed, tokens, experts, k, max_tokens, hidden=256):
    """The fp8 dispatch's rows and scales bit for bit those of fp8_rows (the same quantization)."""
    import torch

    import weft
    from weft.testing.reference import fp8_rows_ref

    me, w = weft.rank(), weft.world_size()
    local = experts // w
    inputs = _routing(seed, w, tokens, experts, k, hidden)
    x, idx, wts = inputs[me]
    recv, counts, scales, handle = weft.ops.ep_dispatch_ll(x, idx, experts, max_tokens, fp8=True)
    assert recv.dtype == torch.float8_e4m3fn and scales.shape == (local, w * max_tokens, hidden // 128)
    ex, ei, _, ec = _ref_dispatch(inputs, me, experts, w)
    assert torch.equal(counts, ec)
    for e in range(local):
        want = ex[(ei == e).any(1)]
        n = want.shape[0]
        q, scale = fp8_rows_ref(want)
        assert torch.equal(recv[e, :n].view(torch.uint8), q.view(torch.uint8)), f"seed {seed} expert {e}"
        assert torch.equal(scales[e, :n], scale), f"seed {seed} expert {e}"
    # The combine of the dequantized rows, with the experts' scales.
    deq = (recv.float().reshape(local, -1, hidden // 128, 128) * scales[..., None]).reshape(recv.shape)
    deq = deq.to(torch.bfloat16)
    y = torch.stack([_expert_out(deq[e], me * local + e) for e in range(local)])
    out = weft.ops.ep_combine_ll(y, idx, wts, handle)
    torch.testing.assert_close(out.float(), _weighted(x, idx, wts, 0).float(), rtol=0.15, atol=0.15)
    return True


@pytest.mark.parametrize("w", [1, 3, pytest.param(8, marks=pytest.mark.long)])  # 8: as test_ep_ll
def test_ep_ll_fp8(w):
    assert all(run_ranks(_ll_fp8_case, w, 7, UNEVEN_TOKENS[:w], EXPERTS[w], 3, 8, timeout=TIMEOUT, env=ENV))


def _ll_case(seed, tokens, experts, k, hidden, mode, max_tokens, hook=False, dtype="bfloat16", strided=False,
             group=None):
    """One LL dispatch + combine over `group` against the reference; hook=True: both split (return_recv_hook),
    with other work queued and the outputs poisoned between send and receive."""
    import torch

    import weft

    me, w = _members(group)
    local = experts // w
    inputs = _routing(seed, w, tokens, experts, k, hidden, mode, dtype)
    x, idx, wts = inputs[me]
    if strided:
        x, idx, wts = _strided(x, idx, wts)
    if hook:
        recv, counts, scales, handle, receive = weft.ops.ep_dispatch_ll(x, idx, experts, max_tokens,
                                                                        return_recv_hook=True, group=group)
        recv.fill_(float("nan"))
        counts.fill_(-7)
        receive()
    else:
        recv, counts, scales, handle = weft.ops.ep_dispatch_ll(x, idx, experts, max_tokens, group=group)
    tag = f"seed {seed} mode {mode} k {k} hook {hook} {dtype} hidden {hidden} strided {strided}"
    assert scales is None and recv.shape == (local, w * max_tokens, hidden), tag
    ex, ei, _, ec = _ref_dispatch(inputs, me, experts, w)
    assert torch.equal(counts, ec), tag
    for e in range(local):
        want = ex[(ei == e).any(1)]
        assert torch.equal(_bits(recv[e, :want.shape[0]]), _bits(want)), f"{tag} expert {e}"
    y = torch.stack([_expert_out(recv[e], me * local + e) for e in range(local)])
    if strided:  # y as a slice of wider rows
        y = torch.cat([y, y[..., :2]], -1)[..., :hidden]
    if hook:
        out, receive = weft.ops.ep_combine_ll(y, idx, wts, handle, return_recv_hook=True, group=group)
        out.fill_(float("nan"))
        receive()
    else:
        out = weft.ops.ep_combine_ll(y, idx, wts, handle, group=group)
    want = _weighted(x, idx, wts, 0)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2, msg=tag)


def _many(kind, cases, units=None):
    if units is not None:  # the LL kernels' cpu launch settings (programs, chunk words, warps), in this rank
        import weft.kernels.moe.ep_ll as ep_ll
        ep_ll.LL_CPU = units
    for case in cases:
        {"ht": _ht_case, "ll": _ll_case, "ll_fp8": _ll_fp8_case}[kind](*case)
    return True


# -- routing layout ----------------------------------------------------------------------

def _routing_layout():
    """The layout of a small routing by hand; then entries outside [0, E) (E itself, -2, one past int32) and an
    expert named twice: each call raises a ValueError naming topk_idx, the row and the entry, and the next call
    works."""
    import pytest
    import torch

    from weft.kernels.moe import routing_layout

    idx = torch.tensor([[0, 5], [3, -1], [7, 6], [1, 2]])
    for dtype in (torch.int64, torch.int32):
        lay = routing_layout(idx.to(dtype), 8, 4)
        assert lay.to_rank.tolist() == [[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1], [1, 1, 0, 0]]
        assert lay.tokens_per_rank.tolist() == [2, 2, 1, 1]
        assert lay.rank_pos.tolist() == [[0, -1, 0, -1], [-1, 0, -1, -1], [-1, -1, -1, 0], [1, 1, -1, -1]]
        assert lay.tokens_per_expert.tolist() == [1, 1, 1, 1, 0, 1, 1, 1]
    for row, value, message in ((1, 8, "topk_idx row 1 holds 8: an expert outside"),
                                (3, -2, "topk_idx row 3 holds -2: an expert outside"),
                                (0, 1 << 40, "topk_idx row 0 holds 2147483647: an expert outside"),
                                (2, 7, "topk_idx row 2 names expert 7 twice")):
        bad = idx.clone()
        bad[row, 1] = value
        with pytest.raises(ValueError, match=message):
            routing_layout(bad, 8, 4)
        assert routing_layout(idx, 8, 4).tokens_per_rank.tolist() == [2, 2, 1, 1]
    return True


def test_routing_layout():
    assert run_ranks(_routing_layout, 1, timeout=TIMEOUT)[0]


# -- high-throughput ----------------------------------------------------------------------

# The experts of a world size (a multiple of it), and tokens per rank with ranks that have none.
EXPERTS = {1: 8, 2: 8, 3: 12, 4: 8, 8: 16}
UNEVEN_TOKENS = [5, 0, 3, 4, 0, 7, 1, 2]


# 4 ranks: the world layout of tests/test_moe_tp.py's test_moe_on_every_group_layout.
@pytest.mark.parametrize("w", [1, 2, 3, pytest.param(8, marks=pytest.mark.long)])
def test_ep_dispatch_combine(w):
    experts = EXPERTS[w]
    cases = [(w * 10 + 1, 6, experts, 2, 32, "random"), (w * 10 + 2, UNEVEN_TOKENS[:w], experts, 3, 32, "random"),
             (w * 10 + 3, 4, experts, 1, 32, "one"), (w * 10 + 4, 5, experts, 4, 32, "half"),
             (w * 10 + 5, 5, experts, 3, 32, "masked")]
    assert all(run_ranks(_many, w, "ht", cases, timeout=TIMEOUT, env=ENV))


def test_ep_dispatch_fixed_size():
    cases = [(s, [3, 5], 8, 2, 64, "random", 16) for s in range(3)]
    assert all(run_ranks(_many, 2, "ht", cases, timeout=TIMEOUT, env=ENV))


# -- low-latency ----------------------------------------------------------------------------

@pytest.mark.parametrize("w", [1, 2, 3, pytest.param(8, marks=pytest.mark.long)])  # 4: as test_ep_dispatch_combine
def test_ep_ll(w):
    experts = EXPERTS[w]
    cases = [(w * 10 + 1, 6, experts, 2, 32, "random", 8),
             (w * 10 + 2, [8] + UNEVEN_TOKENS[1:w], experts, 3, 32, "random", 8),  # a rank at max_tokens
             (w * 10 + 3, 4, experts, 1, 32, "one", 8), (w * 10 + 4, 5, experts, 4, 32, "half", 8),
             (w * 10 + 5, 5, experts, 3, 32, "masked", 8)]
    assert all(run_ranks(_many, w, "ll", cases, timeout=TIMEOUT, env=ENV))


def _every_k(experts):
    """k = 1 ... 8 (k = experts: every token to every expert), HT and LL, with and without empty slots."""
    for k in range(1, 9):
        mode = ("random", "masked")[k % 2]
        _ht_case(500 + k, [4, 3], experts, k, 32, mode)
        _ll_case(600 + k, [3, 4], experts, k, 32, mode, 4)
    _ht_case(509, [3, 2], 8, 8, 32, "random")
    _ll_case(609, [2, 3], 8, 8, 32, "random", 4)
    return True


def test_ep_every_k():
    assert all(run_ranks(_every_k, 2, 16, timeout=TIMEOUT, env=ENV))


def _ll_hooks(cases):
    """Split calls among one-launch calls, then the misuses of the hooks, each refused before anything is
    launched (the calls after see the epochs they expect)."""
    import pytest
    import torch

    import weft

    w = weft.world_size()
    experts = 4 * w
    for i, case in enumerate(cases):
        _ll_case(*case, hook=i % 3 != 1)
    x, idx, wts = _routing(9, w, 3, experts, 2, 32)[weft.rank()]
    _, _, _, handle, receive = weft.ops.ep_dispatch_ll(x, idx, experts, 4, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="receive hook"):
        weft.ops.ep_dispatch_ll(x, idx, experts, 4)
    y = torch.zeros(handle.plan.recv_shape, dtype=x.dtype)
    with pytest.raises(RuntimeError, match="not received"):
        weft.ops.ep_combine_ll(y, idx, wts, handle)
    receive()
    with pytest.raises(RuntimeError, match="run already"):
        receive()
    with pytest.raises(TypeError, match="return_recv_hook"):
        weft.ops.ep_combine_ll(y, idx, wts, handle, return_recv_hook=1)
    _, receive = weft.ops.ep_combine_ll(y, idx, wts, handle, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="receive hook"):
        weft.ops.ep_combine_ll(y, idx, wts, handle)
    receive()
    _ll_case(10, 4, experts, 2, 32, "masked", 4)
    _ll_case(11, [2, 0, 3][:w], experts, 3, 32, "random", 4, hook=True)
    return True


@pytest.mark.parametrize("w", [2, 3])
def test_ep_ll_recv_hook(w):
    """return_recv_hook: send and receive as two launches, outputs poisoned in between, at 2 and 3 ranks."""
    experts = 12 if w == 3 else 8
    cases = [(70 + s, [4, 1, 3][:w], experts, 3, 32, ("random", "masked", "one")[s % 3], 6) for s in range(4)]
    assert all(run_ranks(_ll_hooks, w, cases, timeout=TIMEOUT, env=ENV))


def test_ep_ll_multi_chunk():
    """Rows over several of the kernels' (token, chunk) units, the last chunk ragged, with 32-word chunks and at
    most 4 programs: 80 words (3 chunks, one token lane), 48 words (2 chunks, 2 lanes); fp8 rows of 160 words
    (5 chunks would need 5 programs: 3 of 64 words) and 32 words (one chunk, 4 lanes)."""
    cases = [(61, [5, 2], 8, 3, 160, "random", 6), (62, [3, 0], 8, 2, 96, "masked", 6)]
    assert all(run_ranks(_many, 2, "ll", cases, (4, 32, 4), timeout=TIMEOUT, env=ENV))
    cases = [(63, [4, 3], 8, 3, 5, 640), (64, [2, 5], 8, 2, 5, 128)]
    assert all(run_ranks(_many, 2, "ll_fp8", cases, (4, 32, 4), timeout=TIMEOUT, env=ENV))


# -- many calls, bad input -------------------------------------------------------------------

def _mixed(calls):
    """HT and LL calls interleaved, new routing each time, one rank late at each call."""
    import time

    import weft

    me, w = weft.rank(), weft.world_size()
    for c in range(calls):
        if me == c % w:
            time.sleep(0.02)
        k = 1 + c % 3
        _ht_case(100 + c, [4, 2 + c % 3][:w], 8, k, 32, "random")
        _ll_case(200 + c, [3, c % 4][:w], 8, k, 32, "random", 4)
    return True


def test_many_calls_mixed():
    assert all(run_ranks(_mixed, 2, 4, timeout=TIMEOUT, env=ENV))


def _any_layout(units, first, step):
    """What torch takes, the EP ops take: fp32 and fp16 rows, 16-bit rows of an odd length (whole 4-byte words
    only with a zero column more), x, topk_idx, topk_weights and y in layouts that are not contiguous (x at an
    odd element offset); each call after calls of other signatures, bit for bit as always. The layouts
    numbered first, first + step, ... of the five."""
    import weft
    import weft.kernels.moe.ep_ll as ep_ll

    ep_ll.LL_CPU = units
    w = weft.world_size()
    experts = EXPERTS[w]
    layouts = (("float32", 24, False), ("bfloat16", 37, False), ("float16", 40, True), ("bfloat16", 33, True),
               ("float32", 7, True))
    for i, (dtype, hidden, strided) in list(enumerate(layouts))[first::step]:
        _ht_case(300 + i, UNEVEN_TOKENS[:w], experts, 3, hidden, "masked", None, dtype, strided)
        _ht_case(310 + i, 4, experts, 2, hidden, "random", 16, dtype, strided)
        _ll_case(320 + i, [3, 4, 0, 2][:w], experts, 3, hidden, "random", 4, i % 2 == 1, dtype, strided)
    return True


@pytest.mark.parametrize("w", [1, 2, 3])
def test_ep_any_layout(w):
    # Every layout at 1 rank; across ranks each at one world size: 2 ranks the even-numbered, 3 the others.
    first, step = {1: (0, 1), 2: (0, 2), 3: (1, 2)}[w]
    assert all(run_ranks(_any_layout, w, (4, 32, 4), first, step, timeout=TIMEOUT, env=ENV))


def _rejects():
    import weft
    from weft.testing.checks import rejects

    inputs = _routing(5, 2, 4, 8, 2, 32)
    x, idx, wts = inputs[weft.rank()]
    dup = idx.clone()
    dup[1, 1] = dup[1, 0]
    guarded = [x, idx, wts]
    rejects(lambda: weft.ops.ep_dispatch(x, dup, wts, 8), ValueError, "twice", guarded)
    rejects(lambda: weft.ops.ep_dispatch_ll(x, dup, 8, 4), ValueError, "twice", guarded)
    rejects(lambda: weft.ops.ep_dispatch_ll(x, idx + 8, 8, 4), ValueError, "outside", guarded)
    rejects(lambda: weft.ops.ep_dispatch_ll(x, idx, 8, 3), ValueError, "max_tokens_per_rank", guarded)
    rejects(lambda: weft.ops.ep_dispatch_ll(x, idx, 8, 4, fp8=True), ValueError, "128", guarded)
    rejects(lambda: weft.ops.ep_dispatch(x, idx, wts, 7), ValueError, "divisible", guarded)
    rejects(lambda: weft.ops.ep_dispatch(x, idx[:, :1].contiguous(), wts, 8), ValueError, "topk_weights", guarded)
    rejects(lambda: weft.ops.ep_dispatch(x, idx, wts.double(), 8), TypeError, "topk_weights", guarded)
    rejects(lambda: weft.ops.ep_dispatch(x, idx, wts, 8, max_recv_tokens=1 << 30), ValueError, "workspace",
            guarded)
    # Nothing was sent: the next calls see the epochs they expect.
    _ht_case(5, 4, 8, 2, 32, "random")
    _ll_case(5, 4, 8, 2, 32, "random", 4)
    return True


def test_bad_input_rejected_before_sending():
    assert all(run_ranks(_rejects, 2, timeout=TIMEOUT, env=ENV))


# -- bad rows found on the device, eager calls ---------------------------------------------------

def _bad_rows():
    """A row naming an expert twice (or one outside the experts) on one rank: that rank's call raises a
    ValueError naming topk_idx, the row and the expert (the kernels ran: under the interpreter they have ended
    by the time the call returns); the other rank's call returns the harmless result; the next calls work."""
    import pytest
    import torch

    import weft

    me, w = weft.rank(), weft.world_size()
    inputs = _routing(9, w, 4, 8, 2, 32)
    x, idx, wts = inputs[me]
    bad = idx.clone()
    bad[2, 1] = bad[2, 0]
    expert = int(bad[2, 0])
    # LL: rank 0's row 2 names `expert` twice; rank 1 gets the token once.
    if me == 0:
        with pytest.raises(ValueError, match=rf"topk_idx row 2 names expert {expert} twice"):
            weft.ops.ep_dispatch_ll(x, bad, 8, 4)
    else:
        _, counts, _, _ = weft.ops.ep_dispatch_ll(x, idx, 8, 4)
        x0, idx0, wts0 = inputs[0]
        once = idx0.clone()
        once[2, 1] = -1  # rank 0's repeated entry, as if it were none
        assert torch.equal(counts, _ref_dispatch([(x0, once, wts0), *inputs[1:]], me, 8, w)[3])
    _ll_case(10, 4, 8, 2, 32, "random", 4)
    # LL: rank 1's row 0 holds 99.
    if me == 1:
        outside = idx.clone()
        outside[0, 1] = 99
        with pytest.raises(ValueError, match="topk_idx row 0 holds 99: an expert outside"):
            weft.ops.ep_dispatch_ll(x, outside, 8, 4)
    else:
        weft.ops.ep_dispatch_ll(x, idx, 8, 4)
    _ll_case(11, 3, 8, 2, 32, "random", 4)
    # HT, exact size: the host sync sees every rank's check, so every rank raises before pushing.
    with pytest.raises(ValueError, match=f"topk_idx row 2 names expert {expert} twice" if me == 0 else
                       "topk_idx on another rank"):
        weft.ops.ep_dispatch(x, bad if me == 0 else idx, wts, 8)
    _ht_case(12, 4, 8, 2, 32, "random")
    # HT with max_recv_tokens (no sync): rank 1's call raises once its kernels have run.
    if me == 1:
        with pytest.raises(ValueError, match="topk_idx row 2 names"):
            weft.ops.ep_dispatch(x, bad, wts, 8, max_recv_tokens=16)
    else:
        weft.ops.ep_dispatch(x, idx, wts, 8, max_recv_tokens=16)
    _ht_case(13, 4, 8, 2, 32, "random", 16)
    return True


def test_bad_rows_raise_and_the_next_call_works():
    assert all(run_ranks(_bad_rows, 2, timeout=TIMEOUT, env=ENV))


def _eager_calls(rounds):
    """Call after call with new routing and token counts (LL and HT, both sizes of HT): once the MoE workspace
    exists, nothing more is allocated from the heap, no host barrier is made, nothing outside the heap is kept."""
    import weft
    from weft.testing.checks import kept_tensors

    world = weft.world()
    _ll_case(300, 2, 8, 2, 32, "random", 6)
    used, barriers = world.heap.used, world.barriers
    for c in range(rounds):
        k = 1 + c % 3
        _ll_case(301 + c, [c % 7, (3 * c + 1) % 7], 8, k, 32, ("random", "masked")[c % 2], 6)
        _ht_case(401 + c, [(c + 2) % 6, c % 4], 8, k, 32, "random", (None, 12)[c % 2])
        assert (world.heap.used, world.barriers) == (used, barriers), f"call {c}"
    assert not kept_tensors(world)
    return True


def test_many_eager_calls_changing_sizes_bounded_memory():
    assert all(run_ranks(_eager_calls, 2, 6, timeout=TIMEOUT, env=ENV))


# -- the router ----------------------------------------------------------------------------------

def _router():
    """router_topk against torch's softmax, topk and division: the same experts in the same order, the weights
    within float rounding; fp32 and bf16 logits (bf16 rows of distinct values: torch.topk orders ties as it
    likes), k from 1 to 8, token counts off the kernel's blocks, an empty batch, logits not contiguous; rows with
    NaN and infinite logits; bad arguments refused."""
    import torch

    import weft
    from weft.kernels.moe import router_topk_torch
    from weft.testing.checks import rejects

    g = torch.Generator().manual_seed(21)
    for experts, tokens, k, norm in ((8, 5, 2, True), (16, 37, 8, True), (12, 3, 1, False), (128, 19, 8, True),
                                     (8, 0, 3, True)):
        for dtype in (torch.float32, torch.bfloat16):
            for call in range(2):
                if dtype == torch.bfloat16:  # distinct values per row
                    logits = (torch.rand(tokens, experts, generator=g).argsort(-1).float() / 8 - 4).to(dtype)
                else:
                    logits = torch.randn(tokens, experts, generator=g) * 3
                if call:
                    logits = logits.t().contiguous().t()
                idx, wts = weft.ops.router_topk(logits, k, norm)
                ref_idx, ref_wts = router_topk_torch(logits, k, norm)
                tag = f"{experts} experts, {tokens} tokens, k {k}, {dtype}"
                assert idx.dtype == torch.int64 and wts.dtype == torch.float32 and idx.shape == (tokens, k), tag
                assert torch.equal(idx, ref_idx), tag
                torch.testing.assert_close(wts, ref_wts, rtol=1e-5, atol=1e-6, msg=tag)
    # Rows whose softmax is NaN in torch (a NaN logit, a +inf one, every logit -inf) among ordinary rows and a
    # row with some -inf: NaN weights where torch's are NaN, k distinct experts in [0, E) (NaN logits first,
    # as torch.topk ranks NaN above every number), the ordinary rows as torch.
    nan, inf = float("nan"), float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(7, 12, generator=g).to(dtype)
        logits[1, 5] = nan
        logits[2, [3, 9]] = inf
        logits[3] = -inf
        logits[4, [0, 2, 4]] = -inf
        logits[5, [2, 10]] = nan
        for k in (1, 3):
            idx, wts = weft.ops.router_topk(logits, k)
            ref_idx, ref_wts = router_topk_torch(logits, k)
            tag = f"{dtype} k {k}"
            assert torch.equal(wts.isnan(), ref_wts.isnan()) and ref_wts[[1, 2, 3, 5]].isnan().all(), tag
            assert ((idx >= 0) & (idx < 12)).all(), tag
            assert all(len(set(row)) == k for row in idx.tolist()), tag
            assert idx[1, 0] == 5 and idx[5, 0] == 2 and (k == 1 or idx[5, 1] == 10), tag
            ok = [0, 4, 6]
            assert torch.equal(idx[ok], ref_idx[ok]), tag
            torch.testing.assert_close(wts[ok], ref_wts[ok], rtol=1e-5, atol=1e-6, msg=tag)
    logits = torch.randn(4, 8)
    rejects(lambda: weft.ops.router_topk(logits, 0), ValueError, "k", [logits])
    rejects(lambda: weft.ops.router_topk(logits, 9), ValueError, "k", [logits])
    rejects(lambda: weft.ops.router_topk(logits, 2, 1), TypeError, "renormalize", [logits])
    rejects(lambda: weft.ops.router_topk(logits[None], 2), ValueError, "logits", [logits])
    rejects(lambda: weft.ops.router_topk(logits.int(), 2), TypeError, "logits", [logits])
    return True


def test_router_topk():
    assert run_ranks(_router, 1, timeout=TIMEOUT)[0]
