"""m2n_dispatch / m2n_combine (weft/kernels/m2n.py) on cpu ranks against a torch reference: (M, N) = (1, 2), (2, 2),
(3, 1), rows routed to every receiver, to several (top-k up to 8), to none, token counts that change from call to
call and span several programs' shares, a destination out of range raising, and the signature check (members whose
plans differ get weft.SignatureMismatch after the pair's combine, at a plan's first call and between warm plans;
the next matching call works)."""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}


def _round_trip(m, n, hidden, k, max_tokens, tokens, seed, pattern="random"):
    """One dispatch and combine on this rank (sender ranks [0, m), receivers [m, m + n)), each checked against
    torch. A sender's rows name `pattern` receivers: random ones (-1 among them), every receiver (k >= n; dest
    int32 on the senders, whose plans then differ from the receivers' in what they need not agree on), or none."""
    import torch
    import torch.distributed as dist

    import weft
    import weft.ops as ops
    from weft.testing.reference import m2n_combine_ref

    me = weft.rank()
    senders, receivers = list(range(m)), list(range(m, m + n))
    gen = torch.Generator().manual_seed(seed + me)
    tokens = tokens if me < m else 0
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    if pattern == "random":
        dest = torch.randint(-1, n, (tokens, k), generator=gen)
        if tokens:
            dest[0] = -1  # a row to no receiver
            dest[-1, 0] = n - 1
    elif pattern == "every":  # each row to every receiver, in a shuffled order, the rest of its k entries to none
        dest = torch.full((tokens, k), -1, dtype=torch.int32)  # int32 on senders: the receivers' dest is int64
        for t in range(tokens):
            dest[t, :n] = torch.randperm(n, generator=gen)
    else:
        dest = torch.full((tokens, k), -1, dtype=torch.int64)
    if me >= m:
        dest = dest.to(torch.int64)
    weights = torch.rand(tokens, k, generator=gen)
    recv, counts, handle = ops.m2n_dispatch(x, dest, senders, receivers, max_tokens)
    every = [None] * (m + n)
    dist.all_gather_object(every, (x, dest))
    if me >= m:  # the reference: each sender's (row, j) entries for me, in order
        r = me - m
        assert recv.shape == (m, max_tokens * k, hidden) and counts.shape == (m,)
        for s in range(m):
            xs, ds = every[s]
            rows = [xs[t] for t in range(ds.shape[0]) for j in range(k) if ds[t, j] == r]
            assert counts[s] == len(rows), (seed, s)
            if rows:
                assert torch.equal(recv[s, :len(rows)], torch.stack(rows)), (seed, s)
        y = (recv.float() * (me + 1) + 0.5).to(torch.bfloat16)  # the receiver's processing
        out = ops.m2n_combine(y, None, handle)
        assert out.shape == (0, hidden)
    else:
        assert recv.shape[0] == 0 and counts.numel() == 0
        out = ops.m2n_combine(None, weights, handle)
        want = m2n_combine_ref(x, dest, weights, lambda row, d: (row.float() * (m + d + 1) + 0.5).to(torch.bfloat16))
        torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=0)


def _check(m, n):
    import torch

    import weft
    import weft.ops as ops

    me = weft.rank()
    hidden, k, max_tokens = 19, 2, 6
    for it, tokens in enumerate((max_tokens, 0)):
        _round_trip(m, n, hidden, k, max_tokens, tokens, 1000 * it)
    _round_trip(m, n, hidden, 1, max_tokens, max_tokens - 1, 3000)  # top-1: slot rows in x's dtype, no weights sent
    # A destination outside [-1, N): a ValueError on that sender after its launch, the others unharmed.
    x = torch.randn(2 if me == 0 else 0, hidden).to(torch.bfloat16)
    dest = torch.tensor([[0, n + 3], [-1, -1]])[:x.shape[0]]
    senders, receivers = list(range(m)), list(range(m, m + n))
    if me == 0:
        with pytest.raises(ValueError, match=f"dest row 0 holds {n + 3}"):
            ops.m2n_dispatch(x, dest, senders, receivers, max_tokens)
    else:
        ops.m2n_dispatch(x, dest if me < m else dest[:0], senders, receivers, max_tokens)
    return True


@pytest.mark.parametrize("m,n", [(1, 2), (2, 2), (3, 1)])
def test_m2n_against_torch(m, n):
    assert run_ranks(_check, m + n, m, n, timeout=300, env=ENV) == [True] * (m + n)


def _many_lanes(m, n):
    # hidden 16: two column chunks of the cpu launch, so three lanes of tokens (weft.kernels.m2n.M2N_CPU): 20 tokens
    # are 3 lanes of 7; k = 8. Token counts change from call to call, calls repeat (no graph), patterns alternate.
    hidden, k, max_tokens = 16, 8, 20
    calls = [(20, "random"), (13, "every"), (0, "random"), (7, "none"), (20, "every"), (5, "random")]
    for it, (tokens, pattern) in enumerate(calls):
        _round_trip(m, n, hidden, k, max_tokens, tokens, 7000 + 100 * it, pattern)
    return True


# 1 sender and 2 receivers in CI (the lanes are each sender's own; several senders: test_m2n_against_torch).
@pytest.mark.parametrize("m,n", [(1, 2), pytest.param(2, 3, marks=pytest.mark.long)])
def test_m2n_many_lanes_top8(m, n):
    assert run_ranks(_many_lanes, m + n, m, n, timeout=400, env=ENV) == [True] * (m + n)


def _signature(m, n):
    import torch

    import weft
    import weft.ops as ops

    me = weft.rank()
    senders, receivers = list(range(m)), list(range(m, m + n))
    hidden, k = 19, 2

    def dispatch(max_tokens, tokens=3):
        x = torch.randn(tokens if me < m else 0, hidden).to(torch.bfloat16)
        dest = torch.zeros((x.shape[0], k), dtype=torch.int64)
        return ops.m2n_dispatch(x, dest, senders, receivers, max_tokens)

    def combine(recv, handle):
        if me < m:
            return ops.m2n_combine(None, torch.rand(3, k), handle)
        return ops.m2n_combine(torch.zeros_like(recv), None, handle)

    def mismatch(call, mine, theirs):
        with pytest.raises(weft.SignatureMismatch) as e:
            call()
        text = str(e.value)
        assert "weft.ops.m2n_combine: the members of" in text, text
        assert f"rank {me}: m2n_combine(W={m + n}, M={m}, N={n}, k={k}, hidden={hidden}, dtype=bfloat16, " \
            f"max_tokens={mine}" in text, text
        assert f"max_tokens={theirs}" in text, text

    def mismatched_pair(max_tokens, theirs):
        # The receivers find it in dispatch and receive nothing; every member raises after the pair's combine.
        recv, counts, handle = dispatch(max_tokens)
        if me >= m:
            assert torch.equal(counts, torch.zeros(m, dtype=torch.int32))
        mismatch(lambda: combine(recv, handle), max_tokens, theirs)

    # At a plan's first call: sender 0 with max_tokens 5, the others 4.
    mismatched_pair(*((5, 4) if me == 0 else (4, 5)))
    _round_trip(m, n, hidden, k, 6, 6, 11)
    # Between warm plans: both plans made and used by every member, then sender 0 takes the other one.
    for max_tokens in (6, 8):
        _round_trip(m, n, hidden, k, max_tokens, 5, 12)
    mismatched_pair(*((8, 6) if me == 0 else (6, 8)))
    _round_trip(m, n, hidden, k, 8, 8, 13)
    # The combine of another dispatch's handle on sender 0: its plan differs.
    _, _, handle6 = dispatch(6)
    recv, _, handle8 = dispatch(8)
    if me < m:
        handle = handle8 if me == 0 else handle6
        mismatch(lambda: combine(None, handle), *((8, 6) if me == 0 else (6, 8)))
    else:
        mismatch(lambda: combine(recv, handle8), 8, 6)
    for it in range(2):  # the next matching calls work
        _round_trip(m, n, hidden, k, 6, 6 - it, 14 + it)
    return True


def test_m2n_signature_mismatch():
    assert run_ranks(_signature, 4, 2, 2, timeout=400, env=ENV) == [True] * 4
