"""Tile-centric primitives (TileLink): "compute a tile, notify it" and "wait for a tile, use it".

A *tile map* describes a (rows, cols) tensor sharded over ranks along one
dimension, cut into the producer's tiles. It is built on the host
(`weft.runtime.tiles.TileMap`) and handed to kernels as one argument
(`TileMap.arg`, a `TileMapping`). Kernels then speak in tiles, not in flag
arithmetic:

    producer:  tile_push(mapping, t, src, buf, flags, heap, epoch, peer)  # or: store it, then tile_notify
    consumer:  token = tile_wait(mapping, flags, row0, col0, BM, BN, epoch)  # any block shape
               x = tl.load(consume_token(buf, token) + offsets, mask)

Layout. Along the sharded dimension the tensor is a sequence of *segments*,
rank after rank: rank r owns segments [r * S, (r + 1) * S) and its shard is
those segments back to back. Without a segment table S = 1 and every shard
has extent / world_size; with one (MoE: one segment per expert, or per
(rank, expert) in a gathered buffer) segments have any size, zero included.
Producer tiles are BLOCK_M x BLOCK_N blocks cut from each segment
separately, so a tile never straddles two segments (nor two ranks); the last
tiles of a segment, and of the other dimension, are clipped. Tiles are
numbered segment after segment; within a segment, block along the sharded
dimension after block, and across the other dimension inside that.

Buffers. Every buffer a mapping addresses holds the whole tensor, row-major
(element (r, c) at r * cols + c); a symmetric one has that layout on every
rank. Flags: one per producer tile (its flag index is its tile id) in a
symmetric int32 array of `num_tiles` words, zeroed once; they count epochs
and are never reset. A tile's flag is raised on every rank that needs the
tile: by the producer (`tile_notify`, `tile_push`) or by the rank that pulls
it (`tile_pull`); consumers then `tile_wait` on their own flags, with any
block shape. The primitives order one epoch's data before its flags, not
epochs against each other: a producer may overwrite a buffer for the next
epoch only once its consumers are done with it (a barrier, or acknowledgement
flags as in tutorial 01).

The dense form. `ShardMapping(world, shard, cols)` is the map of the common
case in scalars, with no table: the rows sharded evenly, each rank's whole
shard one producer tile (tile t = rank t's shard, flag t). A kernel builds it
from arguments it already has, so its arithmetic folds to what hand-written
flag code computes and it adds no load; it is what the overlapped GEMMs use,
whose shards are moved whole by the copy engine
(`weft.runtime.tiles.copy_engine_push`: the tile, then its flag, in stream
order). The primitives take either
form, but the tile-sized copies (`tile_offsets`, `tile_push`, `tile_pull`),
which need a constexpr block, take a `TileMapping` only.

Consumers that read whole producer tiles wait for them by number
(`tile_wait_tiles`: their flags are consecutive, one `wait`); consumers with
blocks of their own shape wait for a block (`tile_wait`). Either may read the
tiles through TMA (`tma=True`), which adds the async-proxy fence those loads
need after the acquire.

Every primitive is built from `notify` / `notify_all` / `wait` /
`consume_token` and plain loads and stores, so each has its interpreter form
through theirs. This module is device code only; the host half of the
layer is `weft.runtime.tiles`.
"""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from . import ptx
from .core import CMP_GE, INTERPRET, SCOPE_SYS, SIGNAL_SET, num_ranks, rank, symm_at
from .signals import consume_token, notify, notify_all, wait

# `peer` of tile_notify / tile_push: every rank, myself included.
ALL_RANKS = tl.constexpr(-1)

# The descriptor (int32): a header, then one array of NUM_SEGMENTS entries per segment field.
ROWS, COLS, NUM_SEGMENTS, NUM_TILES = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
ACROSS = tl.constexpr(4)  # producer blocks across the unsharded dimension
HEADER = tl.constexpr(5)
# Segment fields: extent along the sharded dimension (start, size), owning rank, first tile.
START, SIZE, OWNER, FIRST_TILE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


# TileMapping is built on the host (runtime.tiles.TileMap.arg) but lives here: its fields, with the descriptor
# layout above, are the contract the device functions below read, and kernels' compile signatures name it.
class TileMapping(NamedTuple):
    """A tile map as kernels receive it: `TileMap.arg`, passed as one kernel argument."""
    table: tl.tensor              # the descriptor: int32 header + segment arrays (see HEADER, START, ...)
    BLOCK_M: tl.constexpr         # the producer's tile: rows
    BLOCK_N: tl.constexpr         # ... and columns
    SHARD_DIM: tl.constexpr       # 0: rows are sharded over ranks, 1: columns
    MAX_SEGMENTS: tl.constexpr    # a power of two >= the number of segments (for a vectorised search)


class ShardMapping(NamedTuple):
    """The dense form of a tile map, in scalars: a (world * shard, cols) tensor whose rows are sharded
    evenly over `world` ranks, each rank's whole shard one producer tile. Tile t is rank t's rows
    [t * shard, (t + 1) * shard), every column; rank t owns it and its flag is flags[t].

    No table and no loads: every function of the map is integer arithmetic on these fields, so a
    kernel builds the map from arguments it already has (`wl.ShardMapping(world, m, K)`, constexpr
    fields folding away) and it costs what hand-written flag arithmetic costs. A shard is not a
    constexpr block, so `tile_offsets`, `tile_push` and `tile_pull` take the table form only: the
    dense form's producer moves a shard with its own loop or the copy engine, then raises its flag.
    """
    world: tl.tensor              # ranks, one tile each
    shard: tl.tensor              # rows per rank
    cols: tl.tensor
    table: None = None            # no table: what tells this form from a TileMapping, at trace time


# -- device: a tile's place --------------------------------------------------------
# Each function takes either form of the map; `mapping.table is None` (the dense form) is decided at trace time.

@triton.jit
def tile_count(mapping):
    """How many producer tiles the map has."""
    if mapping.table is None:
        return mapping.world
    else:
        return tl.load(mapping.table + NUM_TILES)


@triton.jit
def _segment_field(mapping, field):
    """Pointer to the array of one segment field (START, SIZE, OWNER, FIRST_TILE)."""
    return mapping.table + HEADER + field * tl.load(mapping.table + NUM_SEGMENTS)


@triton.jit
def _last_at_or_below(values, n, x, MAX: tl.constexpr):
    """Index of the last of the `n` ascending `values` that is <= x. Searched in one vector op: the
    last one is never an empty segment when x is inside the tensor (an empty segment shares its
    start, and first tile, with the next one)."""
    i = tl.arange(0, MAX)
    v = tl.load(values + i, mask=i < n, other=0)
    return tl.sum(((v <= x) & (i < n)).to(tl.int32), axis=0) - 1


@triton.jit
def _tile_segment(mapping, tile):
    n = tl.load(mapping.table + NUM_SEGMENTS)
    return _last_at_or_below(_segment_field(mapping, FIRST_TILE), n, tile, mapping.MAX_SEGMENTS)


@triton.jit
def tile_owner(mapping, tile):
    """The rank whose shard holds producer tile `tile`."""
    if mapping.table is None:
        return tile
    else:
        return tl.load(_segment_field(mapping, OWNER) + _tile_segment(mapping, tile))


@triton.jit
def tile_flag(mapping, tile):
    """Index of the tile's flag in the flag array: one flag per producer tile."""
    return tile


@triton.jit
def tile_rect(mapping, tile):
    """(row0, col0, num_rows, num_cols) of producer tile `tile`; clipped at its segment's and the tensor's edge."""
    if mapping.table is None:
        return tile * mapping.shard, tl.full([], 0, tl.int32), mapping.shard, mapping.cols
    else:
        return _segment_tile_rect(mapping, tile)


@triton.jit
def _segment_tile_rect(mapping, tile):
    seg = _tile_segment(mapping, tile)
    start = tl.load(_segment_field(mapping, START) + seg)
    size = tl.load(_segment_field(mapping, SIZE) + seg)
    local = tile - tl.load(_segment_field(mapping, FIRST_TILE) + seg)
    across = tl.load(mapping.table + ACROSS)
    i = local // across
    j = local % across
    if mapping.SHARD_DIM == 0:
        row0 = start + i * mapping.BLOCK_M
        col0 = j * mapping.BLOCK_N
        return row0, col0, tl.minimum(size - i * mapping.BLOCK_M, mapping.BLOCK_M), \
            tl.minimum(tl.load(mapping.table + COLS) - col0, mapping.BLOCK_N)
    else:
        row0 = j * mapping.BLOCK_M
        col0 = start + i * mapping.BLOCK_N
        return row0, col0, tl.minimum(tl.load(mapping.table + ROWS) - row0, mapping.BLOCK_M), \
            tl.minimum(size - i * mapping.BLOCK_N, mapping.BLOCK_N)


@triton.jit
def _rows(mapping):
    if mapping.table is None:
        return mapping.world * mapping.shard
    else:
        return tl.load(mapping.table + ROWS)


@triton.jit
def _cols(mapping):
    if mapping.table is None:
        return mapping.cols
    else:
        return tl.load(mapping.table + COLS)


@triton.jit
def tile_offset(mapping, tile):
    """Element offset (int64) of the tile's first element in a buffer laid out by the map."""
    row0, col0, _, _ = tile_rect(mapping, tile)
    return row0.to(tl.int64) * _cols(mapping) + col0


@triton.jit
def tile_offsets(mapping, tile):
    """(offsets, mask), both [BLOCK_M, BLOCK_N]: the tile's elements in a buffer laid out by the map.
    A TileMapping's only: a ShardMapping's tile (a whole shard) is no constexpr block."""
    tl.static_assert(mapping.table is not None, "tile_offsets, tile_push and tile_pull need a TileMap's blocks")
    row0, col0, num_rows, num_cols = tile_rect(mapping, tile)
    r = tl.arange(0, mapping.BLOCK_M)[:, None]
    c = tl.arange(0, mapping.BLOCK_N)[None, :]
    offsets = (row0 + r).to(tl.int64) * tl.load(mapping.table + COLS) + (col0 + c)
    return offsets, (r < num_rows) & (c < num_cols)


# -- device: signals and copies, tile by tile ------------------------------------------

@triton.jit
def tile_notify(mapping, tile, flags, heap, value, peer, op: tl.constexpr = SIGNAL_SET,
                scope: tl.constexpr = SCOPE_SYS):
    """Raise producer tile `tile`'s flag to `value` on rank `peer` (ALL_RANKS: on every rank).

    Release for the whole program, as `notify`: every store the program made before the call (the
    tile's data, wherever it was written: locally or into peers' buffers through `symm_at`) is
    visible to whoever then acquires the flag. op SIGNAL_ADD counts several producers of one tile.
    """
    flag = flags + tile_flag(mapping, tile)
    if peer == ALL_RANKS:
        notify_all(flag, heap, value, op, scope)
    else:
        notify(flag, peer, heap, value, op, scope)


@triton.jit
def _after_acquire(token, tma: tl.constexpr):
    """With `tma`, order the async proxy (TMA loads) after the acquire that produced `token`, as the
    generic proxy already is: without the fence a TMA load may read what was there before."""
    if tma:
        if not INTERPRET:
            ptx.fence_proxy_async()
    return token


@triton.jit
def tile_wait_tiles(mapping, flags, first, count, value, cmp: tl.constexpr = CMP_GE, tma: tl.constexpr = False):
    """Wait (acquire) until producer tiles [first, first + count) have their flags, in this rank's
    `flags`, `<cmp> value`; returns a token. For a consumer that reads whole producer tiles.

    Their flags are consecutive: one `wait`, every flag polled in parallel, and no other load. Loads
    through `consume_token(ptr, token)` are ordered after the acquire (on the GPU, all the program's
    later loads: `wait` ends in a CTA barrier); with `tma`, TMA loads issued after the call too.
    """
    return _after_acquire(wait(flags + tile_flag(mapping, first), count, value, cmp), tma)


@triton.jit
def tile_wait(mapping, flags, row0, col0, num_rows, num_cols, value, cmp: tl.constexpr = CMP_GE,
              tma: tl.constexpr = False):
    """Wait (acquire) until every producer tile that holds part of rows [row0, +num_rows) x cols
    [col0, +num_cols) has its flag, in this rank's `flags`, `<cmp> value`; returns a token.

    The consumer's block may have any shape: the producer tiles covering it are found segment by
    segment, and each block row of them is one `wait` on its contiguous flags (polled in parallel;
    in the dense form the shards the rows touch: one `wait`). Loads through `consume_token(ptr,
    token)` are ordered after every one of those acquires; so are all the program's later loads on
    the GPU, where `wait` ends in a CTA barrier; with `tma`, TMA loads issued after the call too.
    The part of the block outside the tensor needs no tile.
    """
    r0 = tl.maximum(row0, 0)
    r1 = tl.minimum(row0 + num_rows, _rows(mapping))
    c0 = tl.maximum(col0, 0)
    c1 = tl.minimum(col0 + num_cols, _cols(mapping))
    if mapping.table is None:
        token = _wait_shards(mapping, flags, r0, r1, c0, c1, value, cmp)
    else:
        token = _wait_segments(mapping, flags, r0, r1, c0, c1, value, cmp)
    return _after_acquire(token, tma)


@triton.jit
def _wait_shards(mapping, flags, r0, r1, c0, c1, value, cmp: tl.constexpr):
    """tile_wait's dense form, for the clipped block [r0, r1) x [c0, c1): a tile spans every column,
    so the block needs the shards [r0 // shard, (r1 - 1) // shard], whose flags are consecutive."""
    token = tl.full([], 0, tl.int32)
    if (r1 > r0) & (c1 > c0):
        first = r0 // mapping.shard
        token = wait(flags + first, (r1 - 1) // mapping.shard - first + 1, value, cmp).to(tl.int32)
    return token


@triton.jit
def _wait_segments(mapping, flags, r0, r1, c0, c1, value, cmp: tl.constexpr):
    """tile_wait's table form, for the clipped block [r0, r1) x [c0, c1)."""
    # (s: along the sharded dimension, o: across it)
    if mapping.SHARD_DIM == 0:
        s0, s1, o0, o1 = r0, r1, c0, c1
        BLOCK_S: tl.constexpr = mapping.BLOCK_M
        BLOCK_O: tl.constexpr = mapping.BLOCK_N
    else:
        s0, s1, o0, o1 = c0, c1, r0, r1
        BLOCK_S: tl.constexpr = mapping.BLOCK_N
        BLOCK_O: tl.constexpr = mapping.BLOCK_M
    token = tl.full([], 0, tl.int32)
    if (s1 > s0) & (o1 > o0):
        n = tl.load(mapping.table + NUM_SEGMENTS)
        across = tl.load(mapping.table + ACROSS)
        starts = _segment_field(mapping, START)
        j0 = o0 // BLOCK_O
        blocks_across = (o1 - 1) // BLOCK_O - j0 + 1
        first_seg = _last_at_or_below(starts, n, s0, mapping.MAX_SEGMENTS)
        last_seg = _last_at_or_below(starts, n, s1 - 1, mapping.MAX_SEGMENTS)
        for seg in range(first_seg, last_seg + 1):
            start = tl.load(starts + seg)
            a = tl.maximum(s0, start) - start  # the part of the range in this segment: [a, b)
            b = tl.minimum(s1, start + tl.load(_segment_field(mapping, SIZE) + seg)) - start
            if b > a:  # empty segments hold no tile
                first = tl.load(_segment_field(mapping, FIRST_TILE) + seg)
                for i in range(a // BLOCK_S, (b - 1) // BLOCK_S + 1):
                    seen = wait(flags + first + i * across + j0, blocks_across, value, cmp)
                    token = tl.maximum(token, seen.to(tl.int32))
    return token


@triton.jit
def tile_push(mapping, tile, src, dst, flags, heap, value, peer, op: tl.constexpr = SIGNAL_SET):
    """Copy producer tile `tile` from local `src` into symmetric `dst` on rank `peer` (ALL_RANKS: on
    every rank, myself included), then raise the tile's flag there (`tile_notify`).

    Both buffers are laid out by the map. The flag is a release after the copy's stores: a rank
    that acquires it (`tile_wait`) sees the tile.
    """
    offsets, mask = tile_offsets(mapping, tile)
    data = tl.load(src + offsets, mask=mask)
    if peer == ALL_RANKS:
        for q in range(num_ranks(heap)):
            tl.store(symm_at(dst, q, heap) + offsets, data, mask=mask)
    else:
        tl.store(symm_at(dst, peer, heap) + offsets, data, mask=mask)
    tile_notify(mapping, tile, flags, heap, value, peer, op)


@triton.jit
def tile_pull(mapping, tile, dst, src, flags, heap, value, cmp: tl.constexpr = CMP_GE):
    """Copy producer tile `tile` from its owner's symmetric `src` into local `dst`, once the owner's
    flag for it is `<cmp> value`; then raise my own flag for it to `value`.

    The producer raises its flag on its own rank (`tile_notify(..., peer=me)`). The wait is an
    acquire on the owner's flag and the loads come after it (`consume_token`); my flag is a release
    after the copy, so consumers here `tile_wait` on pulled tiles exactly as on pushed ones.
    """
    owner = tile_owner(mapping, tile)
    flag = flags + tile_flag(mapping, tile)
    token = wait(symm_at(flag, owner, heap), 1, value, cmp)
    offsets, mask = tile_offsets(mapping, tile)
    data = tl.load(consume_token(symm_at(src, owner, heap), token) + offsets, mask=mask)
    tl.store(dst + offsets, data, mask=mask)
    notify(flag, rank(heap), heap, value)
