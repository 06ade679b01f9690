"""Tutorial 01 — notify / wait: a producer/consumer queue across ranks.

    weft run -n 4 tutorials/01_notify_wait.py

Every rank produces a stream of messages for its successor in a ring and
consumes the stream of its predecessor. The queue lives in the consumer's
symmetric heap: SLOTS message slots plus two counters.

  producer:  wait until the consumer has freed slot i % SLOTS (its `tail`
             counter, which it publishes into *our* heap), write the message
             into the consumer's slot with plain stores, then `notify` the
             consumer's `head` = i + 1. notify is a release: the message
             stores are visible before the counter is.
  consumer:  `wait` until head >= i + 1 (acquire), read the slot through
             `consume_token` (so the loads are ordered after the wait), then
             notify the producer's copy of `tail` = i + 1.

The loop interleaves producing item i and consuming item i, so no rank ever
waits on work that its own program has not yet reached (the cpu backend runs
a grid's programs one after another).
"""
import torch
import triton
import triton.language as tl

import weft
import weft.language as wl


@triton.jit
def queue_kernel(slots, head, tail, received, heap, n_items, SLOTS: tl.constexpr, WIDTH: tl.constexpr):
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    succ = (me + 1) % world
    pred = (me + world - 1) % world
    cols = tl.arange(0, WIDTH)
    for i in range(n_items):
        # -- produce item i into my successor's queue
        wl.wait(tail, 1, i - SLOTS + 1, wl.CMP_GE)          # successor freed the slot we reuse
        message = me * 1_000_000 + i * 100 + cols
        slot = wl.symm_at(slots, succ, heap) + (i % SLOTS) * WIDTH
        tl.store(slot + cols, message)
        wl.notify(head, succ, heap, i + 1)                  # release: message first, then the count
        # -- consume item i from my predecessor
        token = wl.wait(head, 1, i + 1, wl.CMP_GE)           # acquire
        mine = wl.consume_token(slots, token) + (i % SLOTS) * WIDTH
        tl.store(received + i * WIDTH + cols, tl.load(mine + cols))
        wl.notify(tail, pred, heap, i + 1)                  # the slot can be reused


def main():
    weft.init()
    w = weft.world()
    slots_n, width, n_items = 4, 16, 24
    slots = weft.zeros((slots_n * width,), torch.int32)
    head = weft.zeros((1,), torch.int32)  # written by my predecessor
    tail = weft.zeros((1,), torch.int32)  # written by my successor
    weft.barrier()                        # counters are zero everywhere before anyone signals
    received = torch.full((n_items * width,), -1, dtype=torch.int32, device=w.device)
    queue_kernel[(1,)](slots, head, tail, received, w.heap.descriptor, n_items, SLOTS=slots_n, WIDTH=width)

    pred = (w.rank - 1) % w.world_size
    items = torch.arange(n_items).view(-1, 1) * 100 + torch.arange(width)
    expected = (pred * 1_000_000 + items).to(torch.int32).view(-1)
    assert torch.equal(received.cpu(), expected), f"rank {w.rank}: queue delivered the wrong messages"
    weft.barrier()
    if w.rank == 0:
        print(f"01_notify_wait: {n_items} messages through a {slots_n}-slot queue on each of "
              f"{w.world_size} ranks, in order and intact")
    weft.finalize()


if __name__ == "__main__":
    main()
