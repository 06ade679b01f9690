"""p2p: send / recv between two ranks, and M2N dispatch + combine, against the process group's (NCCL's) own.

send / recv: ranks 0 and 1 ping-pong a message (rank 0 sends, then receives it back; rank 1 receives, then sends);
the other ranks stand by. A call is half a round trip, so µs are one-way latency and GB/s the message's bytes over
that. Rows: "weft kernel" (weft.ops.send / recv on weft's device kernel), "weft via process group" (the same calls
on the process group's route: what WEFT_P2P_KERNEL=0 gives), and the process group's own torch.distributed
send / recv (nccl; gloo on the cpu backend), whatever WEFT_P2P_KERNEL says. Sizes: powers of 4 from 4 KiB.
M2N: m2n_dispatch + m2n_combine of --m2n-tokens tokens x --m2n-hidden bf16 per sender (top-k 1 and 8 over the
receivers, entry j of token t to receiver (t + j) % N), the first half of the ranks senders and the rest
receivers (1 + 1 at 2 ranks), beside two all_to_all_single of the process group moving the same rows there and
back (rows already grouped by receiver: no gather or reduction; every entry's row, k per token), and the NVLink
bound: the bytes a sender sends and gets back, over --link-gbps per direction. Where k > 1 a second bound: the
bytes weft's M2N moves (a token's row once to each receiver it names, one fp32 sum back). GB/s: a sender's bytes
(every entry's row, there and back) over the time.
Two views (--view): CUDA-graph replay and eager back-to-back calls. Medians of the slowest rank
(weft.bench.timing). Every result is checked before it is timed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import weft
from weft.kernels.p2p import forced_route

from . import sweep
from .report import Row, human_bytes
from .timing import time_calls

SUITE = "p2p"
BANDWIDTH = "bandwidth (GB/s) of a message one way; M2N: of a sender's bytes, there and back"
FOCUS = "weft kernel"  # the markdown compares it with the process group's row in every view
# Large slots for the p2p kernel's streams, and M2N's buffers at 4 + 4 ranks ([2][M][rows][hidden] each way).
WORKSPACE_BYTES = str(512 << 20)
LINK_GBPS = 450.0  # NVLink per direction per GPU, H100 / H200 SXM
TOP_KS = (1, 8)


def add_arguments(p) -> None:
    p.add_argument("--min-bytes", type=int, default=4 << 10, help="smallest message (bytes)")
    p.add_argument("--max-bytes", type=int, default=256 << 20, help="largest message (x4 steps from the smallest)")
    p.add_argument("--samples", type=int, default=50, help="timed samples per implementation, case and view")
    p.add_argument("--view", choices=("graph", "eager", "both"), default="both",
                   help="CUDA-graph replay, eager back-to-back calls, or both")
    p.add_argument("--m2n-tokens", type=int, default=128, help="M2N: tokens per sender (0: no M2N rows)")
    p.add_argument("--m2n-hidden", type=int, default=7168, help="M2N: hidden size (bf16)")
    p.add_argument("--link-gbps", type=float, default=LINK_GBPS,
                   help=f"M2N's bound: NVLink GB/s per direction per GPU (default {LINK_GBPS:g})")


def _views(args) -> tuple:
    return ("graph", "eager") if args.view == "both" else (args.view,)


def _time(cases: dict, case: str, nbytes: int, args, bounds: dict | None = None) -> list[Row]:
    """Rows of `cases` {impl: fn} in each view; GB/s = nbytes / time. `bounds` {name: ms}: a row of each too."""
    w = weft.world()
    gpu = w.device.type == "cuda"
    calls = 1 if not gpu else 20 if nbytes < (1 << 20) else 4
    rows = []
    for view in _views(args):
        times = time_calls(cases, calls=calls, samples=args.samples, warmup=3 if gpu else 1,
                           graph=gpu and view == "graph")
        rows += [Row(SUITE, case, name, ms, nbytes / ms / 1e6, nbytes, w.world_size, view)
                 for name, ms in times.items()]
        rows += [Row(SUITE, case, name, ms, nbytes / ms / 1e6, nbytes, w.world_size, view)
                 for name, ms in (bounds or {}).items()]
        weft.barrier()
    return rows


def _ping_pong(send, recv, x, y):
    """One round trip between ranks 0 and 1 as two calls' time: rank 0 sends x and takes y back, rank 1 the
    reverse; the other ranks do nothing."""
    me = weft.rank()

    def call():
        if me == 0:
            send(x, 1)
            recv(y, 1)
        elif me == 1:
            recv(y, 0)
            send(x, 0)
    return call


def _routed(route: bool, op):
    def call(t, peer):
        with forced_route(kernel=route):
            op(t, peer)
    return call


def send_recv_rows(args, baseline: str) -> list[Row]:
    w = weft.world()
    rows = []
    for size in sweep.sizes(args, factor=4):
        n = max(1, size // 2)
        gen = torch.Generator(device=w.device).manual_seed(1 + w.rank)
        x = torch.randn(n, device=w.device, generator=gen).to(torch.bfloat16)
        y = torch.empty_like(x)
        impls = {"weft kernel": (_routed(True, weft.ops.send), _routed(True, weft.ops.recv))}
        if w.device.type == "cuda":  # the cpu backend has the kernel's route only
            impls["weft via process group"] = (_routed(False, weft.ops.send), _routed(False, weft.ops.recv))
        impls[baseline] = (lambda t, p: dist.send(t, p, group=w.group), lambda t, p: dist.recv(t, p, group=w.group))
        # Checked first (this also makes weft's workspace): the peer's message, bit-exact, on ranks 0 and 1.
        want = torch.empty_like(x)
        peer_x = [torch.empty_like(x) for _ in range(w.world_size)]
        dist.all_gather(peer_x, x, group=w.group)
        if w.rank < 2:
            want.copy_(peer_x[1 - w.rank])
        for name, (send, recv) in impls.items():
            y.fill_(float("nan"))
            _ping_pong(send, recv, x, y)()
            if w.rank < 2 and not torch.equal(y.view(torch.int16), want.view(torch.int16)):
                raise RuntimeError(f"{name}: the message received differs from the one sent at {human_bytes(size)}")
        weft.barrier()
        cases = {name: _ping_pong(send, recv, x, y) for name, (send, recv) in impls.items()}
        # Half a round trip a call: time_calls' ms per call over two.
        for r in _time(cases, f"send/recv {human_bytes(n * 2)}", n * 2, args):
            r.ms /= 2
            r.gbps *= 2
            rows.append(r)
    return rows


def m2n_rows(args, baseline: str) -> list[Row]:
    w = weft.world()
    world = w.world_size
    m = world // 2
    senders, receivers = list(range(m)), list(range(m, world))
    n_recv = len(receivers)
    tokens, hidden = args.m2n_tokens, args.m2n_hidden
    sender = w.rank < m
    dev = w.device
    rows = []
    for k in TOP_KS:
        gen = torch.Generator(device=dev).manual_seed(7 + w.rank)
        x = torch.randn(tokens if sender else 0, hidden, device=dev, generator=gen).to(torch.bfloat16)
        t = torch.arange(tokens if sender else 0, device=dev)
        dest = ((t[:, None] + torch.arange(k, device=dev)[None, :]) % n_recv).to(torch.int32)
        weights = torch.full((x.shape[0], k), 1.0 / k, device=dev)

        def weft_m2n():
            recv, counts, handle = weft.ops.m2n_dispatch(x, dest, senders, receivers, tokens)
            return weft.ops.m2n_combine(None if sender else recv, weights if sender else None, handle)

        # The process group's way: rows grouped by receiver, sent there by one all_to_all_single and back by
        # another (sizes per pair known on both ends: the routing above, the same on every rank).
        per_pair = [[sum(1 for tt in range(tokens) for j in range(k) if (tt + j) % n_recv == r - m) if s < m <= r
                     else 0 for r in range(world)] for s in range(world)]
        out_rows = [per_pair[s][w.rank] for s in range(world)]
        in_rows = per_pair[w.rank]
        order = torch.argsort(dest.reshape(-1), stable=True) // max(k, 1) if sender else None
        grouped = x[order] if sender else torch.empty(0, hidden, dtype=x.dtype, device=dev)
        there = torch.empty(sum(out_rows), hidden, dtype=x.dtype, device=dev)
        back = torch.empty(sum(in_rows), hidden, dtype=x.dtype, device=dev)

        def nccl_m2n():
            dist.all_to_all_single(there, grouped, out_rows, in_rows, group=w.group)
            dist.all_to_all_single(back, there, in_rows, out_rows, group=w.group)
            return back

        out = weft_m2n()  # checked: each token's k copies come back, weighted 1 / k each
        if sender:
            torch.testing.assert_close(out.float(), x.float(), rtol=1e-2, atol=1e-2)
        got = nccl_m2n()
        if sender and not torch.equal(got, grouped):
            raise RuntimeError(f"{baseline} all_to_all_single: the rows did not come back intact")
        weft.barrier()
        nbytes = 2 * tokens * k * hidden * x.element_size()  # a sender's rows, there and back
        # What weft moves: a token's row once per receiver it names, back as one row (fp32 sums where k > 1).
        slots = tokens * min(k, n_recv)
        moved = slots * hidden * (x.element_size() + (4 if k > 1 else x.element_size()))
        link = args.link_gbps * 1e9
        case = f"m2n {tokens}x{hidden} top-{k} ({m}+{world - m}; {baseline}: 2 all_to_all_single)"
        bounds = {f"NVLink bound ({args.link_gbps:g} GB/s per direction)": nbytes / link * 1e3}
        if moved != nbytes:
            bounds["NVLink bound, a row once per receiver"] = moved / link * 1e3
        rows += _time({"weft kernel": weft_m2n, baseline: nccl_m2n}, case, nbytes, args, bounds)
    return rows


def run(args) -> list[Row]:
    w = weft.world()
    if w.world_size < 2:
        raise ValueError("weft bench p2p needs at least 2 ranks")
    baseline = dist.get_backend(w.group)
    if w.device.type != "cuda":
        sweep.note("the process group's route of weft.ops.send / recv runs on cuda only: no 'weft via process group' "
                   "rows")
    rows = send_recv_rows(args, baseline)
    if args.m2n_tokens > 0:
        rows += m2n_rows(args, baseline)
    else:
        sweep.note("--m2n-tokens 0: no M2N rows")
    return rows
