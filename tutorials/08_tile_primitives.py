"""Tutorial 08 — tile primitives: an all-gather overlapped with RMSNorm, with no flag arithmetic.

    weft run -n 4 tutorials/08_tile_primitives.py

Every rank holds M rows of x (its shard of a (W * M, D) tensor) and wants RMSNorm of all W * M rows.
A `TileMap` describes the sharded tensor cut into the producer's 8 x 32 tiles; kernels get it as one
argument and speak in tiles:
  producer programs  push one tile of my shard into every rank's `gathered` buffer (`tile_push`):
                     the data, then the tile's flag (a release);
  consumer programs  normalise 16 whole rows as soon as the tiles holding them have arrived
                     (`tile_wait` finds those producer tiles, of another shape, and acquires them all).
Producers come first in the grid: the cpu backend runs a grid's programs in order, so no program
waits on a later one. Flags count epochs and are never reset.
"""
import torch
import triton
import triton.language as tl

import weft
import weft.language as wl
from weft.runtime.tiles import TileMap


@triton.jit(do_not_specialize=["epoch"])
def all_gather_rmsnorm_kernel(mapping, gathered, flags, weight, out, heap, rows, D, epoch, eps,
                              BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    tiles = wl.tile_count(mapping)
    if pid < tiles:  # producer: my own rows of `gathered` hold my shard; push tile pid everywhere
        if wl.tile_owner(mapping, pid) == wl.rank(heap):
            wl.tile_push(mapping, pid, gathered, gathered, flags, heap, epoch, wl.ALL_RANKS)
    else:  # consumer: rows [row0, row0 + BLOCK_ROWS), every column
        row0 = (pid - tiles) * BLOCK_ROWS
        token = wl.tile_wait(mapping, flags, row0, 0, BLOCK_ROWS, D, epoch)
        r = row0 + tl.arange(0, BLOCK_ROWS)[:, None]
        c = tl.arange(0, BLOCK_D)[None, :]
        x = tl.load(wl.consume_token(gathered, token) + r * D + c, mask=(r < rows) & (c < D), other=0.0)
        rms = tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x / rms[:, None] * tl.load(weight + c, mask=c < D)
        tl.store(out + r * D + c, y, mask=(r < rows) & (c < D))


def main():
    weft.init()
    w = weft.world()
    me, world, m, d, block_rows = w.rank, w.world_size, 12, 64, 16
    tiles = TileMap((world * m, d), world, block=(8, 32), device=w.device)  # 12-row shards: tiles of 8 + 4
    gathered = weft.empty((world * m, d), torch.float32)
    flags = weft.zeros((tiles.num_tiles,), torch.int32)
    weight = torch.rand(d, generator=torch.Generator().manual_seed(0)).to(w.device)
    consumers = triton.cdiv(world * m, block_rows)
    for epoch in range(1, 4):
        shards = [torch.randn(m, d, generator=torch.Generator().manual_seed(100 * epoch + q)) for q in range(world)]
        gathered.fill_(float("nan"))
        gathered[me * m:(me + 1) * m] = shards[me].to(w.device)
        weft.barrier()  # every buffer is reset before anyone pushes into it
        out = torch.empty((world * m, d), device=w.device)
        all_gather_rmsnorm_kernel[(tiles.num_tiles + consumers,)](
            tiles.arg, gathered, flags, weight, out, w.heap.descriptor, world * m, d, epoch, 1e-6,
            BLOCK_ROWS=block_rows, BLOCK_D=triton.next_power_of_2(d))
        expected = torch.nn.functional.rms_norm(torch.cat(shards), (d,), weight.cpu(), eps=1e-6)
        torch.testing.assert_close(out.cpu(), expected, msg=f"rank {me}, epoch {epoch}: wrong RMSNorm")
        weft.barrier()  # everyone has read `gathered` before the next epoch overwrites it
    if me == 0:
        print(f"08_tile_primitives: all-gather + RMSNorm on {world} ranks, {tiles.num_tiles} producer tiles of "
              f"8 x 32 consumed in blocks of {block_rows} x {d}, 3 epochs: matches torch")
    weft.finalize()


if __name__ == "__main__":
    main()
