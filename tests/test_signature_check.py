"""The cross-rank signature check (on cpu ranks): members that call a collective with plans that disagree get
weft.SignatureMismatch on every member, naming the op, both ranks and both plans, instead of a wrong result or a
hang; the output is not written; then a matching call works.

Each case is a mismatch at the plan's first call, and one injected after both ranks have made (warmed) both plans:
the check runs on every call, not only when a plan is made. Cases where the members' launches differ in grid or
pass count (what used to hang) are among them.
"""
import re

import torch

from weft.testing import run_ranks

SENTINEL = -7.0
# A wait that would otherwise hang ends here, well inside the test's own timeout; a small workspace, so that a few
# thousand elements already take several passes.
ENV = {"WEFT_WAIT_TIMEOUT_S": "60", "WEFT_WORKSPACE_BYTES": "256KiB"}


def _mismatch(call):
    """Run `call()` (this rank's half of a mismatched collective): the error's message, or None if none."""
    import weft

    try:
        call()
    except weft.SignatureMismatch as e:
        assert isinstance(e, ValueError)
        return str(e)
    return None


def _matching_all_reduce():
    import weft

    x = torch.arange(1000, dtype=torch.float32) * (weft.rank() + 1)
    expected = torch.arange(1000, dtype=torch.float32) * sum(range(1, weft.world_size() + 1))
    torch.testing.assert_close(weft.ops.all_reduce(x), expected, rtol=0, atol=0)


def _reduce_family():
    import weft

    r = weft.rank()
    messages = {}

    def out_untouched(n):
        return torch.full((n,), SENTINEL)

    # all_reduce: sizes differ (10k / 12k elements: one-shot, the same grid and passes) at the first call; the output
    # is not written.
    n = 10_000 if r == 0 else 12_000
    out = out_untouched(n)
    messages["all_reduce size"] = _mismatch(lambda: weft.ops.all_reduce(torch.ones(n), out=out))
    assert torch.all(out == SENTINEL)
    _matching_all_reduce()

    # A grid that differs (1 program / 4 programs on cpu) and a dtype that differs: what used to hang.
    n = 256 if r == 0 else 8_000
    messages["all_reduce grid"] = _mismatch(lambda: weft.ops.all_reduce(torch.ones(n), method="two_shot"))
    dtype = torch.float32 if r == 0 else torch.bfloat16
    messages["all_reduce dtype"] = _mismatch(lambda: weft.ops.all_reduce(torch.ones(4096, dtype=dtype)))
    _matching_all_reduce()

    # Warmed: both ranks make both plans (sum and max over the same x), then call different ones.
    x = torch.full((3000,), float(r + 1))
    for op in ("sum", "max"):
        weft.ops.all_reduce(x, op=op)
    out = out_untouched(3000)
    messages["all_reduce warm op"] = _mismatch(lambda: weft.ops.all_reduce(x, op="sum" if r == 0 else "max",
                                                                            out=out))
    assert torch.all(out == SENTINEL)
    assert torch.all(weft.ops.all_reduce(x, op="max") == weft.world_size())

    # Warmed, pass counts that differ: 1 pass on rank 0, 4 on rank 1 (more than the workspace holds).
    small, large = torch.ones(1000), torch.ones(100_000)
    for t in (small, large):
        weft.ops.reduce_scatter(t)
    messages["reduce_scatter warm passes"] = _mismatch(lambda: weft.ops.reduce_scatter(small if r == 0 else large))
    torch.testing.assert_close(weft.ops.reduce_scatter(small), torch.full((1000 // weft.world_size(),),
                                                                          float(weft.world_size())))

    # broadcast: roots that differ, warmed (each root's plan made on both ranks); x is left as it was.
    y = torch.full((5000,), float(r))
    for root in (0, 1):
        weft.ops.broadcast(y.clone(), root=root)
    messages["broadcast warm root"] = _mismatch(lambda: weft.ops.broadcast(y, root=r))
    assert torch.all(y == r)
    assert torch.all(weft.ops.broadcast(y, root=1) == 1)
    # all_reduce on one rank, broadcast on the other: the same workspace, another op.
    messages["all_reduce / broadcast"] = _mismatch(
        lambda: weft.ops.all_reduce(torch.ones(5000)) if r == 0 else weft.ops.broadcast(torch.ones(5000)))
    _matching_all_reduce()
    return messages


def _check(messages_per_rank, case, op, texts):
    """Every rank's message of `case` names the op, itself and the peer, and both plans' texts (rank: the start of
    its text), each with its fingerprint."""
    for rank, messages in enumerate(messages_per_rank):
        message = messages[case]
        assert message is not None, f"{case}: rank {rank} raised nothing"
        assert message.startswith(f"weft.ops.{op}: the members of weft.Group("), message
        for r, text in texts.items():
            assert f"rank {r}: {text}" in message, (case, message)
        assert len(re.findall(r"\) \[[0-9a-f]{8}\]", message)) == 2, message


def test_the_reduction_family_reports_every_mismatch_on_every_rank():
    messages = run_ranks(_reduce_family, 2, timeout=240, env=ENV)
    _check(messages, "all_reduce size", "all_reduce",
           {0: "all_reduce(W=2, n=10000, dtype=float32, op=sum, path=one_shot)",
            1: "all_reduce(W=2, n=12000, dtype=float32, op=sum, path=one_shot)"})
    _check(messages, "all_reduce grid", "all_reduce", {0: "all_reduce(W=2, n=256, dtype=float32, op=sum, path=",
                                                       1: "all_reduce(W=2, n=8000, dtype=float32, op=sum, path="})
    _check(messages, "all_reduce dtype", "all_reduce", {0: "all_reduce(W=2, n=4096, dtype=float32, op=sum",
                                                        1: "all_reduce(W=2, n=4096, dtype=bfloat16, op=sum"})
    _check(messages, "all_reduce warm op", "all_reduce", {0: "all_reduce(W=2, n=3000, dtype=float32, op=sum",
                                                          1: "all_reduce(W=2, n=3000, dtype=float32, op=max"})
    _check(messages, "reduce_scatter warm passes", "reduce_scatter",
           {0: "reduce_scatter(W=2, n=1000, dtype=float32, op=sum)",
            1: "reduce_scatter(W=2, n=100000, dtype=float32, op=sum)"})
    _check(messages, "broadcast warm root", "broadcast", {0: "broadcast(W=2, bytes=20000, word=int32, root=0)",
                                                             1: "broadcast(W=2, bytes=20000, word=int32, root=1)"})
    assert "rank 1: broadcast(W=2, bytes=20000" in messages[0]["all_reduce / broadcast"]
    assert messages[1]["all_reduce / broadcast"].startswith("weft.ops.broadcast:")


def _all_gather_family():
    import weft

    r = weft.rank()
    messages = {}
    rows = 100 if r == 0 else 300
    out = torch.full((2 * rows, 8), SENTINEL)
    messages["size"] = _mismatch(lambda: weft.ops.all_gather(torch.ones(rows, 8), out=out))
    assert torch.all(out == SENTINEL)
    x = torch.full((64, 8), float(r))
    for method in ("push", "pull"):
        weft.ops.all_gather(x, method=method)
    messages["warm method"] = _mismatch(lambda: weft.ops.all_gather(x, method="push" if r == 0 else "pull"))
    # Into a symmetric out on one rank, a plain one on the other: the zero-copy push would write into memory
    # the peer does not expect.
    sym = weft.empty((128, 8), torch.float32)
    weft.ops.all_gather(x, out=sym)
    weft.ops.all_gather(x, out=torch.empty(128, 8))
    plain = torch.full((128, 8), SENTINEL)
    messages["warm out kind"] = _mismatch(lambda: weft.ops.all_gather(x, out=sym if r == 0 else plain))
    assert torch.all(plain == SENTINEL)
    got = weft.ops.all_gather(x, method="pull")
    assert torch.all(got[:64] == 0) and torch.all(got[64:] == 1)
    return messages


def test_all_gather_reports_every_mismatch_on_every_rank():
    messages = run_ranks(_all_gather_family, 2, timeout=240, env=ENV)
    _check(messages, "size", "all_gather", {0: "all_gather(W=2, bytes=3200, word=int32, method=push)",
                                            1: "all_gather(W=2, bytes=9600, word=int32, method=push)"})
    _check(messages, "warm method", "all_gather", {0: "all_gather(W=2, bytes=2048, word=int32, method=push)",
                                                   1: "all_gather(W=2, bytes=2048, word=int32, method=pull)"})
    _check(messages, "warm out kind", "all_gather",
           {0: "all_gather(W=2, bytes=2048, word=int32, method=push into a symmetric out)",
            1: "all_gather(W=2, bytes=2048, word=int32, method=push)"})


def _one_of_three_differs():
    import weft

    r = weft.rank()
    x = torch.ones(2000 if r != 2 else 4000)
    weft.ops.all_reduce(torch.ones(2000))
    weft.ops.all_reduce(torch.ones(4000))
    message = _mismatch(lambda: weft.ops.all_reduce(x))
    _matching_all_reduce()
    return message


def test_one_member_of_three_that_differs_is_named_by_every_member():
    messages = run_ranks(_one_of_three_differs, 3, timeout=240, env=ENV)
    assert all(m is not None for m in messages), messages
    assert "rank 2: all_reduce(W=3, n=4000" in messages[0] and "rank 2: all_reduce(W=3, n=4000" in messages[1]
    assert "rank 0: all_reduce(W=3, n=2000" in messages[2] or "rank 1: all_reduce(W=3, n=2000" in messages[2]


def test_the_fingerprint_is_stable_and_never_zero():
    from weft.kernels.common import fingerprint

    assert fingerprint("all_reduce(W=2, n=100000, dtype=float32, op=sum, path=one_shot)") == \
        fingerprint("all_reduce(W=2, n=100000, dtype=float32, op=sum, path=one_shot)")
    values = {fingerprint(f"all_gather(W=2, bytes={b})") for b in range(2000)}
    assert len(values) == 2000 and all(0 < v < 2 ** 31 for v in values)


def _gemm_and_ulysses_families():
    import weft

    r = weft.rank()
    torch.manual_seed(r)
    messages = {}
    b = torch.randn(32, 32)

    # ag_gemm: m differs (rank 1's shard has twice the rows), warmed; no output written.
    shards = {m: torch.randn(m, 32) for m in (16, 32)}
    for a in shards.values():
        weft.ops.ag_gemm(a, b, method="overlap")
    m = 16 if r == 0 else 32
    out = torch.full((2 * m, 32), SENTINEL)
    messages["ag_gemm"] = _mismatch(lambda: weft.ops.ag_gemm(shards[m], b, method="overlap", out=out))
    assert torch.all(out == SENTINEL)
    a = shards[16]
    gathered = weft.ops.all_gather(a)
    torch.testing.assert_close(weft.ops.ag_gemm(a, b, method="overlap"), gathered @ b)

    # gemm_rs: N differs, at the first call.
    n = 32 if r == 0 else 48
    a2 = torch.randn(32, 32)
    messages["gemm_rs"] = _mismatch(lambda: weft.ops.gemm_rs(a2, torch.randn(32, n), method="overlap"))
    torch.testing.assert_close(weft.ops.gemm_rs(a2, b, method="overlap"),
                               weft.ops.reduce_scatter(a2 @ b), rtol=1e-4, atol=1e-4)

    # gemm_ar: N differs (another grid), warmed.
    wide = torch.randn(32, 64)
    for w in (b, wide):
        weft.ops.gemm_ar(a, w, method="fused")
    out = torch.full((16, 32 if r == 0 else 64), SENTINEL)
    messages["gemm_ar"] = _mismatch(lambda: weft.ops.gemm_ar(a, b if r == 0 else wide, method="fused", out=out))
    assert torch.all(out == SENTINEL)
    torch.testing.assert_close(weft.ops.gemm_ar(a, b, method="fused"), weft.ops.all_reduce(a @ b),
                               rtol=1e-4, atol=1e-4)

    # ulysses: the sequence length differs, warmed.
    xs = {s: torch.randn(s, 4, 16) for s in (8, 24)}
    for x in xs.values():
        weft.ops.ulysses_all_to_all(x, method="push")
    messages["ulysses"] = _mismatch(lambda: weft.ops.ulysses_all_to_all(xs[8 if r == 0 else 24], method="push"))
    x = xs[8]
    assert torch.equal(weft.ops.ulysses_all_to_all(weft.ops.ulysses_all_to_all(x, method="push"), scatter="seq",
                                                   method="push"), x)
    return messages


def test_the_gemm_and_ulysses_families_report_every_mismatch_on_every_rank():
    messages = run_ranks(_gemm_and_ulysses_families, 2, timeout=300, env=ENV)
    _check(messages, "ag_gemm", "ag_gemm", {0: "ag_gemm(W=2, m=16, n=32, k=32, dtype=float32)",
                                            1: "ag_gemm(W=2, m=32, n=32, k=32, dtype=float32)"})
    _check(messages, "gemm_rs", "gemm_rs", {0: "gemm_rs(W=2, m=16, n=32, k=32, dtype=float32)",
                                            1: "gemm_rs(W=2, m=16, n=48, k=32, dtype=float32)"})
    _check(messages, "gemm_ar", "gemm_ar", {0: "gemm_ar(W=2, m=16, n=32, k=32, dtype=float32)",
                                            1: "gemm_ar(W=2, m=16, n=64, k=32, dtype=float32)"})
    _check(messages, "ulysses", "ulysses_all_to_all",
           {0: "ulysses_all_to_all(W=2, scatter=heads, seq=8, packed=1, row_bytes=128, dtype=float32)",
            1: "ulysses_all_to_all(W=2, scatter=heads, seq=24, packed=1, row_bytes=128, dtype=float32)"})


def _ep_low_latency():
    import weft

    r = weft.rank()
    torch.manual_seed(r)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])  # 4 experts over 2 ranks
    x, wide = torch.randn(3, 16), torch.randn(3, 32)
    for t in (x, wide):
        weft.ops.ep_dispatch_ll(t, idx, 4, 4)
    messages = {"dispatch": _mismatch(lambda: weft.ops.ep_dispatch_ll(x if r == 0 else wide, idx, 4, 4)),
                "max_tokens": _mismatch(lambda: weft.ops.ep_dispatch_ll(x, idx, 4, 4 if r == 0 else 8))}
    # Then a matching dispatch and combine, with identity experts: each token comes back weighted by its weights.
    recv, counts, scales, handle = weft.ops.ep_dispatch_ll(x, idx, 4, 4)
    weights = torch.rand(3, 2)
    torch.testing.assert_close(weft.ops.ep_combine_ll(recv, idx, weights, handle), weights.sum(1, keepdim=True) * x)
    return messages


def test_the_low_latency_ep_ops_report_a_mismatch_on_every_rank():
    messages = run_ranks(_ep_low_latency, 2, timeout=300, env=ENV)
    _check(messages, "dispatch", "ep_dispatch_ll",
           {0: "ep_dispatch_ll(W=2, experts=4, hidden=16, dtype=float32, k=2, max_tokens=4, fp8=False)",
            1: "ep_dispatch_ll(W=2, experts=4, hidden=32, dtype=float32, k=2, max_tokens=4, fp8=False)"})
    _check(messages, "max_tokens", "ep_dispatch_ll",
           {0: "ep_dispatch_ll(W=2, experts=4, hidden=16, dtype=float32, k=2, max_tokens=4, fp8=False)",
            1: "ep_dispatch_ll(W=2, experts=4, hidden=16, dtype=float32, k=2, max_tokens=8, fp8=False)"})


def _sp_decode():
    import weft

    r = weft.rank()
    g = torch.Generator().manual_seed(r)

    def inputs(q_heads):  # the same query on every rank; this rank's 5 positions of each of 2 sequences
        q = torch.randn(2, q_heads, 64, generator=torch.Generator().manual_seed(0))
        kv = [torch.randn(2, 5, 2, 64, generator=g) for _ in range(2)]
        return q, *kv, torch.tensor([5, 3], dtype=torch.int32)

    narrow, wide = inputs(2), inputs(4)
    for args in (narrow, wide):
        weft.ops.sp_flash_decode(*args)
    message = _mismatch(lambda: weft.ops.sp_flash_decode(*(narrow if r == 0 else wide)))
    out = weft.ops.sp_flash_decode(*narrow)
    return message, out.numpy().tobytes()  # bytes: a tensor through the result queue would need this rank alive


def test_sp_flash_decode_reports_a_mismatch_on_every_rank():
    results = run_ranks(_sp_decode, 2, timeout=300, env=ENV)
    _check([{"heads": m} for m, _ in results], "heads", "sp_flash_decode",
           {0: "sp_flash_decode(W=2, batch=2, q_heads=2, head_dim=64, dtype=float32)",
            1: "sp_flash_decode(W=2, batch=2, q_heads=4, head_dim=64, dtype=float32)"})
    assert results[0][1] == results[1][1]  # then a matching call: the same bits on every rank


def _ep_high_throughput():
    import weft

    r = weft.rank()
    torch.manual_seed(r)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])  # 4 experts over 2 ranks: tokens to rank 0, rank 1, both
    weights = torch.rand(3, 2)
    x, wide = torch.randn(3, 16), torch.randn(3, 32)
    mine = x if r == 0 else wide
    # At the plans' first call (the exact path: the count exchange's check, raised at the host sync).
    messages = {"first": _mismatch(lambda: weft.ops.ep_dispatch(mine, idx, weights, 4))}
    for t in (x, wide):  # both plans warmed on both ranks, both paths
        for cap in (None, 8):
            weft.ops.ep_dispatch(t, idx, weights, 4, max_recv_tokens=cap)
    messages["warm"] = _mismatch(lambda: weft.ops.ep_dispatch(mine, idx, weights, 4))
    # Without a host sync (max_recv_tokens): the push and the receive of a tripped family do nothing.
    messages["warm no sync"] = _mismatch(lambda: weft.ops.ep_dispatch(mine, idx, weights, 4, max_recv_tokens=8))
    # A dispatch on one rank, a combine on the other: the two ops sign the same words.
    recv, _, _, _, handle = weft.ops.ep_dispatch(x, idx, weights, 4)
    messages["dispatch / combine"] = _mismatch(
        lambda: weft.ops.ep_dispatch(x, idx, weights, 4) if r == 0 else weft.ops.ep_combine(recv, handle))
    # Combines of dispatches that differ (hidden 16 / 32), warmed.
    handles = {t.shape[1]: weft.ops.ep_dispatch(t, idx, weights, 4) for t in (x, wide)}
    for recv_t, _, _, _, h in handles.values():
        weft.ops.ep_combine(recv_t, h)
    handles = {t.shape[1]: weft.ops.ep_dispatch(t, idx, weights, 4) for t in (x, wide)}
    recv_t, _, _, _, h = handles[mine.shape[1]]
    messages["combine"] = _mismatch(lambda: weft.ops.ep_combine(recv_t, h))
    # Then a matching dispatch and combine, with identity experts: each token comes back once per rank it went to.
    recv, _, _, _, handle = weft.ops.ep_dispatch(x, idx, weights, 4, max_recv_tokens=8)
    torch.testing.assert_close(weft.ops.ep_combine(recv, handle), x * torch.tensor([[1.0], [1.0], [2.0]]))
    return messages


def test_the_high_throughput_ep_ops_report_a_mismatch_on_every_rank():
    messages = run_ranks(_ep_high_throughput, 2, timeout=300, env=ENV)
    texts = {w: f"experts=4, hidden={w}, dtype=float32, k=2" for w in (16, 32)}
    for case, cap in (("first", None), ("warm", None), ("warm no sync", 8)):
        _check(messages, case, "ep_dispatch", {0: f"ep_dispatch(W=2, {texts[16]}, max_recv_tokens={cap})",
                                               1: f"ep_dispatch(W=2, {texts[32]}, max_recv_tokens={cap})"})
    _check(messages, "combine", "ep_combine", {0: f"ep_combine(W=2, {texts[16]}, max_recv_tokens=None)",
                                               1: f"ep_combine(W=2, {texts[32]}, max_recv_tokens=None)"})
    dispatch, combine = (f"{op}(W=2, {texts[16]}, max_recv_tokens=None)" for op in ("ep_dispatch", "ep_combine"))
    assert messages[0]["dispatch / combine"].startswith("weft.ops.ep_dispatch:")
    assert messages[1]["dispatch / combine"].startswith("weft.ops.ep_combine:")
    for rank in (0, 1):
        message = messages[rank]["dispatch / combine"]
        assert f"rank 0: {dispatch}" in message and f"rank 1: {combine}" in message, message


def _tp_moe():
    import weft

    r = weft.rank()
    bf16 = torch.bfloat16
    experts, k, hidden, n = 4, 2, 32, 16
    g = torch.Generator().manual_seed(5)  # every rank's inputs on every rank (the reference needs them)
    w = torch.randn(experts, hidden, n, generator=g).to(bf16)
    w_down = {d: torch.randn(experts, n, d, generator=g).to(bf16) for d in (32, 64)}
    tokens = {m: [torch.randn(m, hidden, generator=g).to(bf16) for _ in range(2)] for m in (4, 8)}
    idx = {m: [torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(m)]) for _ in range(2)]
           for m in (4, 8)}
    weights = [torch.rand(4, k, generator=g) for _ in range(2)]

    def ag(m, out=None):
        return weft.ops.ag_group_gemm(tokens[m][r], w, idx[m][r], method="overlap", out=out)

    messages = {}
    # ag_group_gemm: m differs, at the first call and warmed (both plans made on both ranks); out is not written.
    mine = 4 if r == 0 else 8
    for case in ("ag_group_gemm first", "ag_group_gemm warm"):
        out = torch.full((2 * mine * k, n), SENTINEL, dtype=bf16)
        messages[case] = _mismatch(lambda: ag(mine, out))
        assert torch.all(out == SENTINEL)
        for m in (4, 8):
            ag(m)
    # group_gemm_rs: hidden differs, warmed; out is not written.
    inter, layout = ag(4)
    for d in (32, 64):
        weft.ops.group_gemm_rs(inter, w_down[d], idx[4][r], weights[r], layout, method="overlap")
    d = 32 if r == 0 else 64
    out = torch.full((4, d), SENTINEL, dtype=bf16)
    messages["group_gemm_rs warm"] = _mismatch(
        lambda: weft.ops.group_gemm_rs(inter, w_down[d], idx[4][r], weights[r], layout, method="overlap", out=out))
    assert torch.all(out == SENTINEL)
    # ag_group_gemm on one rank, group_gemm_rs on the other: the same start kernel and signature words.
    messages["ag / rs"] = _mismatch(lambda: ag(4) if r == 0 else weft.ops.group_gemm_rs(
        inter, w_down[32], idx[4][r], weights[r], layout, method="overlap"))

    # Then matching calls, against torch: every pair's row of inter, and each token's weighted sum over the ranks
    # (the same weights on both ranks: twice one rank's partial).
    inter, layout = ag(4)
    rows = layout.row_of_pair.view(2, 4, k)
    for c in range(2):
        for t in range(4):
            for j in range(k):
                expected = tokens[4][c][t].float() @ w[idx[4][c][t, j]].float()
                torch.testing.assert_close(inter[rows[c, t, j]].float(), expected, rtol=2e-2, atol=2e-2)
    got = weft.ops.group_gemm_rs(inter, w_down[32], idx[4][r], weights[r], layout, method="overlap")
    expected = torch.zeros(4, 32)
    for t in range(4):
        for j in range(k):
            partial = (inter[rows[r, t, j]].float() @ w_down[32][idx[4][r][t, j]].float()).to(bf16).float()
            expected[t] += weights[r][t, j] * partial
    torch.testing.assert_close(got.float(), 2 * expected.to(bf16).float(), rtol=2e-2, atol=5e-2)
    return messages


def test_the_tp_moe_ops_report_a_mismatch_on_every_rank():
    messages = run_ranks(_tp_moe, 2, timeout=300, env=ENV)
    ag = "ag_group_gemm(W=2, m={}, k=2, experts=4, hidden=32, dtype=bfloat16)"
    rs = "group_gemm_rs(W=2, m=4, k=2, experts=4, hidden={}, dtype=bfloat16)"
    for case in ("ag_group_gemm first", "ag_group_gemm warm"):
        _check(messages, case, "ag_group_gemm", {0: ag.format(4), 1: ag.format(8)})
    _check(messages, "group_gemm_rs warm", "group_gemm_rs", {0: rs.format(32), 1: rs.format(64)})
    assert messages[0]["ag / rs"].startswith("weft.ops.ag_group_gemm:")
    assert messages[1]["ag / rs"].startswith("weft.ops.group_gemm_rs:")
    for rank in (0, 1):
        message = messages[rank]["ag / rs"]
        assert f"rank 0: {ag.format(4)}" in message and f"rank 1: {rs.format(32)}" in message, message


def _another_family():
    import weft

    r = weft.rank()
    x = torch.ones(1000)
    weft.ops.all_reduce(x)  # both families' workspaces made, both warmed
    weft.ops.all_gather(x)
    try:
        weft.ops.all_reduce(x) if r == 0 else weft.ops.all_gather(x)
    except weft.SignatureMismatch as e:
        return str(e)
    return None


def test_members_in_collectives_of_different_families_get_an_error_naming_both():
    # No signature word of its own family arrives: the wait times out (here after 3 s), and the report finds the
    # peer's newer word in the other family's words.
    messages = run_ranks(_another_family, 2, timeout=120, env=dict(ENV, WEFT_WAIT_TIMEOUT_S="3"))
    reduce, gather = "all_reduce(W=2, n=1000, dtype=float32, op=sum", "all_gather(W=2, bytes=4000, word="
    assert messages[0] is not None and messages[1] is not None, messages
    assert messages[0].startswith("weft.ops.all_reduce: the members of weft.Group("), messages[0]
    assert f"rank 1 is in {gather}" in messages[0] and f"while rank 0 waits in {reduce}" in messages[0], messages[0]
    assert messages[1].startswith("weft.ops.all_gather: the members of weft.Group("), messages[1]
    assert f"rank 0 is in {reduce}" in messages[1] and f"while rank 1 waits in {gather}" in messages[1], messages[1]
