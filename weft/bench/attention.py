"""attention: decode attention, flash_decode and sp_flash_decode, against torch and a copy of the same bytes.

fd (every rank alone; run it with -n 1): one query token per sequence, bf16, head_dim 128, every sequence
full, for the heads of Llama-3-8B (32 query / 8 KV) and Qwen3-32B (64 / 8), batch x KV length:
- weft flash_decode (contiguous cache), and (--page-size, 16 by default) on a paged cache whose pages lie
  in a shuffled order
- torch scaled_dot_product_attention (enable_gqa; repeated KV heads where that is refused), on the same
  cache seen as (batch, kv_heads, len, head_dim)
- copy (same bytes): a device-to-device copy of the K cache, which reads and writes as many bytes as the
  attention reads: the bandwidth the attention could reach.
sp (all ranks): batch 1, Llama-3-8B heads, global KV length L, rank r holding positions [r L/W, (r+1) L/W).
Run with -n 1 for the 1-GPU row of strong scaling (the whole cache on one GPU), -n W for W GPUs:
- weft sp_flash_decode: the op, split kernel + merge kernel
- weft flash_decode + NCCL all_gather + torch merge: the same partials exchanged by the process group
  (gloo on the cpu backend); sp_flash_decode is checked against it
- weft flash_decode of the local shard: the compute part alone (the slowest rank's median, like every cell)
- weft flash_decode of the local shard, rank r: rank r's own median of the same calls. Their spread is the
  steady skew between ranks; per-call jitter on top of it is not observable from here
- weft sp merge kernel alone (ready partials): sp_flash_decode's merge kernel launched by itself on
  partials the split kernel left (weft.kernels.flash_decode.sp_flash_decode_merge_only), the ranks lined
  up before each sample: the real cost of the cross-rank part (a launch, the local merge, the pushes, one
  NVLink trip, the wait, the final merge), with no skew in it. No bandwidth (0).
How to read them: sp_flash_decode ≈ (slowest rank's local part) + (merge alone) + what rank skew adds,
since the merge waits for the last rank's words; sp minus the slowest-rank local median, less the merge
alone, is roughly what skew and jitter cost per call.
The bandwidth column is KV bytes read per second (GB/s), for sp all ranks' bytes (so it grows with W under
strong scaling); cells are the slowest rank's µs per call (per-rank rows: that rank's). Every result is
checked before timing. Small caches are rotated through several copies so that L2 does not serve them.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import weft
from weft.kernels.flash_decode import flash_decode, sp_flash_decode, sp_flash_decode_merge_only
from weft.testing.reference import all_gather_ref

from .report import Row
from .timing import cycling, time_calls

SUITE = "attention"
BASELINE = "copy (same bytes)"
RIVAL = "torch"
BANDWIDTH = "KV read bandwidth (GB/s)"

MODELS = {"llama3-8b": (32, 8), "qwen3-32b": (64, 8)}  # (query heads, KV heads)
HEAD_DIM = 128
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 << 20  # caches below this are cycled through copies totalling at least this (L2: 50 MiB)
TOLERANCE = 2e-2  # relative error (norm) against torch, bf16
LOCAL = "weft flash_decode of the local shard"
MERGE_ALONE = "weft sp merge kernel alone (ready partials)"


def add_arguments(p) -> None:
    p.add_argument("--ops", default="fd,sp", help="comma-separated subset of fd, sp")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--batches", default="1,8,64", help="fd: batch sizes")
    p.add_argument("--kv", default="4096,8192,32768,131072", help="fd: KV lengths")
    p.add_argument("--sp-kv", default="65536,262144,1048576", help="sp: global KV lengths (batch 1)")
    p.add_argument("--page-size", type=int, default=16, help="fd: also time a paged cache of this page size (0: not)")
    p.add_argument("--max-gib", type=float, default=12.0, help="fd: skip cases whose KV cache is larger")
    p.add_argument("--samples", type=int, default=20)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _check(name: str, case: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    err = _rel_err(got, ref)
    if not err < TOLERANCE:
        raise RuntimeError(f"{case} {name}: relative error {err:.2e} against torch")


def sdpa_decode(q, k, v):
    """torch's attention of q (B, H, D) over a (B, L, KVH, D) cache: enable_gqa, else repeated KV heads."""
    q4, k4, v4 = q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2)
    try:
        return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)[:, :, 0]
    except (TypeError, RuntimeError) as e:
        if isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        group = q.shape[1] // k.shape[2]
        return F.scaled_dot_product_attention(q4, k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1))[:, :, 0]


def _paged(k, v, page_size, gen):
    """k, v copied into pages of `page_size` positions in a shuffled order, and their block table."""
    batch, length, kv_heads, head_dim = k.shape
    per_seq = length // page_size
    table = torch.randperm(batch * per_seq, device=k.device, generator=gen).to(torch.int32).view(batch, per_seq)
    pages = []
    for t in (k, v):
        p = torch.empty((batch * per_seq, page_size, kv_heads, head_dim), dtype=t.dtype, device=t.device)
        p[table.view(-1).long()] = t.reshape(batch * per_seq, page_size, kv_heads, head_dim)
        pages.append(p)
    return pages[0], pages[1], table


def _kv_label(length: int) -> str:
    return f"{length >> 10}K" if length % 1024 == 0 else str(length)


def _fd_case(args, model, batch, length, kv_bytes, dev, gen):
    """The implementations on `sets` copies of the inputs (`impls[name](i)` runs on copy i), `sets`, and the
    first copy's (q, k, v)."""
    q_heads, kv_heads = MODELS[model]
    sets = max(1, min(8, math.ceil(ROTATE_BYTES / kv_bytes)))
    qs, ks, vs = [], [], []
    for _ in range(sets):
        qs.append(torch.randn(batch, q_heads, HEAD_DIM, device=dev, generator=gen).to(DTYPE))
        ks.append(torch.randn(batch, length, kv_heads, HEAD_DIM, device=dev, generator=gen).to(DTYPE))
        vs.append(torch.randn(batch, length, kv_heads, HEAD_DIM, device=dev, generator=gen).to(DTYPE))
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    copies = [torch.empty_like(k) for k in ks]
    impls = {
        "weft flash_decode": lambda i: flash_decode(qs[i], ks[i], vs[i], lens),
        "torch sdpa": lambda i: sdpa_decode(qs[i], ks[i], vs[i]),
        BASELINE: lambda i: copies[i].copy_(ks[i]),
    }
    if args.page_size and length % args.page_size == 0:
        paged = [_paged(k, v, args.page_size, gen) for k, v in zip(ks, vs)]
        impls[f"weft flash_decode (paged {args.page_size})"] = lambda i: flash_decode(qs[i], paged[i][0], paged[i][1],
                                                                                        lens, block_table=paged[i][2])
    return impls, sets, (qs[0], ks[0], vs[0])


def _run_fd(args, rows):
    w = weft.world()
    dev = w.device
    gen = torch.Generator(device=dev).manual_seed(1 + w.rank)
    for model in args.models.split(","):
        for batch in _ints(args.batches):
            for length in _ints(args.kv):
                case = f"{model} b{batch} kv{_kv_label(length)}"
                kv_bytes = 2 * batch * length * MODELS[model][1] * HEAD_DIM * DTYPE.itemsize
                if kv_bytes > args.max_gib * (1 << 30):
                    if w.rank == 0:
                        print(f"{case}: skipped ({kv_bytes / (1 << 30):.1f} GiB of KV > --max-gib)", flush=True)
                    continue
                impls, sets, first = _fd_case(args, model, batch, length, kv_bytes, dev, gen)
                # Checked on the first and the last sequence (torch may need far more memory for the whole batch).
                ends = [0, batch - 1]
                ref = sdpa_decode(*(t[ends] for t in first))
                for name, f in impls.items():
                    if name.startswith("weft"):
                        _check(name, case, f(0)[ends], ref)
                try:
                    impls["torch sdpa"](0)
                except torch.cuda.OutOfMemoryError:
                    if w.rank == 0:
                        print(f"{case}: torch sdpa runs out of memory: not timed", flush=True)
                    del impls["torch sdpa"]
                    torch.cuda.empty_cache()
                _time(args, rows, case, impls, sets, kv_bytes)
                del impls, ref, first
                if dev.type == "cuda":
                    torch.cuda.empty_cache()  # the next case's caches may be large


def lse_merge(parts: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Log-sum-exp merge of W gathered (out | lse) rows: parts (W, rows, head_dim + 1) fp32."""
    out, lse = parts[..., :head_dim], parts[..., head_dim:]
    weight = torch.softmax(lse, dim=0).nan_to_num(0.0)  # an empty slice (lse -inf everywhere) weighs nothing
    return (weight * out).sum(0)


def _run_sp(args, rows):
    w = weft.world()
    dev = w.device
    q_heads, kv_heads = MODELS["llama3-8b"]
    gen = torch.Generator(device=dev).manual_seed(7)  # the same q everywhere
    for length in _ints(args.sp_kv):
        shard = length // w.world_size
        case = f"sp b1 kv{_kv_label(length)} ({w.world_size} x {_kv_label(shard)})"
        kv_bytes = 2 * length * kv_heads * HEAD_DIM * DTYPE.itemsize  # all ranks
        q = torch.randn(1, q_heads, HEAD_DIM, device=dev, generator=gen).to(DTYPE)
        local = torch.Generator(device=dev).manual_seed(100 + w.rank)
        sets = max(1, min(8, math.ceil(ROTATE_BYTES * w.world_size / kv_bytes)))
        ks = [torch.randn(1, shard, kv_heads, HEAD_DIM, device=dev, generator=local).to(DTYPE) for _ in range(sets)]
        vs = [torch.randn(1, shard, kv_heads, HEAD_DIM, device=dev, generator=local).to(DTYPE) for _ in range(sets)]
        lens = torch.full((1,), shard, dtype=torch.int32, device=dev)
        mine = torch.empty(q_heads, HEAD_DIM + 1, device=dev)
        gathered = torch.empty(w.world_size, q_heads, HEAD_DIM + 1, device=dev)

        def process_group(i):
            out, lse = flash_decode(q, ks[i], vs[i], lens, return_lse=True)
            mine[:, :HEAD_DIM] = out[0]
            mine[:, HEAD_DIM] = lse[0]
            all_gather_ref(gathered.view(-1), mine.view(-1), w.group)
            return lse_merge(gathered, HEAD_DIM).to(DTYPE)[None]

        merge, merged = sp_flash_decode_merge_only(q, ks[0], vs[0], lens)
        impls = {
            "weft sp_flash_decode": lambda i: sp_flash_decode(q, ks[i], vs[i], lens),
            f"weft flash_decode + {dist.get_backend(w.group)} all_gather + torch merge": process_group,
            LOCAL: lambda i: flash_decode(q, ks[i], vs[i], lens),
            MERGE_ALONE: lambda i: merge(),
        }
        # Against the process group's exchange of flash_decode's partials (flash_decode is checked in fd).
        want = process_group(0)
        _check("weft sp_flash_decode", case, impls["weft sp_flash_decode"](0), want)
        merged.fill_(float("nan"))
        merge()
        _check(MERGE_ALONE, case, merged, want)
        _time(args, rows, case, impls, sets, kv_bytes, per_rank=(LOCAL,), no_bandwidth=(MERGE_ALONE,))
        del ks, vs


def _time(args, rows, case, impls, sets, kv_bytes, per_rank=(), no_bandwidth=()):
    """A row per impl (the slowest rank's median), and for the impls in `per_rank` a row per rank too (that
    rank's median, impl name + ", rank r"); the impls in `no_bandwidth` get bandwidth 0."""
    w = weft.world()
    gpu = w.device.type == "cuda"
    weft.barrier()
    steps = {name: cycling(f, sets) for name, f in impls.items()}
    calls = max(sets, 20 if kv_bytes < (256 << 20) else 3) if gpu else 1
    times = time_calls(steps, calls=calls, samples=args.samples, warmup=3 if gpu else 1, graph=gpu, per_rank=True)
    for name, ranks in times.items():
        base = name.removesuffix(" (eager)")  # a name time_calls marked: timed eagerly
        cells = [(name, max(ranks))] + ([(f"{name}, rank {r}", ms) for r, ms in enumerate(ranks)]
                                        if base in per_rank else [])
        for impl, ms in cells:
            gbps = 0.0 if base in no_bandwidth else kv_bytes / ms / 1e6
            rows.append(Row(SUITE, case, impl, ms, gbps, kv_bytes, w.world_size))
            if w.rank == 0:
                print(f"{case} {impl}: {ms * 1e3:.1f} us" + (f", {gbps / 1e3:.2f} TB/s" if gbps else ""), flush=True)
    weft.barrier()


def run(args) -> list[Row]:
    rows: list[Row] = []
    ops = args.ops.split(",")
    if "fd" in ops:
        _run_fd(args, rows)
    if "sp" in ops:
        _run_sp(args, rows)
    return rows
