"""Tile-centric primitives (weft.language.tile, with the host half weft.runtime.tiles) on the cpu backend: the
map's arithmetic against brute force, its device functions under the interpreter, producer/consumer kernels at
2, 3 and 4 ranks, a delayed producer, the same for the dense form (ShardMapping), and the sm_90 compile of every
primitive."""
import os
import random
import subprocess
import sys

import pytest
import torch

from weft.runtime.errors import WaitTimeout
from weft.runtime.tiles import TileMap, copy_engine_push
from weft.testing import run_ranks


def random_layout(rng: random.Random) -> dict:
    """A random sharded layout: world 1-8, either dimension sharded, blocks that may or may not divide the
    shards, and half the time a segment table (several segments per rank, some of them empty)."""
    world = rng.randint(1, 8)
    shard_dim = rng.randint(0, 1)
    block = (2 ** rng.randint(0, 4), 2 ** rng.randint(0, 4))
    other = rng.randint(1, 40)
    if rng.random() < 0.5:
        segments = [rng.choice([0, 0, rng.randint(1, 12)]) for _ in range(world * rng.randint(1, 3))]
        extent = sum(segments)
    else:
        segments, extent = None, world * rng.randint(0, 12)
    shape = (extent, other) if shard_dim == 0 else (other, extent)
    return dict(shape=shape, world_size=world, block=block, shard_dim=shard_dim, segments=segments)


LAYOUTS = [random_layout(random.Random(seed)) for seed in range(300)]


def owner_of_each_index(m: TileMap) -> list[int]:
    """Brute force: the rank owning each index of the sharded dimension, from the segment sizes alone."""
    per_rank = m.num_segments // m.world_size
    owners = []
    for s, size in enumerate(m.sizes):
        owners += [s // per_rank] * size
    return owners


def tile_of_each_element(m: TileMap) -> torch.Tensor:
    """(rows, cols) tensor of the producer tile holding each element; checks that tiles do not overlap."""
    which = torch.full((m.rows, m.cols), -1, dtype=torch.int64)
    for t in range(m.num_tiles):
        r, c, nr, nc = m.rect(t)
        assert nr > 0 and nc > 0 and r + nr <= m.rows and c + nc <= m.cols
        assert (which[r:r + nr, c:c + nc] == -1).all(), f"tile {t} overlaps another"
        which[r:r + nr, c:c + nc] = t
    return which


@pytest.mark.parametrize("layout", LAYOUTS[:150])
def test_map_partitions_the_tensor_into_blocks_of_one_segment(layout):
    m = TileMap(**layout)
    which = tile_of_each_element(m)
    assert (which >= 0).all(), "an element belongs to no tile"
    owners = owner_of_each_index(m)
    bs, bo = m.block if m.shard_dim == 0 else m.block[::-1]
    across = -(-(m.cols, m.rows)[m.shard_dim] // bo)
    expect_tiles = sum(-(-size // bs) * across for size in m.sizes)
    assert m.num_tiles == expect_tiles
    seg_of_index = [s for s, size in enumerate(m.sizes) for _ in range(size)]
    last_seg = -1
    for t in range(m.num_tiles):
        r, c, nr, nc = m.rect(t)
        split0, split_n, other0 = (r, nr, c) if m.shard_dim == 0 else (c, nc, r)
        segs = set(seg_of_index[split0:split0 + split_n])
        assert len(segs) == 1, f"tile {t} straddles segments {segs}"
        seg = segs.pop()
        assert seg >= last_seg, "tiles are numbered segment after segment"
        last_seg = seg
        assert (split0 - m.starts[seg]) % bs == 0 and other0 % bo == 0, "tiles are aligned blocks of their segment"
        assert m.owner(t) == owners[split0]
        assert m.offset(t) == r * m.cols + c
        assert m.flag(t) == t
    assert sorted(t for q in range(m.world_size) for t in m.tiles_of(q)) == list(range(m.num_tiles))


@pytest.mark.parametrize("layout", LAYOUTS[:150])
def test_cover_is_every_tile_touching_the_block(layout):
    m = TileMap(**layout)
    which = tile_of_each_element(m)
    rng = random.Random(str(layout))
    for _ in range(6):
        row0, col0 = rng.randint(-4, m.rows + 2), rng.randint(-4, m.cols + 2)
        nr, nc = 2 ** rng.randint(0, 5), 2 ** rng.randint(0, 5)
        inside = which[max(row0, 0):max(row0 + nr, 0), max(col0, 0):max(col0 + nc, 0)]
        assert m.cover(row0, col0, nr, nc) == sorted(set(inside.reshape(-1).tolist()))


def test_map_rejects_bad_layouts():
    with pytest.raises(ValueError, match="block"):
        TileMap((8, 8), 2, (3, 4))
    with pytest.raises(ValueError, match="does not divide"):
        TileMap((9, 8), 2, (4, 4))
    with pytest.raises(ValueError, match="segments"):
        TileMap((9, 8), 2, (4, 4), segments=[4, 4])
    with pytest.raises(ValueError, match="segments"):
        TileMap((9, 8), 2, (4, 4), segments=[4, 4, 1])
    with pytest.raises(ValueError, match="shard_dim"):
        TileMap((8, 8), 2, (4, 4), shard_dim=2)


# -- device functions under the interpreter (one process, no ranks needed) -------------------

DEVICE_LAYOUTS = [lay for lay in LAYOUTS[150:] if 0 < TileMap(**lay).num_tiles <= 24][:12]


@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
def test_device_functions_match_the_host_map(layout):
    from tile_kernels import tile_places_kernel

    m = TileMap(**layout)
    out = torch.full((m.num_tiles, 7), -1, dtype=torch.int64)
    tile_places_kernel[(1,)](m.arg, out)
    expect = [[m.owner(t), *m.rect(t), m.offset(t), m.flag(t)] for t in range(m.num_tiles)]
    assert out.tolist() == expect


def _wait_token(m, flags, rect):
    from tile_kernels import rect_wait_kernel

    out = torch.full((1,), -1, dtype=torch.int32)
    rect_wait_kernel[(1,)](m.arg, flags, out, *rect, 1)
    return int(out)


@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
def test_tile_wait_waits_on_exactly_the_cover(layout, monkeypatch):
    """Flags raised on the cover only: the wait returns (it waits on nothing else). Any one of them
    lowered: it times out (it waits on every one)."""
    m = TileMap(**layout)
    rng = random.Random(str(layout))
    for _ in range(3):
        rect = (rng.randint(-2, m.rows), rng.randint(-2, m.cols), 2 ** rng.randint(0, 4), 2 ** rng.randint(0, 4))
        cover = m.cover(*rect)
        flags = torch.zeros(m.num_tiles, dtype=torch.int32)
        flags[cover] = 1
        monkeypatch.setenv("WEFT_WAIT_TIMEOUT_S", "5")
        assert _wait_token(m, flags, rect) == (1 if cover else 0)
        monkeypatch.setenv("WEFT_WAIT_TIMEOUT_S", "0.02")
        for t in rng.sample(cover, min(2, len(cover))):
            flags[t] = 0
            with pytest.raises(WaitTimeout, match="timed out"):
                _wait_token(m, flags, rect)
            flags[t] = 1


# -- the dense form (ShardMapping): the same checks, against the definition ------------------------

def random_shards(rng: random.Random) -> tuple[int, int, int]:
    """(world, shard, cols): world 1-8, shards of 0-12 rows (empty ones too), 1-40 columns."""
    return rng.randint(1, 8), rng.choice([0, rng.randint(1, 12), rng.randint(1, 12)]), rng.randint(1, 40)


SHARDS = [random_shards(random.Random(1000 + seed)) for seed in range(10)]


def shard_of_each_row(world: int, shard: int) -> list[int]:
    """Brute force: the rank owning each row, from the definition (rank r's rows follow rank r - 1's)."""
    return [r for r in range(world) for _ in range(shard)]


def shard_cover(world, shard, cols, row0, col0, num_rows, num_cols) -> list[int]:
    """Brute force: the tiles (shards) holding some element of the block."""
    if max(col0, 0) >= min(col0 + num_cols, cols):
        return []
    owners = shard_of_each_row(world, shard)
    return sorted({owners[r] for r in range(max(row0, 0), min(row0 + num_rows, world * shard))})


@pytest.mark.parametrize("layout", SHARDS)
def test_shard_mapping_matches_the_definition_and_the_table_form(layout):
    from tile_kernels import shard_places_kernel

    world, shard, cols = layout
    out = torch.full((world, 7), -1, dtype=torch.int64)
    shard_places_kernel[(1,)](world, shard, cols, out)
    owners = shard_of_each_row(world, shard)
    expect = []
    for t in range(world):
        rows = [r for r in range(world * shard) if owners[r] == t]
        assert rows == list(range(t * shard, t * shard + len(rows))), "a shard is contiguous"
        expect.append([t, t * shard, 0, len(rows), cols, t * shard * cols, t])
    assert out.tolist() == expect
    if shard:  # a table map whose blocks cover a shard has the same tiles
        m = TileMap((world * shard, cols), world, (2 ** (shard - 1).bit_length(), 2 ** (cols - 1).bit_length()))
        assert [[m.owner(t), *m.rect(t), m.offset(t), m.flag(t)] for t in range(m.num_tiles)] == expect


def _expect_wait(kernel_args, kernel, flags, waited, monkeypatch):
    """The wait returns with exactly the tiles `waited` raised, and times out with any one of them lowered."""
    out = torch.full((1,), -1, dtype=torch.int32)
    flags.zero_()
    flags[waited] = 1
    monkeypatch.setenv("WEFT_WAIT_TIMEOUT_S", "5")
    kernel[(1,)](*kernel_args(flags, out))
    assert int(out) == (1 if waited else 0)
    monkeypatch.setenv("WEFT_WAIT_TIMEOUT_S", "0.02")
    for t in waited[:1] + waited[-1:]:
        flags[t] = 0
        with pytest.raises(WaitTimeout, match="timed out"):
            kernel[(1,)](*kernel_args(flags, out))
        flags[t] = 1


@pytest.mark.parametrize("layout", SHARDS[:6])
def test_shard_waits_wait_on_exactly_the_cover(layout, monkeypatch):
    from tile_kernels import shard_wait_kernel

    world, shard, cols = layout
    rng = random.Random(str(layout))
    flags = torch.zeros(world, dtype=torch.int32)
    for _ in range(3):
        rect = (rng.randint(-2, world * shard), rng.randint(-2, cols), 2 ** rng.randint(0, 4), 2 ** rng.randint(0, 4))
        _expect_wait(lambda f, o: (world, shard, cols, f, o, *rect, 1, True, False), shard_wait_kernel, flags,
                     shard_cover(world, shard, cols, *rect), monkeypatch)
        first = rng.randrange(world)
        count = rng.randint(1, world - first)
        _expect_wait(lambda f, o: (world, shard, cols, f, o, first, count, 0, 0, 1, False, False), shard_wait_kernel,
                     flags, list(range(first, first + count)), monkeypatch)


@pytest.mark.parametrize("layout", DEVICE_LAYOUTS[:4])
def test_tile_wait_tiles_waits_on_exactly_those_tiles(layout, monkeypatch):
    from tile_kernels import tiles_wait_kernel

    m = TileMap(**layout)
    rng = random.Random(str(layout))
    flags = torch.zeros(m.num_tiles, dtype=torch.int32)
    for _ in range(2):
        first = rng.randrange(m.num_tiles)
        count = rng.randint(1, m.num_tiles - first)
        _expect_wait(lambda f, o: (m.arg, f, o, first, count, 1, False), tiles_wait_kernel, flags,
                     list(range(first, first + count)), monkeypatch)


# -- producers and consumers across ranks -----------------------------------------------------

def _produce_consume(layout, consumer, forms, epochs_per_form):
    """All-gather with tile_push / tile_pull, consumed in `consumer`-shaped blocks; one flag array for
    every form and epoch, never reset."""
    import triton

    import weft
    from tile_kernels import produce_consume_kernel

    heap = weft.world().heap.descriptor
    m = TileMap(world_size=weft.world_size(), **layout)
    buf = weft.empty((m.rows, m.cols), torch.float32)
    flags = weft.zeros((m.num_tiles,), torch.int32)
    consumers = triton.cdiv(m.rows, consumer[0]) * triton.cdiv(m.cols, consumer[1])
    epoch = 0
    for form in forms:
        pull = form == "pull"
        for _ in range(epochs_per_form):
            epoch += 1
            full = epoch * 1000 + torch.arange(m.rows * m.cols, dtype=torch.float32).view(m.rows, m.cols)
            src = full.clone()  # every rank can build the whole tensor; it pushes only the tiles it owns
            buf.fill_(float("nan"))
            out = torch.full_like(full, float("nan"))
            weft.barrier()  # no push lands before the poison
            produce_consume_kernel[(m.num_tiles * (1 + pull) + consumers,)](
                m.arg, src, buf, flags, out, heap, m.rows, m.cols, epoch, CONSUMER_M=consumer[0],
                CONSUMER_N=consumer[1], PULL=pull, ALL_AT_ONCE=form == "push_all", SKIP_WAIT=False)
            assert torch.equal(out, 2 * full + 1), (form, epoch)
            weft.barrier()  # nobody pushes the next epoch into a buffer still being read
    assert (flags == epoch).all()  # one raise per tile and epoch: counted, never reset
    return True


FORMS = ("push_each", "push_all", "pull")


@pytest.mark.parametrize("world, layout, consumer", [
    # columns sharded; producer blocks of 8 columns cut each 20-column shard into 8, 8, 4
    (2, dict(shape=(24, 40), block=(16, 8), shard_dim=1), (8, 32)),
    # rows sharded by a MoE segment table with empty segments, two per rank
    (3, dict(shape=(24, 24), block=(4, 16), segments=[5, 0, 0, 9, 7, 3]), (16, 32)),
    # rows sharded evenly, 6 rows a shard in producer tiles of 4 (4 + 2)
    (4, dict(shape=(24, 16), block=(4, 16)), (16, 8)),
], ids=["2ranks-cols", "3ranks-moe", "4ranks-rows"])
def test_producer_consumer_mismatched_blocks(world, layout, consumer):
    assert all(run_ranks(_produce_consume, world, layout, consumer, FORMS, 2, timeout=240))


def _delayed_producer(skip_wait, delay):
    """Rank 0 launches `delay` seconds after the others; returns (out is right, seconds my kernel took)."""
    import time

    import weft
    from tile_kernels import produce_consume_kernel

    me = weft.rank()
    m = TileMap((16, 16), weft.world_size(), (8, 16))
    buf = weft.empty((m.rows, m.cols), torch.float32)
    flags = weft.zeros((m.num_tiles,), torch.int32)
    full = torch.arange(m.rows * m.cols, dtype=torch.float32).view(m.rows, m.cols)
    buf.fill_(float("nan"))
    out = torch.full_like(full, float("nan"))
    weft.barrier()
    if me == 0:
        time.sleep(delay)
    start = time.monotonic()
    produce_consume_kernel[(m.num_tiles + 1,)](m.arg, full, buf, flags, out, weft.world().heap.descriptor,
                                               m.rows, m.cols, 1, CONSUMER_M=16, CONSUMER_N=16, PULL=False,
                                               ALL_AT_ONCE=True, SKIP_WAIT=skip_wait)
    took = time.monotonic() - start
    right = torch.equal(out, 2 * full + 1)
    weft.barrier()
    return right, took


def test_consumer_waits_for_a_delayed_producer():
    results = run_ranks(_delayed_producer, 2, False, 1.0, timeout=120)
    assert all(right for right, _ in results)
    assert results[1][1] > 0.5, "rank 1's consumer returned before rank 0 had produced"


def test_consumer_that_skips_tile_wait_is_caught():
    results = run_ranks(_delayed_producer, 2, True, 1.0, timeout=120)
    assert not results[1][0], "rank 1 read rank 0's rows before they were pushed, and the test did not notice"


def _shard_gather(shard, cols, consumer, epochs, late, host_push):
    """All-gather in the dense form (shard_gather_kernel), `epochs` times on one flag array, never reset; in
    the last epoch rank 0 launches `late` seconds after the others. With `host_push` the host produces, by
    copy_engine_push into each peer's views. Returns the seconds my last kernel took."""
    import time

    import triton

    import weft
    from tile_kernels import shard_gather_kernel

    me, w = weft.rank(), weft.world_size()
    heap = weft.world().heap.descriptor
    buf = weft.empty((w * shard, cols), torch.float32)
    flags = weft.zeros((w,), torch.int32)
    consumers = triton.cdiv(w * shard, consumer[0]) * triton.cdiv(cols, consumer[1])
    for epoch in range(1, epochs + 1):
        full = epoch * 1000 + torch.arange(w * shard * cols, dtype=torch.float32).view(w * shard, cols)
        buf.fill_(float("nan"))
        out = torch.full_like(full, float("nan"))
        weft.barrier()  # no push lands before the poison
        if epoch == epochs and me == 0:
            time.sleep(late)
        start = time.monotonic()
        if host_push:  # my tile: my rows of every peer's buf, then my flag there
            mine, peer = slice(me * shard, (me + 1) * shard), weft.world().heap.peer
            for q in range(w):
                copy_engine_push(peer(buf, q)[mine], full[mine], peer(flags, q)[me:me + 1],
                                    torch.tensor([epoch], dtype=torch.int32))
        shard_gather_kernel[(1 + consumers,)](full, buf, flags, out, heap, shard, cols, epoch, BLOCK_ROWS=2,
                                              BLOCK_COLS=triton.next_power_of_2(cols), CONSUMER_M=consumer[0],
                                              CONSUMER_N=consumer[1], PRODUCE=not host_push)
        took = time.monotonic() - start
        assert torch.equal(out, 2 * full + 1), epoch
        weft.barrier()  # nobody pushes the next epoch into a buffer still being read
    assert (flags == epochs).all()
    return took


@pytest.mark.parametrize("world, shard, cols, consumer, host_push", [
    (2, 5, 12, (4, 8), False), (3, 3, 10, (8, 16), False), (2, 5, 12, (4, 8), True)],
    ids=["2ranks", "3ranks", "2ranks-copy-engine"])
def test_shard_producer_consumer_mismatched_blocks(world, shard, cols, consumer, host_push):
    """Shards of 5 (3) rows pushed whole by a kernel or the host (copy_engine_push), consumed in 4 x 8
    (8 x 16) blocks that straddle them; the last of three epochs with rank 0 late: the others' consumers
    wait for it."""
    took = run_ranks(_shard_gather, world, shard, cols, consumer, 3, 0.5, host_push, timeout=120)
    assert all(t > 0.25 for t in took[1:]), f"a consumer returned before rank 0 had produced: {took}"


# -- the GPU compiler accepts every primitive ---------------------------------------------------

COMPILE_ALL = """
import tile_kernels
from weft.testing.compile import compile_kernel
for fn, signature, constexprs in tile_kernels.compile_cases():
    compile_kernel(fn, signature, constexprs, arch=90)
print("compiled", len(tile_kernels.compile_cases()))
"""


def test_tile_primitives_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(WEFT_BACKEND="cuda", PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    res = subprocess.run([sys.executable, "-c", COMPILE_ALL], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "compiled 18" in res.stdout
