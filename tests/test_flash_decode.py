"""flash_decode and sp_flash_decode on the cpu backend (interpreter), against a float64 softmax reference.

Caches hold NaN wherever a kernel must not read (positions past a sequence's length, pages no sequence
uses), block tables hold out-of-range page numbers past a sequence's pages, and every torch.empty of
the op (its outputs and its partials' workspace) is filled with NaN: a result that is right was computed
from what it should be, and every element was written.
"""
import hashlib
import math
import re

import pytest
import torch

from weft.kernels import flash_decode as fd
from weft.testing import run_ranks
from weft.testing.checks import nan_allocations, rejects

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}  # a lost LL word fails with a message instead of hanging
TIMEOUT = 150
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # (q_heads, kv_heads)


# -- helpers ------------------------------------------------------------------------------

def reference(q, k, v, lens, scale=None):
    """float64 (out, lse) of softmax attention: q (B, H, D), contiguous k, v (B, L, KVH, D)."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((batch, q_heads), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        if n:
            kk = k[b, :n].double().repeat_interleave(group, dim=1)
            vv = v[b, :n].double().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,nhd->hn", q[b].double(), kk) * scale
            lse[b] = torch.logsumexp(s, -1)
            out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv)
    return out, lse


def make_inputs(seed, lens, max_len, q_heads, kv_heads, head_dim=64, dtype=torch.float32):
    """q and a contiguous cache whose positions past each length hold NaN."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, max_len, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, max_len, kv_heads, head_dim, generator=g).to(dtype)
    for b, n in enumerate(lens):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


def paged(k, v, page_size, seed):
    """(k_pages, v_pages, block_table) holding the contiguous cache k, v in shuffled pages, with one spare
    NaN page; table entries past a sequence's last position name a page that does not exist."""
    batch, max_len, kv_heads, head_dim = k.shape
    per_seq = math.ceil(max_len / page_size)
    num_pages = batch * per_seq + 1
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = order[:batch * per_seq].view(batch, per_seq).to(torch.int32).contiguous()
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages = torch.full(shape, float("nan"), dtype=k.dtype)
    v_pages = torch.full(shape, float("nan"), dtype=v.dtype)
    for b in range(batch):
        for j in range(per_seq):
            rows = slice(j * page_size, min((j + 1) * page_size, max_len))
            n = rows.stop - rows.start
            k_pages[table[b, j], :n] = k[b, rows]
            v_pages[table[b, j], :n] = v[b, rows]
            if k[b, rows.start:rows.stop, 0, 0].isnan().all():
                table[b, j] = 1 << 30  # past the sequence: never looked up
    return k_pages, v_pages, table


def check(q, k, v, lens, got_out, got_lse=None, scale=None):
    ref_out, ref_lse = reference(q, k, v, lens, scale)
    assert got_out.shape == q.shape and got_out.dtype == q.dtype
    torch.testing.assert_close(got_out.double(), ref_out, **TOL[q.dtype])
    if got_lse is not None:
        assert got_lse.shape == q.shape[:2] and got_lse.dtype == torch.float32
        torch.testing.assert_close(got_lse.double(), ref_lse, **TOL[torch.float32])


# -- flash_decode -------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "paged 1", "paged 16"])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_flash_decode_matches_reference(heads, layout):
    q_heads, kv_heads = HEADS[heads]
    lens = [37, 1, 0, 5]  # ragged, none a multiple of the split length or the page size
    q, k, v, seqlens = make_inputs(len(layout) + kv_heads, lens, 40, q_heads, kv_heads)
    with nan_allocations():
        if layout == "contiguous":
            out, lse = fd.flash_decode(q, k, v, seqlens, return_lse=True)
        else:
            k_pages, v_pages, table = paged(k, v, int(layout.split()[1]), seed=kv_heads)
            out, lse = fd.flash_decode(q, k_pages, v_pages, seqlens, block_table=table, return_lse=True)
    check(q, k, v, seqlens, out, lse)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()  # length 0


def test_flash_decode_several_blocks_per_split_and_scale():
    lens = [130, 129, 64, 2]  # 3 splits of up to 3 blocks of 16 positions: full, partial and empty splits
    q, k, v, seqlens = make_inputs(3, lens, 130, 8, 2)
    with nan_allocations():
        out, lse = fd.flash_decode(q, k, v, seqlens, scale=0.3, return_lse=True)
        k_pages, v_pages, table = paged(k, v, 16, seed=4)
        out_paged = fd.flash_decode(q, k_pages, v_pages, seqlens, block_table=table, scale=0.3)
    check(q, k, v, seqlens, out, lse, scale=0.3)
    assert torch.equal(out_paged, out)  # the same blocks in the same order: the same bits


def test_flash_decode_ranges_follow_each_sequence_length():
    """Splits are planned for the cache's length, ranges for each sequence's own: a sequence of 3 blocks in a
    cache of 10 fills all 3 splits (a block each), not the first split's 4 blocks; an empty one fills none."""
    block = fd.CPU_BLOCK_N
    lens = [3 * block - 5, 10 * block, 0]
    q, k, v, seqlens = make_inputs(12, lens, 10 * block, 4, 2)
    plan = fd.FlashDecodePlan(None, q, k, v, seqlens, None, None, False)
    assert (plan.splits, plan.split_unit) == (3, block)
    part_out = torch.full((3 * 4, plan.splits, 64), float("nan"))
    part_lse = torch.full((3 * 4, plan.splits), float("nan"))
    plan.split(*plan.split_args(q, k, v, seqlens, seqlens, part_out, part_lse))
    written = ~part_lse.isnan().view(3, 4, plan.splits)
    assert written[0].all() and written[1].all() and not written[2].any()
    check(q, k, v, seqlens, fd.flash_decode(q, k, v, seqlens))


@pytest.mark.parametrize("layout", ["contiguous", "paged 4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_decode_one_split_writes_the_result(dtype, layout):
    """A cache of one block of keys gives one split, whose programs write out and lse themselves (no merge
    launch): the reference's values, 0 and -inf for an empty sequence, the same out with and without lse."""
    lens = [13, 0, 16, 1]
    q, k, v, seqlens = make_inputs(11, lens, fd.CPU_BLOCK_N, 8, 2, dtype=dtype)
    cache = (k, v, None)
    if layout != "contiguous":
        cache = paged(k, v, int(layout.split()[1]), seed=11)
    one = fd.FlashDecodePlan(None, q, *cache[:2], seqlens, cache[2], None, True)
    assert one.splits == 1 and one.run.__func__ is fd.FlashDecodePlan.run_direct
    with nan_allocations():
        out, lse = fd.flash_decode(q, *cache[:2], seqlens, block_table=cache[2], return_lse=True)
        out_only = fd.flash_decode(q, *cache[:2], seqlens, block_table=cache[2])
    check(q, k, v, seqlens, out, lse)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()  # length 0
    assert torch.equal(out_only, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_decode_16_bit(dtype):
    q, k, v, seqlens = make_inputs(5, [20, 3], 24, 8, 2, dtype=dtype)
    k_pages, v_pages, table = paged(k, v, 16, seed=5)
    with nan_allocations():
        out, lse = fd.flash_decode(q, k_pages, v_pages, seqlens, block_table=table, return_lse=True)
    check(q, k, v, seqlens, out, lse)


def test_flash_decode_head_dim_128_and_strided_q():
    q, k, v, seqlens = make_inputs(6, [17, 33], 33, 4, 2, head_dim=128)
    q_wide = torch.full((2, 8, 128), float("nan"))
    q_wide[:, ::2] = q  # q with a head stride of 2 * head_dim
    out = fd.flash_decode(q_wide[:, ::2], k, v, seqlens)
    check(q, k, v, seqlens, out)


def test_flash_decode_bad_inputs_rejected():
    q, k, v, seqlens = make_inputs(7, [3, 4], 8, 4, 2)
    k_pages, v_pages, table = paged(k, v, 4, seed=7)
    g = [q, k, v, seqlens, k_pages, v_pages, table]
    f = fd.flash_decode
    rejects(lambda: f(q.numpy(), k, v, seqlens), TypeError, "q", g)
    rejects(lambda: f(q.to(torch.int32), k, v, seqlens), TypeError, "q", g)
    rejects(lambda: f(q[0], k, v, seqlens), ValueError, "q", g)
    rejects(lambda: f(q[..., :48], k[..., :48], v[..., :48], seqlens), ValueError, "q", g)  # head_dim 48
    rejects(lambda: f(q[:, :3], k, v, seqlens), ValueError, "q", g)  # 3 heads over 2 KV heads
    rejects(lambda: f(q, k.to(torch.float16), v, seqlens), TypeError, "k_cache", g)
    rejects(lambda: f(q, k[0], v, seqlens), ValueError, "k_cache", g)
    rejects(lambda: f(q, k[:1], v[:1], seqlens), ValueError, "k_cache", g)  # 1 sequence, batch 2
    rejects(lambda: f(q, k.transpose(1, 3).contiguous().transpose(1, 3), v, seqlens), ValueError, "k_cache", g)
    rejects(lambda: f(q, k, v[:, :4], seqlens), ValueError, "v_cache", g)
    rejects(lambda: f(q, k, v.double(), seqlens), TypeError, "v_cache", g)
    rejects(lambda: f(q, k, v, seqlens.long()), TypeError, "seqlens", g)
    rejects(lambda: f(q, k, v, seqlens[:1]), ValueError, "seqlens", g)
    rejects(lambda: f(q, k, v, [3, 4]), TypeError, "seqlens", g)
    rejects(lambda: f(q, k_pages, v_pages, seqlens, block_table=table.long()), TypeError, "block_table", g)
    rejects(lambda: f(q, k_pages, v_pages, seqlens, block_table=table[:1]), ValueError, "block_table", g)
    big = torch.zeros(1, 257, 2, 64)
    rejects(lambda: f(q, big, big, seqlens, block_table=table), ValueError, "k_cache", g)  # page size 257
    rejects(lambda: f(q, k, v, seqlens, scale="0.1"), TypeError, "scale", g)
    rejects(lambda: f(q, k, v, seqlens, scale=True), TypeError, "scale", g)
    rejects(lambda: f(q, k, v, seqlens, scale=float("nan")), ValueError, "scale", g)


def test_flash_decode_empty_batch():
    q, k, v, seqlens = make_inputs(8, [], 8, 4, 2)
    out, lse = fd.flash_decode(q, k, v, seqlens, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def _planned_calls():
    """Under weft.init() calls are planned per signature: a second round replays the plans (the lengths,
    strides and layouts of round one), and the bad inputs are still rejected by a call whose plan for the
    good inputs exists."""
    import weft

    for _ in range(2):
        for heads in ("gqa", "mqa"):
            test_flash_decode_matches_reference(heads, "paged 16")
        test_flash_decode_several_blocks_per_split_and_scale()
        test_flash_decode_head_dim_128_and_strided_q()
        test_flash_decode_bad_inputs_rejected()
    assert any(k[0] == "flash_decode" for k in weft.world().plans)
    _bad_pages_raise(weft.check_errors)


def test_flash_decode_planned_calls():
    run_ranks(_planned_calls, 1, timeout=TIMEOUT, env=ENV)


def _bad_pages_raise(check_errors=None):
    """Pages outside [0, num_pages) (far past the cache: 10**6 read to a crash before) and lengths past the
    block table's pages are found on the device: never read, raised by check_errors() (when given: the world's)
    and by the next call, which then works; a page past a sequence's length is not looked up."""
    q, k, v, seqlens = make_inputs(11, [9, 30, 4], 32, 4, 2)
    k_pages, v_pages, table = paged(k, v, 8, seed=11)  # 13 pages; row 1 uses all 4 of its entries
    num_pages = k_pages.shape[0]
    cases = ((1, 3, 10 ** 6), (0, 1, -1), (2, 0, num_pages)) if check_errors else ((1, 3, 10 ** 6),)
    for row, col, page in cases:
        bad = table.clone()
        bad[row, col] = page
        fd.flash_decode(q, k_pages, v_pages, seqlens, block_table=bad)  # recorded, not raised yet
        word = re.escape(f"flash_decode: block_table row {row} names page {page}, outside [0, num_pages = {num_pages})")
        with pytest.raises(ValueError, match=word):
            if check_errors is not None and page < 0:
                check_errors()
            else:  # the next call raises, before it launches anything
                fd.flash_decode(q, k_pages, v_pages, seqlens, block_table=table)
    long = seqlens.clone()
    long[1] = 33  # past the block table's 4 pages of 8 (all of them real pages)
    fd.flash_decode(q, k_pages, v_pages, long, block_table=table)
    with pytest.raises(ValueError, match=re.escape("flash_decode: seqlens[1] = 33 is outside [0, 32]")):
        fd.flash_decode(q, k_pages, v_pages, seqlens, block_table=table)
    check(q, k, v, seqlens, fd.flash_decode(q, k_pages, v_pages, seqlens, block_table=table))
    if check_errors is not None:
        check_errors()  # nothing left


def test_flash_decode_bad_pages_raise_without_init():
    _bad_pages_raise()


# -- sp_flash_decode ---------------------------------------------------------------------

def _sp_calls(cases):
    """cases: (seed, per-rank lengths [rank][batch], q_heads, kv_heads, head_dim, dtype name, page size or
    0). Each rank makes its shard and checks sp_flash_decode against the reference over the concatenated
    KV; calls follow each other with no host barrier, a different rank late each time. Returns digests."""
    import time

    import weft

    me, w = weft.rank(), weft.world_size()
    digests = []
    for call, (seed, lens, q_heads, kv_heads, head_dim, dtype_name, page_size) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        shard_len = max(1, max(max(r) for r in lens))
        shards = [make_inputs(seed * 10 + r, lens[r], shard_len, q_heads, kv_heads, head_dim, dtype)
                  for r in range(w)]
        q = shards[0][0]  # the same query everywhere
        batch = len(lens[0])
        total = [sum(lens[r][b] for r in range(w)) for b in range(batch)]
        full_k = torch.zeros(batch, max(1, max(total)), kv_heads, head_dim, dtype=dtype)
        full_v = torch.zeros_like(full_k)
        for b in range(batch):
            pos = 0
            for r in range(w):
                n = lens[r][b]
                full_k[b, pos:pos + n] = shards[r][1][b, :n]
                full_v[b, pos:pos + n] = shards[r][2][b, :n]
                pos += n
        _, k, v, seqlens = shards[me]
        if w > 1 and call % w == me:
            time.sleep(0.05)
        with nan_allocations():
            if page_size:
                k_pages, v_pages, table = paged(k, v, page_size, seed)
                out = fd.sp_flash_decode(q, k_pages, v_pages, seqlens, block_table=table)
            else:
                out = fd.sp_flash_decode(q, k, v, seqlens)
        check(q, full_k, full_v, torch.tensor(total, dtype=torch.int32), out)
        digests.append(hashlib.sha1(out.view(torch.uint8).numpy().tobytes()).hexdigest())
    return digests


def _lens(w, batch, seed, empty_rank=None, hi=40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, hi, (w, batch), generator=g)
    if empty_rank is not None:
        lens[empty_rank] = 0
    return lens.tolist()


@pytest.mark.parametrize("w", [2])  # 1, 3 and 4 ranks: the group tests below (layout "one", the world)
def test_sp_flash_decode_matches_reference(w):
    """Changing lengths call after call, a rank with an empty slice, a sequence empty everywhere."""
    cases = [
        (1, _lens(w, 3, 1), 8, 2, 64, "float32", 0),
        (2, _lens(w, 3, 2, empty_rank=w - 1), 4, 1, 64, "float32", 16),
        (3, [[0] + row[1:] for row in _lens(w, 2, 3)], 4, 4, 64, "float32", 0),
    ]
    if w == 2:
        cases += [(4, _lens(w, 2, 4, hi=20), 4, 2, 128, "bfloat16", 1), (5, _lens(w, 1, 5), 8, 2, 64, "float32", 0)]
    results = run_ranks(_sp_calls, w, cases, timeout=TIMEOUT, env=ENV)
    assert all(r == results[0] for r in results), "ranks got different bits"


def _sp_in_passes(cases):
    fd.SP_MAX_ENTRIES = 3 * 4 * 65  # this rank's exchange carries 3 sequences of 4 heads: batch 7 takes 3 passes
    return _sp_calls(cases)


def test_sp_flash_decode_in_passes():
    """A batch larger than the exchange buffer goes through in passes of sequences, contiguous and paged."""
    cases = [(6, _lens(2, 7, 6), 4, 2, 64, "float32", 0), (7, _lens(2, 7, 7), 4, 2, 64, "float32", 16),
             (8, _lens(2, 2, 8), 4, 2, 64, "float32", 0)]
    results = run_ranks(_sp_in_passes, 2, cases, timeout=TIMEOUT, env=ENV)
    assert results[0] == results[1], "ranks got different bits"


def _sp_bad_inputs():
    import weft

    world = weft.world()
    q, k, v, seqlens = make_inputs(9, [3, 4], 8, 4, 2)
    used = world.heap.used
    g = [q, k, v, seqlens]
    rejects(lambda: fd.sp_flash_decode(q, k, v, seqlens.long()), TypeError, "seqlens", g)
    rejects(lambda: fd.sp_flash_decode("q", k, v, seqlens), TypeError, "q", g)
    assert world.heap.used == used and "sp_flash_decode" not in world.contexts
    check(q, k, v, seqlens, fd.sp_flash_decode(q, k, v, seqlens))


def test_sp_flash_decode_bad_inputs_rejected():
    run_ranks(_sp_bad_inputs, 1, timeout=TIMEOUT, env=ENV)


def _sp_alternating_grids(cases):
    """sp_flash_decode calls whose merge grids differ (min(rows, 3) programs on the cpu backend), then the
    merge kernel alone, replayed on ready partials with its output poisoned each time."""
    import weft

    digests = _sp_calls(cases)
    seed, lens, q_heads, kv_heads, head_dim, dtype_name, _ = cases[-1]
    me, w = weft.rank(), weft.world_size()
    shards = [make_inputs(seed * 10 + r, lens[r], max(max(r) for r in lens), q_heads, kv_heads, head_dim)
              for r in range(w)]
    q, k, v, seqlens = shards[me]
    merge, out = fd.sp_flash_decode_merge_only(q, k, v, seqlens)
    want = fd.sp_flash_decode(q, k, v, seqlens)
    for _ in range(2):
        out.fill_(float("nan"))
        merge()
        assert torch.equal(out, want)
    return digests


@pytest.mark.parametrize("w", [3])  # 2 ranks: test_sp_flash_decode_matches_reference and _in_passes
def test_sp_flash_decode_alternating_grids(w):
    """Calls of 1, 8 and 2 rows (merge grids of 1, 3 and 2 programs) in turn, lengths changing every call:
    the epoch counter must hold whatever the grid of each call."""
    cases = [(10 + i, _lens(w, batch, 10 + i, hi=12), q_heads, q_heads, 64, "float32", 0)
             for i, (batch, q_heads) in enumerate([(1, 1), (2, 4), (1, 2), (1, 1), (4, 2), (2, 1)])]
    results = run_ranks(_sp_alternating_grids, w, cases, timeout=TIMEOUT, env=ENV)
    assert all(r == results[0] for r in results), "ranks got different bits"


# -- groups ---------------------------------------------------------------------------------

def _sp_group_call(group, seed, what):
    """One sp_flash_decode over `group` (a weft Group, a torch ProcessGroup or None) on fresh inputs: this rank's
    shard of a batch of 3 (3 query heads on one KV head, lengths 0 to 19, paged on odd seeds), the query made the same on every member
    and the reference computed from the shards gathered over the group's process group; the output poisoned,
    the same bits on every member."""
    import torch.distributed as dist

    import weft
    from weft.runtime.world import resolve

    g = resolve(group)
    gen = torch.Generator().manual_seed(seed * 16 + weft.rank())
    lens = torch.randint(0, 20, (3,), generator=gen).tolist()
    q, k, v, seqlens = make_inputs(seed * 16 + weft.rank(), lens, 20, 3, 1)
    pg = g.process_group
    dist.broadcast(q, src=g.ranks[0], group=pg)
    ks, vs, ls = ([torch.empty_like(t) for _ in range(g.size)] for t in (k, v, seqlens))
    for parts, t in ((ks, k), (vs, v), (ls, seqlens)):
        dist.all_gather(parts, t, group=pg)
    total = torch.stack(ls).sum(0)
    full_k = torch.zeros(3, max(1, int(total.max())), 1, 64)
    full_v = torch.zeros_like(full_k)
    for b in range(3):
        pos = 0
        for r in range(g.size):
            n = int(ls[r][b])
            full_k[b, pos:pos + n], full_v[b, pos:pos + n] = ks[r][b, :n], vs[r][b, :n]
            pos += n
    with nan_allocations():
        if seed % 2:
            k_pages, v_pages, table = paged(k, v, 16, seed)
            out = fd.sp_flash_decode(q, k_pages, v_pages, seqlens, block_table=table, group=group)
        else:
            out = fd.sp_flash_decode(q, k, v, seqlens, group=group)
    try:
        check(q, full_k, full_v, total.to(torch.int32), out)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None
    outs = [torch.empty_like(out) for _ in range(g.size)]
    dist.all_gather(outs, out, group=pg)
    assert all(torch.equal(o, out) for o in outs), f"{what}: members got different bits"


def test_sp_flash_decode_on_group_layouts():
    """4 ranks: every layout (strided, pairs, one, a torch ProcessGroup, the world), calls interleaved."""
    from weft.testing.groups import on_every_layout

    run_ranks(on_every_layout, 4, _sp_group_call, 2, timeout=TIMEOUT, env=ENV)


def _sp_leftover_rank():
    """3 ranks: group [0, 2] runs sp_flash_decode (eager, a bad page on rank 2 that its next call raises while
    rank 0 goes on, and compiled with group=) while rank 1 runs its own group of one: no call waits on a
    non-member."""
    import weft

    pair = weft.new_group([2, 0])
    one = weft.new_subgroups(1)
    if pair is None:
        for it in range(2):
            _sp_group_call(one, 40 + it, f"rank 1's own group, call {it}")
        return
    _sp_group_call(pair, 30, "pair, call 0")
    q, k, v, seqlens = make_inputs(31, [5, 7], 8, 4, 2)
    k_pages, v_pages, table = paged(k, v, 4, seed=31)
    bad = table.clone()
    if weft.rank() == 2:
        bad[1, 1] = 10 ** 6
    fd.sp_flash_decode(q, k_pages, v_pages, seqlens, block_table=bad, group=pair)
    if weft.rank() == 2:
        with pytest.raises(ValueError, match="sp_flash_decode: block_table row 1 names page 1000000"):
            fd.sp_flash_decode(q, k_pages, v_pages, seqlens, block_table=table, group=pair)
    else:
        fd.sp_flash_decode(q, k_pages, v_pages, seqlens, block_table=table, group=pair)
    compiled = torch.compile(lambda *a: weft.ops.sp_flash_decode(*a, group=pair), fullgraph=True)
    want = fd.sp_flash_decode(q, k, v, seqlens, group=pair)
    assert torch.equal(compiled(q, k, v, seqlens), want)


def test_sp_flash_decode_group_with_leftover_rank():
    run_ranks(_sp_leftover_rank, 3, timeout=TIMEOUT, env=ENV)
