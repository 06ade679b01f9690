"""send / recv / isend / irecv / batch_isend_irecv (weft/kernels/p2p.py) on cpu ranks, against torch.distributed's
send / recv over gloo: rings and all-pairs exchanges with odd shapes, strided tensors and messages larger than the
workspace (WEFT_WORKSPACE_BYTES small: many chunks through each slot ring), many back-to-back calls, groups inside
the world, a size mismatch raising on both ranks, the process group's route (forced), bad arguments refused by
cached plans. One rank launch per world size, loops inside."""
import pytest

from weft.testing import run_ranks

# 2 KiB slots per peer pair at 4 ranks: a 1500-element fp32 message is 3 chunks, through a ring of 2.
ENV = {"WEFT_WAIT_TIMEOUT_S": "60", "WEFT_WORKSPACE_BYTES": "16384"}


def _fresh(gen, shape, dtype):
    import torch

    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen, dtype=dtype)


def _check_rings_and_pairs():
    import torch
    import torch.distributed as dist

    import weft
    import weft.ops as ops

    me, w = weft.rank(), weft.world_size()
    gen = torch.Generator().manual_seed(100 + me)
    shapes = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((1500,), torch.float32), ((5, 3, 3), torch.int8),
              ((0, 4), torch.float32)]
    for it in range(3):
        for shape, dtype in shapes:
            # A ring: send to me + 1, receive from me - 1, as a batch (any size); the reference over gloo.
            x = _fresh(gen, shape, dtype)
            if x.dim() > 1 and it % 2:  # strided on odd iterations: the same shape, dimensions reversed in memory
                x = _fresh(gen, shape[::-1], dtype).permute(*reversed(range(len(shape))))
            nxt, prv = (me + 1) % w, (me - 1) % w
            got = torch.full(x.shape, 0x2B, dtype=dtype) if not dtype.is_floating_point else \
                torch.full(x.shape, float("nan"), dtype=dtype)
            if it == 2 and got.dim() > 1:
                got = torch.empty(tuple(reversed(x.shape)), dtype=dtype).fill_(7).permute(*reversed(range(x.dim())))
            works = ops.batch_isend_irecv([ops.P2POp(ops.isend, x, nxt), ops.P2POp(ops.irecv, got, prv)])
            for work in works:
                work.wait()
            want = torch.empty_like(x.contiguous())
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), nxt),
                                           dist.P2POp(dist.irecv, want, prv)])
            for r in reqs:
                r.wait()
            assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got, want.view(torch.uint8)
                               if want.dtype.itemsize == 1 else want), (it, shape, dtype)
    # All pairs, blocking calls: lower rank sends first, so each pair's order is fixed; many back-to-back messages
    # between each pair, several sizes, each matched in order.
    for it in range(2):
        sent, got, back = {}, {}, {}
        for q in range(w):  # pairs in (lower, higher) order on every rank: no cycle of blocking calls
            if q == me:
                continue
            sent[q] = [_fresh(gen, (n,), torch.float32) for n in (1, 33, 600)]
            got[q] = [torch.full_like(m, float("nan")) for m in sent[q]]
            back[q] = [torch.empty_like(m) for m in sent[q]]
            for m, g, b in zip(sent[q], got[q], back[q]):
                if me < q:
                    ops.send(m, q)
                    ops.recv(g, q)
                    dist.send(m, q)  # torch's own send/recv of the same messages: the reference
                    dist.recv(b, q)
                else:
                    ops.recv(g, q)
                    ops.send(m, q)
                    dist.recv(b, q)
                    dist.send(m, q)
        every = [None] * w
        dist.all_gather_object(every, sent)
        for q in got:
            for g, b, want in zip(got[q], back[q], every[q][me]):
                assert torch.equal(g, want) and torch.equal(g, b), (it, q)
    # An all-to-all of large messages as one batch from every rank (sends and receives progress together).
    xs = [_fresh(gen, (2000 + 7 * me,), torch.float32) for _ in range(w)]
    got = {q: torch.empty(2000 + 7 * q) for q in range(w) if q != me}
    batch = [ops.P2POp(ops.irecv, got[q], q) for q in got] + [ops.P2POp(ops.isend, xs[q], q) for q in got]
    for work in ops.batch_isend_irecv(batch):
        work.wait()
    every = [None] * w
    dist.all_gather_object(every, xs)
    for q in got:
        assert torch.equal(got[q], every[q][me])
    # torch.distributed.P2POp entries (world ranks) are taken as they are, isend / irecv handles wait.
    nxt, prv = (me + 1) % w, (me - 1) % w
    x, y = _fresh(gen, (9,), torch.float32), torch.empty(9)
    for work in ops.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)]):
        work.wait()
    every = [None] * w
    dist.all_gather_object(every, x)
    assert torch.equal(y, every[prv])
    return True


def _check_groups_and_mismatch():
    import torch
    import torch.distributed as dist

    import weft
    import weft.ops as ops
    from weft.testing.groups import layouts

    me, w = weft.rank(), weft.world_size()
    gen = torch.Generator().manual_seed(7 + me)
    found = layouts()
    for name in ("strided", "pairs", "process_group"):
        g = weft.runtime.world.resolve(found[name])
        peer = 1 - g.rank
        x = _fresh(gen, (3, 1001), torch.float32)
        got = torch.full((3, 1001), float("nan"))
        if g.rank == 0:
            ops.send(x, peer, group=found[name])
            ops.recv(got, peer, group=found[name])
        else:
            ops.recv(got, peer, group=found[name])
            ops.send(x, peer, group=found[name])
        want = torch.empty_like(x)
        pg = g.process_group
        if g.rank == 0:
            dist.send(x, dist.get_global_rank(pg, peer), group=pg)
            dist.recv(want, dist.get_global_rank(pg, peer), group=pg)
        else:
            dist.recv(want, dist.get_global_rank(pg, peer), group=pg)
            dist.send(x, dist.get_global_rank(pg, peer), group=pg)
        assert torch.equal(got, want), name
    # A rank cannot send to itself or outside its group: named errors, before anything moves.
    with pytest.raises(ValueError, match="is this rank"):
        ops.send(torch.ones(3), me)
    with pytest.raises(ValueError, match="not a rank of the group"):
        ops.send(torch.ones(3), w)
    # A size mismatch: the receiver raises in its call, the tensor untouched; the sender raises at
    # weft.check_errors() (after the receiver reported it); the pair then works again.
    pairs = found["pairs"]
    peer = 1 - pairs.rank
    if pairs.rank == 0:
        ops.send(torch.arange(10.0), peer, group=pairs)
    else:
        y = torch.full((12,), -1.0)
        with pytest.raises(ValueError, match="sent a message of 40 bytes.*48 bytes"):
            ops.recv(y, peer, group=pairs)
        assert torch.equal(y, torch.full((12,), -1.0))
    dist.barrier()
    if pairs.rank == 0:
        with pytest.raises(ValueError, match="received a message of this rank into a tensor of 48 bytes"):
            weft.check_errors()
    weft.check_errors()  # cleared
    z = torch.empty(5)
    if pairs.rank == 0:
        ops.send(torch.arange(5.0) + me, peer, group=pairs)
    else:
        ops.recv(z, peer, group=pairs)
        assert torch.equal(z, torch.arange(5.0) + pairs.ranks[0])
    return True


def _check_leftover_rank():
    """3 ranks: a pair exchanges while the third runs its own group-of-one work; no op waits on a non-member."""
    import torch

    import weft
    import weft.ops as ops

    me = weft.rank()
    pair = weft.new_group([0, 1])
    one = weft.new_subgroups(1)
    for it in range(4):
        if pair is not None:
            x = torch.randn(777, generator=torch.Generator().manual_seed(it * 10 + me))
            y = torch.empty(777)
            peer = 1 - pair.rank
            for work in ops.batch_isend_irecv([ops.P2POp(ops.isend, x, peer, pair),
                                               ops.P2POp(ops.irecv, y, peer, pair)]):
                work.wait()
            assert torch.equal(y, torch.randn(777, generator=torch.Generator().manual_seed(it * 10 + 1 - me)))
        else:
            t = torch.randn(5)
            assert torch.equal(ops.all_gather(t, group=one), t)
    return True


def _check_programs():
    """WEFT_P2P_PROGRAMS=3 (PROGRAMS_ENV): every message of more than 256 bytes spreads over 3 programs, each part
    in several chunks through its own ring of 2 slots; odd sizes and layouts, back-to-back calls, batch rings, and
    size mismatches both ways (the sender's parts spread, the receiver's not, and the reverse)."""
    import torch
    import torch.distributed as dist

    import weft
    import weft.ops as ops
    from weft.kernels import p2p

    me, w = weft.rank(), weft.world_size()
    ws = p2p._workspace(weft.runtime.world.resolve(None))
    assert ws.programs == 3
    big = 3 * 3 * ws.slot_bytes // 4 + 5  # fp32 elements: each of the 3 parts is 3 slots and more
    assert all(p2p.part_chunks(big * 4, pid, ws) >= 3 for pid in range(3))
    gen = torch.Generator().manual_seed(300 + me)
    nxt, prv = (me + 1) % w, (me - 1) % w

    def gathered(x):
        every = [None] * w
        dist.all_gather_object(every, x)
        return every

    # Batch rings: odd sizes, byte-sized words, strided tensors on both ends.
    cases = [((1,), torch.float32), ((67,), torch.int8), ((3, 1001), torch.float32), ((2, 777), torch.bfloat16),
             ((0,), torch.float32), ((big,), torch.float32), ((5, 3, 131), torch.int16)]
    for it in range(2):
        for shape, dtype in cases:
            x = _fresh(gen, shape, dtype)
            if x.dim() > 1 and it:
                x = _fresh(gen, shape[::-1], dtype).permute(*reversed(range(len(shape))))
            got = torch.zeros(tuple(reversed(shape)), dtype=dtype).permute(*reversed(range(len(shape)))) if it \
                else torch.zeros(shape, dtype=dtype)
            for work in ops.batch_isend_irecv([ops.P2POp(ops.irecv, got, prv), ops.P2POp(ops.isend, x, nxt)]):
                work.wait()
            assert torch.equal(got, gathered(x)[prv]), (it, shape, dtype)
    # Back-to-back blocking calls along the ring, each rank sending all its messages before receiving any: each
    # send returns once its chunks sit in the receiver's slots, which the receiver frees as it takes them; rank 0
    # receives first, so the ring is not a cycle.
    sizes = [1, 257, 4099, 5, big, 70, 3 * 256 + 1, 2 * big + 3, 11, 999]
    msgs = [_fresh(gen, (n,), torch.float32) for n in sizes]
    outs = [torch.full((n,), float("nan")) for n in sizes]
    if me == 0:
        for o in outs:
            ops.recv(o, prv)
    for m in msgs:
        ops.send(m, nxt)
    if me != 0:
        for o in outs:
            ops.recv(o, prv)
    for o, want in zip(outs, gathered(msgs)[prv]):
        assert torch.equal(o, want)
    # Mismatches between ranks 0 and 1: the sender's message spread over the programs, the receiver's tensor
    # small (its part 0 alone), then the reverse; the receiver raises, its tensor untouched, the sender at
    # weft.check_errors(); each time the pair works again.
    for sent_n, want_n in ((big, 10), (10, big)):
        if me == 0:
            ops.send(torch.arange(float(sent_n)), 1)
        elif me == 1:
            y = torch.full((want_n,), -1.0)
            with pytest.raises(ValueError, match=f"sent a message of {4 * sent_n} bytes.*{4 * want_n} bytes"):
                ops.recv(y, 0)
            assert torch.equal(y, torch.full((want_n,), -1.0))
        dist.barrier()
        if me == 0:
            with pytest.raises(ValueError, match=f"into a tensor of {4 * want_n} bytes"):
                weft.check_errors()
        weft.check_errors()
        z = torch.empty(big)
        if me == 0:
            ops.send(torch.arange(float(big)) * 3, 1)
        elif me == 1:
            ops.recv(z, 0)
            assert torch.equal(z, torch.arange(float(big)) * 3)
    return True


def _check_process_group_route_and_cached_checks():
    """The process group's route (forced_route(kernel=False): gloo here, NCCL on GPUs) for blocking, handle and
    batch calls, strided tensors included; and the checks a call whose plan is cached still gets (a peer that is
    not an int, a receive tensor twice in a batch), before anything moves."""
    import torch
    import torch.distributed as dist

    import weft
    import weft.ops as ops
    from weft.kernels.p2p import forced_route

    me, w = weft.rank(), weft.world_size()
    gen = torch.Generator().manual_seed(500 + me)
    nxt, prv = (me + 1) % w, (me - 1) % w

    def gathered(x):
        every = [None] * w
        dist.all_gather_object(every, x)
        return every

    with forced_route(kernel=False):
        for it in range(2):
            x = _fresh(gen, (3, 1001), torch.float32)
            if it:  # strided on both ends
                x = _fresh(gen, (1001, 3), torch.float32).t()
            got = torch.full((1001, 3), float("nan")).t() if it else torch.full((3, 1001), float("nan"))
            for work in ops.batch_isend_irecv([ops.P2POp(ops.isend, x, nxt), ops.P2POp(ops.irecv, got, prv)]):
                work.wait()
            assert torch.equal(got, gathered(x)[prv]), it
        # Blocking calls and handles between the pairs (0, 1), (2, 3): the lower rank sends first.
        peer = me ^ 1
        x, y = _fresh(gen, (257,), torch.bfloat16), torch.empty(257, dtype=torch.bfloat16)
        z = torch.empty(257, dtype=torch.bfloat16)
        if me % 2 == 0:
            ops.send(x, peer)
            ops.irecv(y, peer).wait()
        else:
            ops.recv(y, peer)
            ops.isend(x, peer).wait()
        ops.send(x, peer) if me % 2 == 0 else ops.recv(z, peer)
        assert torch.equal(y, gathered(x)[peer])
        if me % 2:
            assert torch.equal(z, y)
    # Cached plans: a peer 1.0 or True finds the plan of peer 1 (equal keys), and is still refused by type; a batch
    # that names a receive tensor twice finds the plan of one with two distinct ones, and is still refused.
    a, b = _fresh(gen, (64,), torch.float32), _fresh(gen, (64,), torch.float32)
    g1, g2 = torch.empty(64), torch.empty(64)
    batch = [ops.P2POp(ops.isend, a, nxt), ops.P2POp(ops.isend, b, nxt), ops.P2POp(ops.irecv, g1, prv),
             ops.P2POp(ops.irecv, g2, prv)]
    for work in ops.batch_isend_irecv(batch):
        work.wait()
    sent = gathered((a, b))[prv]
    assert torch.equal(g1, sent[0]) and torch.equal(g2, sent[1])
    with pytest.raises(ValueError, match="received again"):
        ops.batch_isend_irecv(batch[:3] + [ops.P2POp(ops.irecv, g1, prv)])
    for bad in [float(nxt)] + ([True] if nxt == 1 else []):
        with pytest.raises(TypeError, match="the peer must be an int"):
            ops.batch_isend_irecv([ops.P2POp(ops.isend, a, bad), ops.P2POp(ops.isend, b, nxt),
                                   ops.P2POp(ops.irecv, g1, prv), ops.P2POp(ops.irecv, g2, prv)])
    return True


def _check_all():
    return _check_rings_and_pairs() and _check_groups_and_mismatch() and \
        _check_process_group_route_and_cached_checks()


def test_send_recv_against_torch():
    """4 ranks (groups of 2 inside them too)."""
    assert run_ranks(_check_all, 4, timeout=300, env=ENV) == [True] * 4


def test_pair_beside_a_leftover_rank():
    assert run_ranks(_check_leftover_rank, 3, timeout=300, env=ENV) == [True] * 3


# 3 programs; a 64 KiB workspace: ~4 KiB slots per program and pair at 3 ranks.
PROGRAMS_ENV = dict(ENV, WEFT_P2P_PROGRAMS="3", WEFT_WORKSPACE_BYTES="65536")


def test_programs_streams():
    assert run_ranks(_check_programs, 3, timeout=300, env=PROGRAMS_ENV) == [True] * 3
