"""m2n_dispatch / m2n_combine (weft/kernels/m2n.py) on cpu ranks against a torch reference: (M, N) = (1, 2), (2, 2),
(3, 1), rows routed to every receiver, to several (top-k), to none, and a destination out of range raising."""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}


def _check(m, n):
    import torch
    import torch.distributed as dist

    import weft
    import weft.ops as ops

    me = weft.rank()
    senders, receivers = list(range(m)), list(range(m, m + n))
    hidden, k, max_tokens = 19, 2, 6
    for it in range(2):
        gen = torch.Generator().manual_seed(1000 * it + me)
        tokens = [max_tokens, 0][it] if me < m else 0
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
        dest = torch.randint(-1, n, (tokens, k), generator=gen)
        if tokens:
            dest[0] = -1  # a row to no receiver
            dest[-1, 0] = n - 1
        weights = torch.rand(tokens, k, generator=gen)
        if me >= m:
            x, dest = x[:0], dest[:0]
        recv, counts, handle = ops.m2n_dispatch(x, dest, senders, receivers, max_tokens)
        every = [None] * (m + n)
        dist.all_gather_object(every, (x, dest, weights))
        if me >= m:  # the reference: each sender's (row, j) entries for me, in order
            r = me - m
            for s in range(m):
                xs, ds, _ = every[s]
                rows = [xs[t] for t in range(ds.shape[0]) for j in range(k) if ds[t, j] == r]
                assert counts[s] == len(rows), (it, s)
                if rows:
                    assert torch.equal(recv[s, :len(rows)], torch.stack(rows)), (it, s)
            y = recv.float() * (me + 1) + 0.5  # the receiver's processing
            y = y.to(torch.bfloat16)
            out = ops.m2n_combine(y, None, handle)
            assert out.shape == (0, hidden)
        else:
            assert recv.shape[0] == 0 and counts.numel() == 0
            out = ops.m2n_combine(None, weights, handle)
            want = torch.zeros(tokens, hidden)
            for t in range(tokens):
                for j in range(k):
                    d = int(dest[t, j])
                    if d >= 0:
                        processed = (x[t].float() * (m + d + 1) + 0.5).to(torch.bfloat16).float()
                        want[t] += weights[t, j] * processed
            torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=0, atol=0)
    # A destination outside [-1, N): a ValueError on that sender after its launch, the others unharmed.
    x = torch.randn(2 if me == 0 else 0, hidden).to(torch.bfloat16)
    dest = torch.tensor([[0, n + 3], [-1, -1]])[:x.shape[0]]
    if me == 0:
        with pytest.raises(ValueError, match=f"dest row 0 holds {n + 3}"):
            ops.m2n_dispatch(x, dest, senders, receivers, max_tokens)
    else:
        ops.m2n_dispatch(x, dest if me < m else dest[:0], senders, receivers, max_tokens)
    return True


@pytest.mark.parametrize("m,n", [(1, 2), (2, 2), (3, 1)])
def test_m2n_against_torch(m, n):
    assert run_ranks(_check, m + n, m, n, timeout=300, env=ENV) == [True] * (m + n)
