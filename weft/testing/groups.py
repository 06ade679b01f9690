"""The group layouts the tests run every op on: what a TP x DP (or EP x TP) job makes of its ranks.

`layouts()` is collective over the world (every rank calls it, in the same order) and returns this rank's
group in each layout, by name:
- "strided":  every other rank ([0, 2], [1, 3] on 4 ranks; asked for in reverse order, which group ranks ignore)
- "pairs":    weft.new_subgroups(2), consecutive ranks ([0, 1], [2, 3]): the TP groups beside "strided"'s DP
- "one":      a group of this rank alone (TP = 1)
- "process_group": a torch.distributed ProcessGroup of the "pairs" ranks, passed to ops as it is
Layouts that the world size cannot make (pairs on 3 ranks) are left out. The world is always there, as None.
"""
from __future__ import annotations

import torch.distributed as dist

from ..runtime import world as _world


def layouts() -> dict:
    w = _world.get()
    n, me = w.world_size, w.rank
    found: dict = {"world": None}
    if n >= 2:
        strided = None
        for start in range(2):
            ranks = list(range(start, n, 2))[::-1]  # reversed: group order unlike world order
            g = _world.new_group(ranks)
            strided = strided or g
        found["strided"] = strided
    if n % 2 == 0 and n >= 2:
        found["pairs"] = _world.new_subgroups(2)
        pg = None
        for first in range(0, n, 2):
            made = dist.new_group([first, first + 1])
            if me in (first, first + 1):
                pg = made
        found["process_group"] = pg
    found["one"] = _world.new_subgroups(1)
    return found


def on_every_layout(call, iterations: int) -> None:
    """call(group, seed, what) on every layout of `layouts()`, in an order shuffled per iteration (the same order
    on every rank: seeded by the iteration, not the rank), so calls on different groups interleave."""
    import random

    found = layouts()
    names = sorted(found)
    for it in range(iterations):
        for name in random.Random(it).sample(names, len(names)):
            call(found[name], it * 10 + names.index(name), f"{name}, iteration {it}")
