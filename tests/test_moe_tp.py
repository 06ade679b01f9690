"""TP-MoE on cpu ranks: ag_group_gemm and group_gemm_rs against torch references, both methods.

Every rank builds every rank's tokens, routing and weight slices from a shared seed, so it knows the whole
layer and checks its own results: the grouped layout exactly (a stable sort of each rank's pairs by expert),
the intermediate and the reduce-scattered output against torch's matmuls. Outputs are poisoned (NaN) before
each call; the rows of h that belong to no expert are NaN too, since nothing may read them. Calls follow
each other with new routing, one rank late, so the barrier epochs and the flags are exercised.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 240


# -- helpers run on the ranks ---------------------------------------------------------

def _routing(seed, w, m, experts, k, mode):
    """Per rank: topk_idx (m, k) int64 and topk_weights (m, k) fp32."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(w):
        pool = experts // 2 if mode == "half" else experts  # "half": the other experts get nothing
        idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(m)]) if m else \
            torch.empty(0, k, dtype=torch.int64)
        if mode == "masked" and m:
            idx[torch.rand(m, k, generator=g) < 0.3] = -1
        out.append((idx.long(), torch.rand(m, k, generator=g)))
    return out


def _expected_layout(idxs, experts):
    """(starts (W, E + 2), pair_of_row (W, m k), row_of_pair (W m, k)) of every rank's pairs, by a plain stable
    sort; an entry outside [0, E) (-1, or a bad one not raised yet) is a pair without expert."""
    import torch

    starts, orders = [], []
    for idx in idxs:
        keys = [e if 0 <= e < experts else experts for e in idx.reshape(-1).tolist()]
        order = sorted(range(len(keys)), key=lambda p: keys[p])
        starts.append([sum(1 for key in keys if key < e) for e in range(experts + 2)])
        orders.append(order)
    m, k = idxs[0].shape
    row_of_pair = torch.full((len(idxs) * m, k), -1, dtype=torch.int32)
    for c, order in enumerate(orders):  # row_of_pair inverts pair_of_row, -1 where the pair has no expert
        for i, p in enumerate(order):
            if 0 <= idxs[c][p // k, p % k] < experts:
                row_of_pair[c * m + p // k, p % k] = c * m * k + i
    return (torch.tensor(starts, dtype=torch.int32), torch.tensor(orders, dtype=torch.int32).reshape(len(idxs), -1),
            row_of_pair)


def _inter_ref(tokens, idxs, w_up, pair_of_row, k):
    """The grouped intermediate (W m k, N): each pair's token @ its expert's slice, fp32 (zeros: no expert)."""
    import torch

    rows = []
    for c, (x, idx) in enumerate(zip(tokens, idxs)):
        for p in pair_of_row[c].tolist():
            e = int(idx[p // k, p % k])
            rows.append(x[p // k].float() @ w_up[e].float() if 0 <= e < len(w_up) else torch.zeros(w_up.shape[2]))
    return torch.stack(rows) if rows else torch.zeros(0, w_up.shape[2])


def _rs_ref(hs, w_downs, idxs, wts, pair_of_row, k, me, m, dtype):
    """My tokens' output: each rank's weighted sum of its experts' outputs (rounded to the dtype), summed in
    rank order in fp32. hs[q], w_downs[q]: rank q's h and w_down slice."""
    import torch

    hidden = w_downs[0].shape[2]
    total = torch.zeros(m, hidden)
    base = me * m * k
    row_of = {int(p): base + i for i, p in enumerate(pair_of_row[me].tolist())}
    for h, wd in zip(hs, w_downs):
        part = torch.zeros(m, hidden)
        for t in range(m):
            for j in range(k):
                e = int(idxs[me][t, j])
                if 0 <= e < len(wd):
                    y = (h[row_of[t * k + j]].float() @ wd[e].float()).to(dtype)
                    part[t] += wts[me][t, j] * y.float()
        total += part.to(dtype).float()
    return total


def _case(seed, m, hidden, n, experts, k, mode, method, dtype_name="bfloat16", with_layout=True, bad=None,
          group=None):
    """One ag_group_gemm + group_gemm_rs call checked against the references.

    bad (rank, row, value): that rank's topk_idx[row, 1] is `value`, or with None its row's first expert
    again. That rank's calls raise a ValueError naming topk_idx, the row and the expert (under the
    interpreter: the same call, its collective part done); group_gemm_rs goes without a layout, so that it
    reads topk_idx (and every rank takes the same path). The other ranks' results are right for the routing as
    it was (an entry outside the experts counts as none, a repeat computes its pair twice): no harm done.
    group: the ops' group (every member builds every member's inputs from the seed)."""
    import pytest
    import torch

    import weft
    from weft.kernels.common import resolve

    me, w = resolve(group).rank, resolve(group).size
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed + 1000)
    tokens = [torch.randn(m, hidden, generator=g).to(dtype) for _ in range(w)]
    w_up = [(torch.randn(experts, hidden, n, generator=g) / hidden ** 0.5).to(dtype) for _ in range(w)]
    w_down = [(torch.randn(experts, n, hidden, generator=g) / n ** 0.5).to(dtype) for _ in range(w)]
    routing = _routing(seed, w, m, experts, k, mode)
    idxs, wts = [r[0] for r in routing], [r[1] for r in routing]
    tag = f"seed {seed} m {m} hidden {hidden} n {n} E {experts} k {k} {mode} {method} {dtype_name} bad {bad}"
    raises = None
    if bad is not None:
        rank, row, value = bad
        idxs[rank][row, 1] = idxs[rank][row, 0] if value is None else value
        raises = (rf"topk_idx row {row} names expert {int(idxs[rank][row, 0])} twice" if value is None else
                  rf"topk_idx row {row} holds {value}: an expert outside") if me == rank else None
        with_layout = False
    starts, pair_of_row, row_of_pair = _expected_layout(idxs, experts)

    out = torch.full((w * m * k, n), float("nan"), dtype=dtype)
    if raises:
        with pytest.raises(ValueError, match=raises):
            weft.ops.ag_group_gemm(tokens[me], w_up[me], idxs[me], method=method, out=out, group=group)
    else:
        inter, layout = weft.ops.ag_group_gemm(tokens[me], w_up[me], idxs[me], method=method, out=out, group=group)
        assert inter is out, tag
        assert torch.equal(layout.starts, starts), tag
        assert torch.equal(layout.pair_of_row, pair_of_row), tag
        assert torch.equal(layout.row_of_pair, row_of_pair), tag
        torch.testing.assert_close(inter.float(), _inter_ref(tokens, idxs, w_up[me], pair_of_row, k), rtol=2e-2,
                                   atol=2e-2, msg=tag)

    # Every rank's h: random, NaN in the rows of pairs without expert (never read).
    hs = []
    for c in range(w):
        h = torch.randn(w * m * k, n, generator=g).to(dtype)
        routed = row_of_pair.reshape(-1)
        mask = torch.ones(w * m * k, dtype=torch.bool)
        mask[routed[routed >= 0].long()] = False
        h[mask] = float("nan")
        hs.append(h)
    res = torch.full((m, hidden), float("nan"), dtype=dtype)
    rs = lambda: weft.ops.group_gemm_rs(hs[me], w_down[me], idxs[me], wts[me],  # noqa: E731
                                        layout if with_layout else None, method=method, out=res, group=group)
    if raises:
        with pytest.raises(ValueError, match=raises):
            rs()
        return True
    got = rs()
    assert got is res, tag
    want = _rs_ref(hs, w_down, idxs, wts, pair_of_row, k, me, m, dtype)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2, msg=tag)
    return True


def _cases(cases, late=False):
    import time

    import weft

    for i, case in enumerate(cases):
        if late and weft.rank() == i % weft.world_size():
            time.sleep(0.02)  # a different rank late each call
        _case(*case)
    return True


# -- tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("w", [1, 2, 3])  # 4 ranks: the world layout of test_moe_on_every_group_layout
def test_moe_tp_matches_reference(w):
    experts = 6 if w == 3 else 4
    cases = [
        (w * 10 + 1, 5, 40, 24, experts, 3, "random", "overlap"),             # ragged everywhere
        (w * 10 + 2, 7, 64, 32, experts, 2, "half", "overlap"),               # whole blocks; experts with no pair
        (w * 10 + 3, 4, 32, 16, experts, 2, "masked", "baseline", "float16"),  # pairs without expert
        (w * 10 + 4, 6, 32, 40, experts, 1, "random", "auto", "bfloat16", False),  # no layout: made again
    ]
    if w >= 3:  # the interpreter's cost grows with the ranks: the ragged and the masked case
        cases = cases[0::2]
    assert all(run_ranks(_cases, w, cases, timeout=TIMEOUT, env=ENV))


def test_moe_tp_many_calls():
    cases = [(50 + i, 3 + i % 3, 32, 16, 4, 1 + i % 2, ("random", "masked", "half")[i % 3],
              ("overlap", "baseline")[i % 2 == 1 and i > 2]) for i in range(6)]
    assert all(run_ranks(_cases, 2, cases, True, timeout=TIMEOUT, env=ENV))


# The layout sort alone, in process: pairs over many blocks (the GEMM tests' shapes fit one), every key.
LAYOUT_SHAPES = [  # (world, tokens, k, experts, index dtype, routing)
    (1, 0, 2, 4, "int64", "random"),       # no pairs
    (3, 1, 1, 1, "int32", "random"),       # one pair per rank
    (2, 37, 3, 5, "int64", "masked"),      # pairs without expert, ragged blocks
    (4, 100, 8, 16, "int32", "random"),    # k = 8
    (2, 70, 2, 130, "int64", "one"),       # every pair to one expert; more experts than a block of pairs
    (2, 53, 4, 8, "int64", "bad"),         # entries outside the experts, not raised yet: no expert
    (2, 300, 8, 12, "int32", "masked"),    # more blocks than a step of the counts' scan (at 32-pair blocks)
]


@pytest.mark.parametrize("block", [pytest.param(32, marks=pytest.mark.long), pytest.param(64, marks=pytest.mark.long), 256])
def test_layout_sort_matches_a_stable_sort(block):
    import torch

    from weft.kernels.moe.group_layout import LayoutLaunches

    g = torch.Generator().manual_seed(block)
    for world, m, k, experts, dtype, mode in LAYOUT_SHAPES:
        idxs = [torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(m)]) if m else
                torch.empty(0, k, dtype=torch.int64) for _ in range(world)]
        for idx in idxs:
            if mode == "masked":
                idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
            elif mode == "one":
                idx[:, 0] = experts - 1
            elif mode == "bad":
                idx[torch.rand(idx.shape, generator=g) < 0.2] = experts + 3
                idx[torch.rand(idx.shape, generator=g) < 0.1] = -5
        idxs = [idx.to(getattr(torch, dtype)) for idx in idxs]
        tag = f"block {block} world {world} m {m} k {k} E {experts} {dtype} {mode}"
        starts, pair_of_row, row_of_pair = _expected_layout([idx.long() for idx in idxs], experts)
        width = experts + 2 + m * k
        # Every rank's chunk by one plan, its sort launches called again for each rank (the sort is most of the
        # interpreter's time here, and `copy` changes only `gathered`: the other plan takes the same chunks).
        sorting = LayoutLaunches(idxs[0], experts, world, copy=False, block=block)
        chunks = torch.stack([sorting.chunk(idx, torch.full((width,), -7, dtype=torch.int32)) for idx in idxs])
        for copy in (False, True):
            launches = sorting if not copy else LayoutLaunches(idxs[0], experts, world, copy=copy, block=block)
            metas = chunks.clone()
            layout = launches.gathered(metas)
            assert torch.equal(layout.starts, starts), tag
            assert torch.equal(layout.pair_of_row, pair_of_row), tag
            assert torch.equal(layout.row_of_pair, row_of_pair), tag
            assert (layout.meta is not metas) == copy, tag
            metas.fill_(-7)  # the workspace, overwritten by the next call: a copy keeps the layout
            assert torch.equal(layout.starts, starts) == copy, tag


def test_moe_tp_workspace_fallback():
    """A call larger than the workspace: "auto" takes the baseline, "overlap" says why it cannot."""
    env = dict(ENV, WEFT_WORKSPACE_BYTES="4096")
    assert all(run_ranks(_fallback, 2, timeout=TIMEOUT, env=env))


def _fallback():
    import torch

    import weft
    from weft.testing.checks import rejects

    _case(70, 8, 128, 16, 4, 2, "random", "auto")
    x = torch.zeros(8, 128, dtype=torch.bfloat16)
    wu = torch.zeros(4, 128, 16, dtype=torch.bfloat16)
    idx = torch.zeros(8, 1, dtype=torch.int64)
    rejects(lambda: weft.ops.ag_group_gemm(x, wu, idx, method="overlap"), ValueError, "workspace", [x])
    return True


def _rejects():
    import torch

    import weft
    from weft.testing.checks import rejects

    m, hidden, n, experts, k = 4, 32, 16, 4, 2
    x = torch.randn(m, hidden).to(torch.bfloat16)
    wu = torch.randn(experts, hidden, n).to(torch.bfloat16)
    wd = torch.randn(experts, n, hidden).to(torch.bfloat16)
    idx, wts = _routing(3, 1, m, experts, k, "random")[0]
    out = torch.zeros(2 * m * k, n, dtype=torch.bfloat16)
    guarded = [x, wu, wd, idx, wts, out]
    ag = weft.ops.ag_group_gemm
    rejects(lambda: ag(x.float(), wu, idx), TypeError, "tokens_shard", guarded)
    rejects(lambda: ag(x, wu.half(), idx), TypeError, "w_experts_shard", guarded)
    rejects(lambda: ag(x, wu[:, :8].contiguous(), idx), ValueError, "w_experts_shard", guarded)
    rejects(lambda: ag(x, wu, idx[:3].contiguous()), ValueError, "topk_idx", guarded)
    rejects(lambda: ag(x, wu, idx.float()), TypeError, "topk_idx", guarded)
    dup = idx.clone()
    dup[1, 1] = dup[1, 0]
    # Checked on the device: under the interpreter this call raises, its collective part done (test_bad_rows).
    rejects(lambda: ag(x, wu, dup), ValueError, "twice", guarded)
    rejects(lambda: ag(x, wu, idx + experts), ValueError, "outside", guarded)
    rejects(lambda: ag(x, wu, idx, method="fast"), ValueError, "method", guarded)
    rejects(lambda: ag(x, wu, idx, out=out[:, :8]), ValueError, "out", guarded)
    inter, layout = ag(x, wu, idx, out=out)
    rs = weft.ops.group_gemm_rs
    rejects(lambda: rs(inter[:-1], wd, idx, wts, layout), ValueError, "h", guarded)
    rejects(lambda: rs(inter, wd[:, :8].contiguous(), idx, wts, layout), ValueError, "w_down_shard", guarded)
    rejects(lambda: rs(inter, wd, idx, wts.double(), layout), TypeError, "topk_weights", guarded)
    rejects(lambda: rs(inter, wd, idx, wts[:, :1].contiguous(), layout), ValueError, "topk_weights", guarded)
    rejects(lambda: rs(inter, wd, idx, wts, "layout"), TypeError, "layout", guarded)
    _, other = ag(x, wu, idx[:, :1].contiguous())
    rejects(lambda: rs(inter, wd, idx, wts, other), ValueError, "layout", guarded)
    rejects(lambda: rs(inter, wd, dup, wts), ValueError, "twice", guarded)
    # Nothing was sent: the next calls see the epochs they expect.
    _case(5, 4, 32, 16, 4, 2, "random", "overlap")
    return True


def test_bad_input_rejected_before_sending():
    assert all(run_ranks(_rejects, 2, timeout=TIMEOUT, env=ENV))


# -- bad rows found on the device, no host sync ---------------------------------------------

@pytest.mark.parametrize("w", [1, 2])
def test_bad_rows_raise_and_the_next_call_works(w):
    """A bad row raises on its rank (the call itself under the interpreter; on GPUs the family's next call,
    tests/test_gpu_moe.py) and does no harm to the other ranks' results, with each method and where an op has
    no workspace or no GEMM (a world of one, an empty dimension); the next calls work."""
    last = w - 1
    cases = [
        (90, 4, 32, 16, 4, 2, "random", "overlap", "bfloat16", True, (0, 2, None)),  # expert named twice
        (91, 4, 32, 16, 4, 2, "masked", "baseline", "bfloat16", True, (last, 0, 99)),  # outside the experts
        (92, 3, 32, 0, 4, 2, "random", "auto", "bfloat16", True, (0, 1, -5)),  # n = 0: no GEMM
        (93, 4, 32, 16, 4, 2, "random", "overlap" if w > 1 else "baseline"),
    ]
    assert all(run_ranks(_cases, w, cases, timeout=TIMEOUT, env=ENV))


def _no_host_reads():
    """Eager calls of both ops, each method, with and without a layout, and of the local routed ops: weft reads
    no tensor value into Python (on GPUs each such read is a host sync; tests/test_gpu_moe.py checks the GPU
    side)."""
    from weft.testing.checks import host_reads

    _case(95, 4, 32, 16, 4, 2, "random", "overlap")  # plans and workspaces made outside the check
    _case(96, 4, 32, 16, 4, 2, "masked", "baseline", "bfloat16", False)
    _routed_case(95, 4, 32, 16, 2, 4, "local", False)
    with host_reads() as found:
        _case(97, 4, 32, 16, 4, 2, "masked", "overlap")
        _case(98, 4, 32, 16, 4, 2, "random", "baseline", "bfloat16", False)
        _routed_case(96, 4, 32, 16, 2, 4, "local", False)
    assert not found, found
    return True


def test_eager_calls_make_no_host_sync():
    assert all(run_ranks(_no_host_reads, 2, timeout=TIMEOUT, env=ENV))


# -- groups ---------------------------------------------------------------------------------

def _on_layouts(iterations):
    """Every op of the family's three pairs (ep_dispatch / ep_combine, ep_dispatch_ll / ep_combine_ll,
    ag_group_gemm / group_gemm_rs) on every group layout of 4 ranks (weft.testing.groups.layouts: strided, pairs,
    one, a torch ProcessGroup, the world), against references over each group's members, fresh inputs per call
    and odd shapes (rows of 33 and 37 bf16 elements, ragged token counts). The calls of all layouts and ops are
    interleaved in an order drawn per iteration (the same on every rank): EP over the world between TP-MoE calls
    on pairs and the others."""
    import random

    import test_moe

    from weft.testing.groups import layouts

    found = layouts()
    units = [(name, op) for name in sorted(found) for op in ("ht", "ll", "tp")]
    for it in range(iterations):
        for i, (name, op) in enumerate(random.Random(it).sample(units, len(units))):
            group = found[name]
            _, size = test_moe._members(group)
            seed = 1000 * it + 10 * i
            experts = 4 * size
            if op == "ht":
                test_moe._ht_case(seed, [3, 0, 5, 2][:size], experts, 2, 37, ("masked", "random")[it % 2],
                                  (None, 12)[it % 2], group=group)
            elif op == "ll":
                test_moe._ll_case(seed, [4, 1, 0, 3][:size], experts, 3, 33, "random", 4, it % 2 == 1, group=group)
            else:
                _case(seed, 3, 33, 24, experts, 2, ("random", "masked")[it % 2], "auto", group=group)
    return True


@pytest.mark.long  # 24 s here; tests/test_model.py runs MoE over groups in CI
def test_moe_on_every_group_layout():
    assert all(run_ranks(_on_layouts, 4, 1, timeout=2 * TIMEOUT, env=ENV))


def _pair_beside_a_leftover_rank():
    """A group of world ranks 0 and 1 runs EP (both pairs) and TP-MoE while rank 2, outside it, runs the same ops
    on its own group of one: no op waits on a rank outside its group. Then the world's calls as usual."""
    import test_moe

    import weft

    pair = weft.new_group([0, 1])
    one = weft.new_subgroups(1)
    group = pair if weft.rank() < 2 else one
    _, size = test_moe._members(group)
    for c in range(2):
        test_moe._ht_case(40 + c, [4, 2][:size], 4 * size, 2, 32, "random", group=group)
        test_moe._ll_case(50 + c, [3, 1][:size], 4 * size, 2, 32, "masked", 4, group=group)
        _case(60 + c, 3, 32, 16, 4 * size, 2, "random", "auto", group=group)
    test_moe._ht_case(70, [2, 3, 1], 12, 2, 32, "random")
    return True


def test_pair_beside_a_leftover_rank():
    assert all(run_ranks(_pair_beside_a_leftover_rank, 3, timeout=TIMEOUT, env=ENV))


def _compiled_over_pairs():
    """ag_group_gemm with group= under torch.compile(fullgraph=True) (the operator takes the group's name), over
    pairs of 4 ranks, against the eager call; no graph break."""
    import torch

    import weft

    pairs = weft.new_subgroups(2)
    me = pairs.rank
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randn(3, 32, generator=g).to(torch.bfloat16) for _ in range(2)]
    w_up = (torch.randn(4, 32, 16, generator=g) / 6).to(torch.bfloat16)
    idx = [_routing(6, 2, 3, 4, 2, "random")[r][0] for r in range(2)]

    def program(x, w, topk_idx):
        inter, layout = weft.ops.ag_group_gemm(x, w, topk_idx, group=pairs)
        return inter * 2, layout.row_of_pair

    fn = torch.compile(program, fullgraph=True, backend="aot_eager")
    for step in range(2):  # the second call replays what the first compiled
        got, want = fn(tokens[me], w_up, idx[me]), program(tokens[me], w_up, idx[me])
        torch.testing.assert_close(got[0], want[0], msg=f"step {step}")
        assert torch.equal(got[1], want[1]), f"step {step}"
    from torch._dynamo.utils import counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    return True


def test_compiled_with_a_group():
    assert all(run_ranks(_compiled_over_pairs, 4, timeout=TIMEOUT, env=ENV))


def _mismatched_token_counts(method):
    """ag_group_gemm with m = 4 on rank 0 and 8 on rank 1 (a collective called with other shapes): every rank
    raises a weft.SignatureMismatch naming the other rank's call, nothing is written outside the buffers (each
    rank's out was surrounded by NaN guard rows that stay NaN), and the next matching calls work."""
    import pytest
    import torch

    import weft

    me = weft.rank()
    m, hidden, n, experts, k = (4, 8)[me], 32, 16, 4, 2
    g = torch.Generator().manual_seed(80 + me)
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
    wu = torch.randn(experts, hidden, n, generator=g).to(torch.bfloat16)
    idx = _routing(81 + me, 1, m, experts, k, "random")[0][0]
    guarded = torch.full((2 * m * k + 2, n), float("nan"), dtype=torch.bfloat16)
    out = guarded[1:-1]
    for _ in range(2):
        # The overlap's signature check, or (the baseline, whose gather is weft's all_gather) that all_gather's: a
        # weft.SignatureMismatch on every rank either way.
        with pytest.raises(weft.SignatureMismatch, match="(ag_group_gemm|all_gather): the members of "):
            weft.ops.ag_group_gemm(x, wu, idx, method=method, out=out)
        assert guarded[0].isnan().all() and guarded[-1].isnan().all()
    _case(82, 4, 32, 16, 4, 2, "random", method)
    return True


@pytest.mark.parametrize("method", ["overlap", "baseline"])
def test_mismatched_token_counts_raise_on_every_rank(method):
    assert all(run_ranks(_mismatched_token_counts, 2, method, timeout=TIMEOUT, env=ENV))


# -- the local ops: routed_gemm, routed_gemm_sum ----------------------------------------------

def _routed_case(seed, m, hidden, n, experts, k, mode, with_layout=True):
    """routed_gemm + routed_gemm_sum on this rank's own rows (m + rank of them: the ranks differ) against the
    one-rank references; k may pass the experts (mode "local": an EP rank's rows, -1 for the experts
    elsewhere)."""
    import torch

    import weft

    me = weft.rank()
    m += me
    g = torch.Generator().manual_seed(seed * 10 + me)
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
    w_up = (torch.randn(experts, hidden, n, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(experts, n, hidden, generator=g) / n ** 0.5).to(torch.bfloat16)
    if mode == "local":  # k of 2 E experts, this rank's E first; those of other ranks -1
        idx = torch.stack([torch.randperm(2 * experts, generator=g)[:k] for _ in range(m)]) if m else \
            torch.empty(0, k, dtype=torch.int64)
        idx = torch.where(idx < experts, idx, -1)
        wts = torch.rand(m, k, generator=g)
    else:
        idx, wts = _routing(seed * 10 + me, 1, m, experts, k, mode)[0]
    tag = f"seed {seed} m {m} E {experts} k {k} {mode} layout {with_layout}"
    starts, pair_of_row, row_of_pair = _expected_layout([idx], experts)
    out = torch.full((m * k, n), float("nan"), dtype=torch.bfloat16)
    inter, layout = weft.ops.routed_gemm(x, w_up, idx, out=out)
    assert inter is out, tag
    assert torch.equal(layout.starts, starts) and torch.equal(layout.pair_of_row, pair_of_row), tag
    assert torch.equal(layout.row_of_pair, row_of_pair), tag
    torch.testing.assert_close(inter.float(), _inter_ref([x], [idx], w_up, pair_of_row, k), rtol=2e-2, atol=2e-2,
                               msg=tag)
    h = torch.randn(m * k, n, generator=g).to(torch.bfloat16)
    h[~torch.isin(torch.arange(m * k), row_of_pair[row_of_pair >= 0].long())] = float("nan")  # read by nothing
    res = torch.full((m, hidden), float("nan"), dtype=torch.bfloat16)
    got = weft.ops.routed_gemm_sum(h, w_down, idx, wts, layout if with_layout else None, out=res)
    assert got is res, tag
    want = _rs_ref([h], [w_down], [idx], [wts], pair_of_row, k, 0, m, torch.bfloat16)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2, msg=tag)
    return True


def _fp8_values(q, scales, block_rows: bool):
    """The fp32 values of fp8 q with its scales: per row and 128 channels (fp8_rows), or per 128 x 128 block of
    (E, K, N) weights (fp8_blocks)."""
    if not block_rows:
        return q.float() * scales.repeat_interleave(128, dim=-1)
    return q.float() * scales.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[..., :q.shape[2]]


def _routed_fp8_case(seed, m, n, n_down, experts, k, with_layout=True):
    """routed_gemm + routed_gemm_sum in fp8 (hidden and the down GEMM's K 128: a scale block) against torch on
    the dequantized operands: the gate/up GEMM's N and the down GEMM's N ragged; k of 2 E experts (this rank's
    E first, the others -1), m + rank rows."""
    import torch

    import weft

    me = weft.rank()
    m += me
    g = torch.Generator().manual_seed(seed * 10 + me)
    x, x_scales = weft.ops.fp8_rows(torch.randn(m, 128, generator=g).to(torch.bfloat16))
    w_up, up_scales = weft.ops.fp8_blocks(torch.randn(experts, 128, n, generator=g) / 128 ** 0.5)
    w_down, down_scales = weft.ops.fp8_blocks(torch.randn(experts, 128, n_down, generator=g) / 128 ** 0.5)
    idx = torch.stack([torch.randperm(2 * experts, generator=g)[:k] for _ in range(m)]) if m else \
        torch.empty(0, k, dtype=torch.int64)
    idx = torch.where(idx < experts, idx, -1)
    wts = torch.rand(m, k, generator=g)
    tag = f"fp8 seed {seed} m {m} E {experts} k {k} layout {with_layout}"
    starts, pair_of_row, row_of_pair = _expected_layout([idx], experts)
    out = torch.full((m * k, n), float("nan"), dtype=torch.bfloat16)
    inter, layout = weft.ops.routed_gemm(x, w_up, idx, out=out, x_scales=x_scales, w_scales=up_scales)
    assert inter is out, tag
    assert torch.equal(layout.starts, starts) and torch.equal(layout.pair_of_row, pair_of_row), tag
    want = _inter_ref([_fp8_values(x, x_scales, False)], [idx], _fp8_values(w_up, up_scales, True), pair_of_row, k)
    torch.testing.assert_close(inter.float(), want, rtol=2e-2, atol=2e-2, msg=tag)  # zeros: no expert
    hb = torch.randn(m * k, 128, generator=g)
    hb[~torch.isin(torch.arange(m * k), row_of_pair[row_of_pair >= 0].long())] = float("nan")  # read by nothing
    h, h_scales = weft.ops.fp8_rows(hb)
    res = torch.full((m, n_down), float("nan"), dtype=torch.bfloat16)
    got = weft.ops.routed_gemm_sum(h, w_down, idx, wts, layout if with_layout else None, out=res, x_scales=h_scales,
                                   w_scales=down_scales)
    assert got is res, tag
    want = _rs_ref([_fp8_values(h, h_scales, False)], [_fp8_values(w_down, down_scales, True)], [idx], [wts],
                   pair_of_row, k, 0, m, torch.bfloat16)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2, msg=tag)
    return True


def _routed_cases(cases, fp8_cases=()):
    import torch

    import weft
    from weft.testing.checks import rejects

    for case in cases:
        _routed_case(*case)
    for case in fp8_cases:
        _routed_fp8_case(*case)
    x, wu = torch.randn(4, 32).to(torch.bfloat16), torch.randn(4, 32, 16).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2]])
    guarded = [x, wu, idx]
    rejects(lambda: weft.ops.routed_gemm(x.float(), wu, idx), TypeError, "tokens", guarded)
    rejects(lambda: weft.ops.routed_gemm(x, wu[:, :8].contiguous(), idx), ValueError, "w_experts", guarded)
    inter, layout = weft.ops.routed_gemm(x, wu, idx)
    rejects(lambda: weft.ops.routed_gemm_sum(inter[:-1], wu.transpose(1, 2).contiguous(), idx, torch.rand(4, 2),
                                             layout), ValueError, "h", guarded)
    rejects(lambda: weft.ops.routed_gemm(x, wu, idx, x_scales=torch.ones(4, 1)), ValueError, "fp8", guarded)
    q, sx = weft.ops.fp8_rows(torch.randn(4, 128).to(torch.bfloat16))
    w8, sw = weft.ops.fp8_blocks(torch.randn(4, 128, 16))
    out = torch.full((8, 16), float("nan"), dtype=torch.bfloat16)
    guarded = [q, sx, w8, sw, idx, out]
    rejects(lambda: weft.ops.routed_gemm(q, w8, idx, out, w_scales=sw), ValueError, "x_scales", guarded)
    rejects(lambda: weft.ops.routed_gemm(q, w8, idx, out, x_scales=sx), ValueError, "w_scales", guarded)
    rejects(lambda: weft.ops.routed_gemm(q, w8, idx, out, x_scales=sx[:, :0], w_scales=sw), ValueError, "x_scales",
            guarded)
    rejects(lambda: weft.ops.routed_gemm(q, w8.contiguous(), idx, out, x_scales=sx, w_scales=sw), ValueError,
            "K dimension contiguous", guarded)
    rejects(lambda: weft.ops.routed_gemm(q, w8, idx[:3], out, x_scales=sx, w_scales=sw), ValueError, "topk_idx",
            guarded)
    rejects(lambda: weft.ops.routed_gemm(q, w8, idx, out.float(), x_scales=sx, w_scales=sw), TypeError, "out",
            guarded)
    rejects(lambda: weft.ops.routed_gemm_sum(q, w8, idx, torch.rand(4, 2), x_scales=sx, w_scales=sw), ValueError,
            "h", guarded)
    return True


@pytest.mark.parametrize("w", [1, 2])
def test_routed_gemm_matches_reference(w):
    """Local: each rank its own rows (a different count), no collective; a rank with no rows at 2 ranks."""
    cases = [
        (1, 5, 40, 24, 4, 3, "random"),        # ragged
        (2, 0 if w == 2 else 1, 32, 16, 4, 2, "masked"),  # rank 0 without rows at 2 ranks
        (3, 6, 32, 16, 2, 4, "local", False),  # k = 4 > 2 experts; no layout: made again
    ]
    fp8_cases = [
        (4, 5, 160, 136, 2, 3),         # ragged N of both GEMMs, k = 3 > 2 experts
        (5, 0 if w == 2 else 3, 128, 128, 3, 2, False),  # rank 0 without rows at 2 ranks; no layout
    ]
    assert all(run_ranks(_routed_cases, w, cases, fp8_cases, timeout=TIMEOUT, env=ENV))
