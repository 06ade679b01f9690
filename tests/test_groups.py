"""Groups (weft/runtime/group.py, world.py): new_group, new_subgroups, a torch ProcessGroup as a group, group heaps,
a rank in several groups, members and non-members, and the errors of groups used wrongly."""

from weft.testing import run_ranks


def _layouts_and_heaps():
    import torch
    import torch.distributed as dist

    import weft

    w = weft.world()
    evens = weft.new_group([2, 0])  # asked in reverse: group ranks follow world order, as in torch.distributed
    odds = weft.new_group([3, 1])
    pairs = weft.new_subgroups(2)
    mine = evens or odds
    assert (evens is None) == (w.rank % 2 == 1) and (odds is None) == (w.rank % 2 == 0)
    assert mine.ranks == ((0, 2) if w.rank % 2 == 0 else (1, 3)) and mine.rank == w.rank // 2 and mine.size == 2
    assert pairs.ranks == ((0, 1) if w.rank < 2 else (2, 3)) and pairs.rank == w.rank % 2
    assert weft.get_group(mine.process_group) is mine and weft.get_group(mine.name) is mine
    assert weft.get_group() is w and weft.get_group(dist.group.WORLD) is w

    # Each group's heap is its own: the same offsets among its members, whatever the other groups allocate.
    a = weft.empty((5,), torch.float32, group=mine)
    if w.rank < 2:
        weft.empty((1000,), torch.uint8, group=pairs)  # only the first pair allocates this
    b = weft.zeros((3,), torch.int64, group=pairs)
    a.fill_(w.rank)
    b.fill_(10 * w.rank)
    mine.barrier()
    pairs.barrier()
    assert weft.is_symmetric(a, group=mine) and not weft.is_symmetric(a, group=pairs)
    assert torch.equal(weft.peer(a, 1 - mine.rank, group=mine), torch.full((5,), float(mine.ranks[1 - mine.rank])))
    assert torch.equal(weft.peer(b, 1 - pairs.rank, group=pairs), torch.full((3,), 10 * pairs.ranks[1 - pairs.rank]))
    assert mine.heap.descriptor.tolist()[:2] == [mine.rank, 2]

    # Ops on the two axes interleaved, in an order that is random but the same on every rank; the world between.
    order = torch.randperm(12, generator=torch.Generator().manual_seed(5)).tolist()
    for step in order:
        g = (mine, pairs, None)[step % 3]
        x = torch.randn(3 + step, 2, generator=torch.Generator().manual_seed(100 * w.rank + step))
        gg = weft.get_group(g)
        ref = [torch.empty_like(x) for _ in range(gg.size)]
        dist.all_gather(ref, x, group=gg.process_group)
        assert torch.equal(weft.ops.all_gather(x, group=g), torch.cat(ref)), (step, gg)
        weft.ops.device_barrier(group=g)
    return True


def test_groups_strided_and_consecutive_on_four_ranks():
    assert all(run_ranks(_layouts_and_heaps, 4, timeout=240))


def _leftover_rank():
    import torch

    import weft

    w = weft.world()
    pair = weft.new_group([0, 2])
    alone = weft.new_subgroups(1)
    if pair is None:  # rank 1: unrelated work on its own group while the pair runs
        for i in range(5):
            x = torch.full((4,), float(i))
            assert torch.equal(weft.ops.all_gather(x, group=alone), x)
        return "alone"
    for i in range(5):
        x = torch.full((2,), float(10 * i + w.rank))
        got = weft.ops.all_gather(x, group=pair)
        assert torch.equal(got, torch.tensor([10. * i] * 2 + [10. * i + 2] * 2)), got
    weft.ops.device_barrier(group=pair)
    return "pair"


def test_a_group_of_two_beside_a_rank_doing_other_work():
    assert run_ranks(_leftover_rank, 3, timeout=180) == ["pair", "alone", "pair"]


def _errors():
    import torch
    import torch.distributed as dist

    import weft
    from weft.testing.checks import rejects

    w = weft.world()
    g = weft.new_group([0, 1])
    other = dist.new_group([1, 2])  # rank 0 is not a member
    x = torch.ones(3)
    if w.rank == 0:
        rejects(lambda: weft.ops.all_gather(x, group=other), ValueError, "not a member", [])
    rejects(lambda: weft.ops.all_gather(x, group=42), TypeError, "group must be None, a weft.Group", [])
    rejects(lambda: weft.ops.all_gather(x, group="no-such-group"), ValueError, "no weft group of that name", [])
    rejects(lambda: weft.new_group([0, 5]), ValueError, "5 is not a world rank", [])
    rejects(lambda: weft.new_group([1, 1]), ValueError, "name a rank twice", [])
    rejects(lambda: weft.new_group([]), ValueError, "at least one rank", [])
    rejects(lambda: weft.new_subgroups(2), ValueError, "divisor of the world size 3", [])
    rejects(lambda: weft.new_group([0, 1.0]), TypeError, "ranks must be ints", [])
    # Ranks that ask for different groups: an error on every rank, naming each rank's list.
    mismatched = [0, 1] if w.rank == 0 else [0, 2]
    rejects(lambda: weft.new_group(mismatched), ValueError, "rank 0: [[0, 1]", [])
    # A group of a world that was finalized: made again in the new world, not reused.
    weft.finalize()
    weft.init()
    if g is not None:
        rejects(lambda: weft.ops.all_gather(x, group=g), ValueError, "world that was finalized", [])
    return True


def test_groups_used_wrongly_raise_on_every_rank():
    assert all(run_ranks(_errors, 3, timeout=180))
