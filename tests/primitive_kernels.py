"""Small kernels that exercise each primitive in the patterns that break when ordering is wrong.
Shared by the cpu tests (interpreter) and the gpu tests (compiled)."""
import triton
import triton.language as tl

import weft.language as wl


@triton.jit(do_not_specialize=["epoch"])
def ring_kernel(data, flags, acks, out, heap, n, epoch, BLOCK: tl.constexpr):
    """Each rank writes a payload into its successor's buffer (two slots, by epoch parity),
    notifies, then waits for its predecessor's payload, copies it out and acknowledges it.
    The acknowledgement is the back-pressure: without it a rank may run two epochs ahead
    of its successor and overwrite a slot not yet read."""
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    nxt = (me + 1) % world
    prv = (me + world - 1) % world
    slot = epoch % 2
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    wl.wait(acks + slot, 1, epoch - 2, wl.CMP_GE)  # successor has read this slot's previous payload
    payload = me * 100000 + epoch * 1000 + offs
    tl.store(wl.symm_at(data, nxt, heap) + slot * BLOCK + offs, payload, mask=mask)
    wl.notify(flags + slot, nxt, heap, epoch)
    token = wl.wait(flags + slot, 1, epoch, wl.CMP_EQ)
    src = wl.consume_token(data, token) + slot * BLOCK
    tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)
    wl.notify(acks + slot, prv, heap, epoch)


@triton.jit(do_not_specialize=["epoch"])
def exchange_kernel(table, bar, out, heap, epoch):
    """Every rank stores `epoch * 10 + me` into slot `me` of every peer's table, barrier_all, reads
    the whole table, barrier_all again (so nobody overwrites before everyone has read)."""
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    for q in range(world):
        tl.store(wl.symm_at(table, q, heap) + me, epoch * 10 + me)
    wl.barrier_all(bar, heap)
    for q in range(world):
        tl.store(out + q, tl.load(table + q))
    wl.barrier_all(bar, heap)


@triton.jit(do_not_specialize=["epoch"])
def put_signal_kernel(dst, src, sig, out, heap, nbytes, epoch, MODE: tl.constexpr):
    """Rank r puts `src` into rank r+1's `dst` and signals; MODE 0: putmem_signal_block (SET),
    1: putmem_block + signal_op (ADD), 2: putmem_nbi_block + quiet + signal_op (SET).
    Then waits with signal_wait_until and copies what arrived into `out` with getmem_block
    from its own (rank-local) dst."""
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    nxt = (me + 1) % world
    if MODE == 0:
        wl.putmem_signal_block(dst, src, nbytes, sig, epoch, wl.SIGNAL_SET, nxt, heap)
        token = wl.signal_wait_until(sig, wl.CMP_EQ, epoch)
    elif MODE == 1:
        wl.putmem_block(dst, src, nbytes, nxt, heap)
        wl.signal_op(sig, 1, wl.SIGNAL_ADD, nxt, heap)
        token = wl.signal_wait_until(sig, wl.CMP_GE, epoch)
    else:
        wl.putmem_nbi_block(dst, src, nbytes, nxt, heap)
        wl.quiet()
        wl.signal_op(sig, epoch, wl.SIGNAL_SET, nxt, heap)
        token = wl.signal_wait_until(sig, wl.CMP_GE, epoch)
    wl.getmem_block(out, wl.consume_token(dst, token), nbytes, me, heap)
    wl.barrier_all(sig + 1, heap)  # nobody puts the next epoch before this one is read


@triton.jit
def copy_bytes_kernel(dst, src, nbytes, BLOCK: tl.constexpr):
    wl.copy_bytes(dst, src, nbytes, BLOCK)


@triton.jit
def cmp_kernel(flag, out, heap, value):
    """out[i] = the token of waits that must pass immediately for flag == value."""
    tl.store(out + 0, wl.wait(flag, 1, value, wl.CMP_EQ).to(tl.int32))
    tl.store(out + 1, wl.wait(flag, 1, value - 1, wl.CMP_NE).to(tl.int32))
    tl.store(out + 2, wl.wait(flag, 1, value - 1, wl.CMP_GT).to(tl.int32))
    tl.store(out + 3, wl.wait(flag, 1, value, wl.CMP_GE).to(tl.int32))
    tl.store(out + 4, wl.wait(flag, 1, value + 1, wl.CMP_LT).to(tl.int32))
    tl.store(out + 5, wl.wait(flag, 1, value, wl.CMP_LE).to(tl.int32))
    wl.fence()


@triton.jit
def hardware_kernel(out, heap):
    t0 = wl.global_timer()
    tl.store(out + 0, wl.tid())
    tl.store(out + 1, wl.lane_id())
    tl.store(out + 2, wl.sm_id())
    tl.store(out + 3, wl.rank(heap))
    tl.store(out + 4, wl.num_ranks(heap))
    tl.store(out + 5, (wl.global_timer() >= t0).to(tl.int32))


@triton.jit
def never_signalled_kernel(flag, heap):
    """Rank 1 waits for a flag nobody sets (rank 0 returns at once)."""
    if wl.rank(heap) == 1:
        wl.wait(flag, 1, 1, wl.CMP_EQ)


@triton.jit
def never_flagged_program_kernel(flags, heap):
    """Rank 1 waits for 3 programs' flags of 2 ranks, laid out [program][rank]: every flag is set but
    program 1's from rank 0 (flag 2)."""
    if wl.rank(heap) == 1:
        offs = tl.arange(0, 8)
        tl.store(flags + offs, tl.full([8], 1, tl.int32), mask=(offs < 6) & (offs != 2))
        wl.wait(flags, 6, 1, wl.CMP_EQ, ranks=2)


@triton.jit
def never_arriving_ll_kernel(words, heap):
    """Rank 1 waits for 8 LL words of epoch 1 that nobody writes."""
    if wl.rank(heap) == 1:
        offs = tl.arange(0, 8)
        wl.wait_ll(words + offs, offs < 8, 1)


@triton.jit(do_not_specialize=["epoch"])
def fan_in_kernel(flags, table, out, heap, per_rank, epoch):
    """Every rank writes `per_rank` values into its row of every rank's table, announces each with
    notify_all (flag [me * per_rank + j] on every rank), then one wait covers all W * per_rank flags
    (more than one group of 32 lanes from 9 flags per rank at 4 ranks) and the table is read."""
    me = wl.rank(heap)
    world = wl.num_ranks(heap)
    for j in range(per_rank):
        for q in range(world):
            tl.store(wl.symm_at(table, q, heap) + me * per_rank + j, epoch * 1000 + me * per_rank + j)
        wl.notify_all(flags + me * per_rank + j, heap, epoch)
    token = wl.wait(flags, world * per_rank, epoch, wl.CMP_GE)
    src = wl.consume_token(table, token)
    for i in range(world * per_rank):
        tl.store(out + i, tl.load(src + i))
