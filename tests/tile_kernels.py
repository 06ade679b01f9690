"""Kernels on the tile primitives, shared by the cpu tests (interpreter) and the sm_90 compile check."""
import triton
import triton.language as tl

import weft.language as wl


@triton.jit
def tile_places_kernel(mapping, out):
    """Row t of `out` (7 int64): owner, row0, col0, num_rows, num_cols, offset, flag of producer tile t."""
    _store_places(mapping, out)


@triton.jit
def shard_places_kernel(world, shard, cols, out):
    """tile_places_kernel for the dense form, built in the kernel from its scalars."""
    _store_places(wl.ShardMapping(world, shard, cols), out)


@triton.jit
def _store_places(mapping, out):
    for t in range(wl.tile_count(mapping)):
        row0, col0, num_rows, num_cols = wl.tile_rect(mapping, t)
        row = out + t * 7
        tl.store(row + 0, wl.tile_owner(mapping, t))  # (stores convert to int64: the dense form's fields may be ints)
        tl.store(row + 1, row0)
        tl.store(row + 2, col0)
        tl.store(row + 3, num_rows)
        tl.store(row + 4, num_cols)
        tl.store(row + 5, wl.tile_offset(mapping, t))
        tl.store(row + 6, wl.tile_flag(mapping, t))


@triton.jit
def rect_wait_kernel(mapping, flags, out, row0, col0, num_rows, num_cols, value):
    """out[0] = the token of a tile_wait on one consumer block (returns once its producer tiles' flags >= value)."""
    tl.store(out, wl.tile_wait(mapping, flags, row0, col0, num_rows, num_cols, value))


@triton.jit
def tiles_wait_kernel(mapping, flags, out, first, count, value, TMA: tl.constexpr):
    """out[0] = the token of a tile_wait_tiles on producer tiles [first, first + count)."""
    tl.store(out, wl.tile_wait_tiles(mapping, flags, first, count, value, tma=TMA).to(tl.int32))


@triton.jit
def shard_wait_kernel(world, shard, cols, flags, out, a, b, c, d, value, RECT: tl.constexpr, TMA: tl.constexpr):
    """out[0] = the token of a wait on a dense map: tile_wait on block (row0, col0, num_rows, num_cols) = (a, b, c,
    d) with RECT, else tile_wait_tiles on tiles [a, a + b)."""
    mapping = wl.ShardMapping(world, shard, cols)  # kept in a variable: the form is still told at trace time
    if RECT:
        token = wl.tile_wait(mapping, flags, a, b, c, d, value, tma=TMA)
    else:
        token = wl.tile_wait_tiles(mapping, flags, a, b, value, tma=TMA).to(tl.int32)
    tl.store(out, token)


@triton.jit
def _push_shard(src, buf, flags, heap, shards, me, world, shard, cols, epoch, BLOCK_ROWS: tl.constexpr,
                BLOCK_COLS: tl.constexpr):
    """My shard into every rank's `buf`, BLOCK_ROWS rows at a time, then my tile's flag everywhere."""
    c = tl.arange(0, BLOCK_COLS)[None, :]
    for r0 in range(me * shard, (me + 1) * shard, BLOCK_ROWS):
        r = r0 + tl.arange(0, BLOCK_ROWS)[:, None]
        mask = (r < (me + 1) * shard) & (c < cols)
        x = tl.load(src + r * cols + c, mask=mask)
        for q in range(world):
            tl.store(wl.symm_at(buf, q, heap) + r * cols + c, x, mask=mask)
    wl.tile_notify(shards, me, flags, heap, epoch, wl.ALL_RANKS)


@triton.jit(do_not_specialize=["epoch"])
def shard_gather_kernel(src, buf, flags, out, heap, shard, cols, epoch, BLOCK_ROWS: tl.constexpr,
                        BLOCK_COLS: tl.constexpr, CONSUMER_M: tl.constexpr, CONSUMER_N: tl.constexpr,
                        PRODUCE: tl.constexpr):
    """All-gather in the dense form: rank r's shard is rows [r * shard, (r + 1) * shard) of `src`, one tile.

    Program 0 produces (PRODUCE; else the host did, with copy_engine_push): it copies my shard into every
    rank's `buf` with its own loop, BLOCK_ROWS rows at a time (a shard is no constexpr block, so no
    tile_push), then raises my tile's flag everywhere. The others consume CONSUMER_M x CONSUMER_N blocks
    (row-major over the tensor), which may straddle shards: tile_wait, then out = 2 * buf + 1 over the block.
    """
    pid = tl.program_id(0)
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    shards = wl.ShardMapping(world, shard, cols)
    if pid == 0:
        if PRODUCE:
            _push_shard(src, buf, flags, heap, shards, me, world, shard, cols, epoch, BLOCK_ROWS, BLOCK_COLS)
    else:
        blocks_across = tl.cdiv(cols, CONSUMER_N)
        row0 = ((pid - 1) // blocks_across) * CONSUMER_M
        col0 = ((pid - 1) % blocks_across) * CONSUMER_N
        token = wl.tile_wait(shards, flags, row0, col0, CONSUMER_M, CONSUMER_N, epoch)
        r = row0 + tl.arange(0, CONSUMER_M)[:, None]
        k = col0 + tl.arange(0, CONSUMER_N)[None, :]
        mask = (r < world * shard) & (k < cols)
        x = tl.load(wl.consume_token(buf, token) + r * cols + k, mask=mask)
        tl.store(out + r * cols + k, 2 * x + 1, mask=mask)


@triton.jit
def _produce(mapping, src, buf, flags, heap, epoch, PULL: tl.constexpr, ALL_AT_ONCE: tl.constexpr):
    """Producer program: my producer tile number program_id (if I own it) to every rank (push: into their
    buffers, pull: into mine, the pullers copy it); the others return."""
    t = tl.program_id(0)
    me = wl.rank(heap)
    if wl.tile_owner(mapping, t) == me:
        if PULL:
            wl.tile_push(mapping, t, src, buf, flags, heap, epoch, me)
        elif ALL_AT_ONCE:
            wl.tile_push(mapping, t, src, buf, flags, heap, epoch, wl.ALL_RANKS)
        else:
            for s in range(wl.num_ranks(heap)):  # one peer after another, starting with the next rank
                wl.tile_push(mapping, t, src, buf, flags, heap, epoch, (me + 1 + s) % wl.num_ranks(heap))


@triton.jit(do_not_specialize=["epoch"])
def produce_consume_kernel(mapping, src, buf, flags, out, heap, rows, cols, epoch, CONSUMER_M: tl.constexpr,
                           CONSUMER_N: tl.constexpr, PULL: tl.constexpr, ALL_AT_ONCE: tl.constexpr,
                           SKIP_WAIT: tl.constexpr):
    """All-gather of `src`'s shards into `buf` on every rank, consumed in blocks of another shape.

    Programs [0, T) produce tile program_id; with PULL, programs [T, 2T) pull tile program_id - T
    unless I own it; the rest consume CONSUMER_M x CONSUMER_N blocks (row-major over the tensor):
    tile_wait, then out = 2 * buf + 1 over the block. Producers come first: the interpreter runs a
    grid's programs in order and a program never waits on a later one. SKIP_WAIT consumes with no
    wait: the broken consumer that the delayed-producer test must catch.
    """
    pid = tl.program_id(0)
    tiles = wl.tile_count(mapping)
    if pid < tiles:
        _produce(mapping, src, buf, flags, heap, epoch, PULL, ALL_AT_ONCE)
    elif PULL and pid < 2 * tiles:
        if wl.tile_owner(mapping, pid - tiles) != wl.rank(heap):
            wl.tile_pull(mapping, pid - tiles, buf, buf, flags, heap, epoch)
    else:
        c = pid - tiles * (1 + PULL)
        blocks_across = tl.cdiv(cols, CONSUMER_N)
        row0 = (c // blocks_across) * CONSUMER_M
        col0 = (c % blocks_across) * CONSUMER_N
        data = buf
        if not SKIP_WAIT:
            data = wl.consume_token(buf, wl.tile_wait(mapping, flags, row0, col0, CONSUMER_M, CONSUMER_N, epoch))
        r = row0 + tl.arange(0, CONSUMER_M)[:, None]
        k = col0 + tl.arange(0, CONSUMER_N)[None, :]
        mask = (r < rows) & (k < cols)
        x = tl.load(data + r * cols + k, mask=mask)
        tl.store(out + r * cols + k, 2 * x + 1, mask=mask)


def _mapping(shard_dim: int):
    """A TileMapping's signature and its constexprs (block 16 x 32, up to 8 segments) for compile_kernel."""
    sig = wl.TileMapping("*i32", "constexpr", "constexpr", "constexpr", "constexpr")
    return sig, {("mapping", 1): 16, ("mapping", 2): 32, ("mapping", 3): shard_dim, ("mapping", 4): 8}


def compile_cases():
    """(kernel, signature, constexprs) covering every tile primitive, both sharded dimensions, both forms of
    the map, with and without the TMA fence."""
    cases = []
    for shard_dim in (0, 1):
        mapping, consts = _mapping(shard_dim)
        cases.append((tile_places_kernel, dict(mapping=mapping, out="*i64"), consts))
        cases.append((rect_wait_kernel, dict(mapping=mapping, flags="*i32", out="*i32", row0="i32", col0="i32",
                                             num_rows="i32", num_cols="i32", value="i32"), consts))
        cases.append((tiles_wait_kernel, dict(mapping=mapping, flags="*i32", out="*i32", first="i32", count="i32",
                                              value="i32"), dict(consts, TMA=shard_dim == 1)))
        for pull, all_at_once in ((False, False), (False, True), (True, False)):
            sig = dict(mapping=mapping, src="*fp32", buf="*fp32", flags="*i32", out="*fp32", heap="*i64",
                       rows="i32", cols="i32", epoch="i32")
            cases.append((produce_consume_kernel, sig, dict(consts, CONSUMER_M=32, CONSUMER_N=64, PULL=pull,
                                                             ALL_AT_ONCE=all_at_once, SKIP_WAIT=False)))
    dense = dict(world="i32", shard="i32", cols="i32")
    cases.append((shard_places_kernel, dict(dense, out="*i64"), {}))
    for rect in (False, True):
        for tma in (False, True):
            cases.append((shard_wait_kernel, dict(dense, flags="*i32", out="*i32", a="i32", b="i32", c="i32",
                                                  d="i32", value="i32"), dict(RECT=rect, TMA=tma)))
    cases.append((shard_gather_kernel, dict(src="*fp32", buf="*fp32", flags="*i32", out="*fp32", heap="*i64",
                                            shard="i32", cols="i32", epoch="i32"),
                  dict(BLOCK_ROWS=16, BLOCK_COLS=64, CONSUMER_M=32, CONSUMER_N=32, PRODUCE=True)))
    return cases
