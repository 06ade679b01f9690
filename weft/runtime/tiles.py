"""Host half of the tile layer (weft.language.tile): tile maps built on the host, and the copy engine as a
tile's producer.

`TileMap` does a sharded tensor's tile layout in Python and builds the descriptor kernels read: its `.arg`
is a `weft.language.tile.TileMapping`, the one kernel argument the device primitives (`tile_wait`,
`tile_push`, ...) take. `copy_engine_push` / `CopyEnginePush` produce a tile without a kernel: the copy
engine moves it into a peer's buffer, then its flag is written, in stream order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..language import interpreter
from ..language.tile import TileMapping
from . import streams


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TileMap:
    """Host side of a tile map: the layout's arithmetic in Python, and the descriptor kernels read.

    shape: (rows, cols) of the whole tensor. world_size: ranks it is sharded over. block: the
    producer's (BLOCK_M, BLOCK_N), powers of two. shard_dim: 0 (rows) or 1 (columns) sharded.
    segments: optional sizes along the sharded dimension, rank after rank, world_size * S of them
    (flat or a (world_size, S) table); default: equal shards (the extent must divide evenly).

    Fields: rows, cols, world_size, block, shard_dim; per segment (lists) starts, sizes, owners,
    first_tiles; num_segments, num_tiles, across (blocks across the unsharded dimension);
    descriptor (int32 tensor on `device`) and arg (the `TileMapping` kernels take).
    """

    def __init__(self, shape, world_size: int, block, shard_dim: int = 0, segments=None, device="cpu"):
        rows, cols = (int(s) for s in shape)
        if rows < 0 or cols < 0:
            raise ValueError(f"shape must be non-negative, got {tuple(shape)}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        bm, bn = (int(b) for b in block)
        if bm < 1 or bn < 1 or bm & (bm - 1) or bn & (bn - 1):
            raise ValueError(f"block must be two powers of two, got {tuple(block)}")
        if shard_dim not in (0, 1):
            raise ValueError(f"shard_dim must be 0 or 1, got {shard_dim}")
        extent = (rows, cols)[shard_dim]
        if segments is None:
            if extent % world_size:
                raise ValueError(f"dimension {shard_dim} ({extent}) does not divide over {world_size} ranks: "
                                 "pass segments")
            sizes = [extent // world_size] * world_size
        else:
            sizes = [int(s) for s in torch.as_tensor(segments).reshape(-1).tolist()]
            if not sizes or len(sizes) % world_size or min(sizes) < 0 or sum(sizes) != extent:
                raise ValueError(f"segments must be world_size * S sizes >= 0 summing to dimension {shard_dim} "
                                 f"({extent}), got {sizes}")
        self.rows, self.cols, self.world_size, self.block, self.shard_dim = rows, cols, world_size, (bm, bn), shard_dim
        per_rank = len(sizes) // world_size
        block_split, block_across = (bm, bn) if shard_dim == 0 else (bn, bm)
        self.across = _cdiv((cols, rows)[shard_dim], block_across)
        self.sizes, self.starts, self.owners, self.first_tiles = sizes, [], [], []
        start = tile = 0
        for s, size in enumerate(sizes):
            self.starts.append(start)
            self.owners.append(s // per_rank)
            self.first_tiles.append(tile)
            start += size
            tile += _cdiv(size, block_split) * self.across
        self.num_segments, self.num_tiles = len(sizes), tile
        # language.tile's layout: ROWS, COLS, NUM_SEGMENTS, NUM_TILES, ACROSS, then START, SIZE, OWNER, FIRST_TILE
        header = [rows, cols, self.num_segments, self.num_tiles, self.across]
        self.descriptor = torch.tensor(header + self.starts + self.sizes + self.owners + self.first_tiles,
                                       dtype=torch.int32, device=device)
        self.arg = TileMapping(self.descriptor, tl.constexpr(bm), tl.constexpr(bn), tl.constexpr(shard_dim),
                               tl.constexpr(triton.next_power_of_2(self.num_segments)))

    def _segment(self, tile: int) -> int:
        if not 0 <= tile < self.num_tiles:
            raise ValueError(f"tile must be in [0, {self.num_tiles}), got {tile}")
        return max(s for s in range(self.num_segments) if self.first_tiles[s] <= tile)

    def owner(self, tile: int) -> int:
        return self.owners[self._segment(tile)]

    def rect(self, tile: int):
        """(row0, col0, num_rows, num_cols) of a producer tile."""
        s = self._segment(tile)
        i, j = divmod(tile - self.first_tiles[s], self.across)
        bs, bo = self.block if self.shard_dim == 0 else self.block[::-1]
        split = (self.starts[s] + i * bs, min(bs, self.sizes[s] - i * bs))
        other = (j * bo, min(bo, (self.cols, self.rows)[self.shard_dim] - j * bo))
        (r0, nr), (c0, nc) = (split, other) if self.shard_dim == 0 else (other, split)
        return r0, c0, nr, nc

    def offset(self, tile: int) -> int:
        """Element offset of the tile's first element in a buffer laid out by the map."""
        r0, c0, _, _ = self.rect(tile)
        return r0 * self.cols + c0

    def flag(self, tile: int) -> int:
        return tile

    def tiles_of(self, rank: int) -> list[int]:
        """The producer tiles rank `rank` owns."""
        return [t for t in range(self.num_tiles) if self.owner(t) == rank]

    def cover(self, row0: int, col0: int, num_rows: int, num_cols: int) -> list[int]:
        """The producer tiles that hold some element of rows [row0, +num_rows) x cols [col0, +num_cols)."""
        out = []
        for t in range(self.num_tiles):
            r, c, nr, nc = self.rect(t)
            if r < row0 + num_rows and row0 < r + nr and c < col0 + num_cols and col0 < c + nc:
                out.append(t)
        return out


# -- the copy engine as a tile's producer ---------------------------------------------

def copy_engine_push(dst: torch.Tensor, src: torch.Tensor, flag: torch.Tensor, value) -> None:
    """Host code, the copy engine's `tile_push`: copy tile `src` into `dst`, its place in a peer's buffer
    (a `heap.peer` view), then `value` into `flag`, that peer's flag of the tile; both on the current
    stream, taking no SM. `value`: an int, written by a stream memory operation (the cheapest to issue,
    and a CUDA-graph replay writes it again: for flags that the consumer's side lowers between calls), or
    a one-element device tensor, copied (a device-side epoch, which a replay sends anew).

    Memory ordering: stream order starts the flag's write only once the data's copy has completed, so a
    rank that acquires the flag (`tile_wait`, `tile_wait_tiles`) sees the tile. On the cpu backend both are
    plain copies, in that order, after a stall point of WEFT_TEST_DELAY.
    """
    if not dst.is_cuda:
        interpreter.stall()
    streams.device_copy(dst, src)
    if isinstance(value, torch.Tensor):
        streams.device_copy(flag, value)
    else:
        streams.write_word(flag, value)


class CopyEnginePush:
    """`copy_engine_push(dst, src, flag, value)` with its destination, flag and int value fixed, as an op's
    plan keeps it: a call names only the source (contiguous, dst's size and dtype) and issues two driver
    operations on the current stream, addresses taken once."""

    def __init__(self, dst: torch.Tensor, flag: torch.Tensor, value: int):
        self.dst, self.flag, self.value = dst, flag, int(value)
        self.gpu = dst.is_cuda and streams.has_driver()
        if self.gpu:
            self.dst_at, self.flag_at = dst.data_ptr(), flag.data_ptr()
            self.nbytes, self.device = dst.numel() * dst.element_size(), dst.device.index

    def __call__(self, src: torch.Tensor, stream: int | None = None) -> None:
        """On `stream` (a raw handle; default the current stream)."""
        if self.gpu:
            if stream is None:
                stream = streams.raw_stream(self.device)
            streams.copy_bytes(self.dst_at, src.data_ptr(), self.nbytes, stream)
            streams.write_word_at(self.flag_at, self.value, stream)
        else:
            copy_engine_push(self.dst, src, self.flag, self.value)
