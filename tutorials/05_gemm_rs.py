"""Tutorial 05 — GEMM-ReduceScatter and GEMM-AllReduce: send partial products as soon as they are done.

    weft run -n 4 tutorials/05_gemm_rs.py

The row-parallel linear layer of tensor parallelism: every rank holds
a (M, K_local) (the activations, sharded on K) and the matching rows of the
weight, b_shard (K_local, N). The layer's output is the sum over ranks of
a_r @ b_r; with a reduce-scatter, rank r keeps row chunk r of it:

    out on rank r = rows [r * m, (r + 1) * m) of  sum_q a_q @ b_q,     m = M / W.

Done naively (GEMM, then reduce_scatter) the links idle during the GEMM and
the SMs during the reduce-scatter. `weft.ops.gemm_rs` cuts the GEMM by
destination instead: one GEMM per row chunk, the peers' chunks first, and
while the SMs compute the next chunk the copy engines push the finished one
to its owner:

    main stream:  start ─ GEMM chunk me+1 ─ GEMM chunk me+2 ─ ... ─ final GEMM: chunk me + what arrived
    copy stream:                     └ push to me+1 ─┘  └ push to me+2 ─┘ ...

- The pushes are copy-engine transfers (into the peer's symmetric receive
  buffer through NVLink), each followed on the same stream by a stream
  memory operation that writes 1 into the peer's ready flag: the flag lands
  after the data. They take no SM from the GEMMs. Each call's start kernel
  lowers my flags to 0 before the barrier below, so a 1 means "this call's
  tile is here", and a CUDA-graph replay writes the same constant again.
- Chunk order me + 1, me + 2, ...: at each step the W ranks send to W
  different ranks, so no rank's links are the hot spot.
- The last GEMM computes my own chunk. After its first tile's K loop each
  program waits (once) for the W ready flags, then every epilogue adds, in
  rank order and in fp32, its own tile and the peers' tiles from the receive
  buffer, and writes `out`: the reduction costs no pass of its own. Waiting
  inside a GEMM that fills every SM is safe here because every flag it waits
  for is set by a push that depends only on the peers' earlier GEMMs.
- A device barrier starts each call: a peer pushes into my receive buffer
  only after my previous final GEMM has read it. (The copy engine's
  destinations are fixed when the call is issued, or captured in a CUDA
  graph, so the buffer cannot alternate by a device-side epoch parity.)
  The flags are lowered on the device, never by the host, so calls run back
  to back and replay inside CUDA graphs.

Measured on 4 x H200, bf16, 2026-11-21 (`weft bench -n 4 gemm --ops rs`), GEMM-RS
8192 x 4096 x 11008 (per rank 8192 x 4096 x 2752): weft 299 us vs cuBLAS + NCCL
reduce_scatter 433 us and torch's fused op 334 us (cuBLAS alone: 241 us). What
is left above the GEMM: the last push, which the final GEMM waits for, and the
chunk GEMMs' last waves, emptier than one big GEMM's.

The last section: `weft.ops.gemm_ar`, the same layer at decode time (M of a
few tokens) with an all-reduce, fused into one kernel: each program computes
its tile, pushes it to every rank, waits for the W partial tiles of its peers'
same program, and sums them in rank order — the same bits on every rank.
M = 1, N = 5120, K = 25600 (K_local = 6400) on 4 x H200: weft fused 29.8 us vs
cuBLAS + NCCL all_reduce 35.4 us. (`method="auto"` fuses up to 16 rows; the
fused kernel pushes every partial tile to every peer, so from M = 32 on
cuBLAS + all_reduce wins.)
"""
import torch

import weft


def make_operands(rank, call, rows, k, n, dtype, device):
    """Rank `rank`'s (a, b_shard) at call `call`: every rank can recompute every rank's operands."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    a = torch.randn(rows, k, generator=g).to(dtype).to(device)
    b = torch.randn(k, n, generator=g).to(dtype).to(device)
    return a, b


def reference(call, world, rows, k, n, dtype, device):
    """sum over ranks of a_q @ b_q, in fp32."""
    total = torch.zeros(rows, n, device=device)
    for q in range(world):
        a, b = make_operands(q, call, rows, k, n, dtype, device)
        total += a.float() @ b.float()
    return total


def rel_err(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def main():
    weft.init()
    w = weft.world()
    me, world, device = w.rank, w.world_size, w.device
    if device.type == "cuda":  # bf16, shapes worth a GPU
        dtype, (m, k, n), tol = torch.bfloat16, (512, 1024, 1536), 1e-2
    else:                      # the interpreter: fp32, tiny shapes; m = 40 is not a multiple of the 32-row tile
        dtype, (m, k, n), tol = torch.float32, (40, 48, 72), 1e-5
    # TMA needs rows of a multiple of 16 bytes: K_local and N times the element size.
    assert k * dtype.itemsize % 16 == 0 and n * dtype.itemsize % 16 == 0

    # -- GEMM-ReduceScatter: a (W * m, K_local) @ b_shard (K_local, N), rank r keeps rows of chunk r.
    worst = 0.0
    for call in range(3):  # back to back with fresh data, no host barrier: the receive buffer is reused
        a, b_shard = make_operands(me, call, world * m, k, n, dtype, device)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # poisoned
        got = weft.ops.gemm_rs(a, b_shard, out=out)
        assert got is out
        ref = reference(call, world, world * m, k, n, dtype, device)[me * m:(me + 1) * m]
        err = rel_err(got, ref)
        assert err < tol, f"rank {me}, call {call}: relative error {err:.2e} > {tol:.0e}"
        worst = max(worst, err)
    # method="baseline" is the non-overlapped path (torch.matmul, then weft's reduce_scatter): the same result.
    assert rel_err(weft.ops.gemm_rs(a, b_shard, method="baseline"), ref) < tol

    # -- GEMM-AllReduce at decode time: one token, every rank gets the whole (1, N) sum.
    rows = 1
    for call in range(3):
        a, b_shard = make_operands(me, 100 + call, rows, k, n, dtype, device)
        got = weft.ops.gemm_ar(a, b_shard)  # "auto": the fused kernel up to 16 rows
        ref = reference(100 + call, world, rows, k, n, dtype, device)
        err = rel_err(got, ref)
        assert err < tol, f"rank {me}, gemm_ar call {call}: relative error {err:.2e} > {tol:.0e}"
        worst = max(worst, err)
        # Every rank summed the same partials in the same order: the same bits everywhere.
        everyone = weft.ops.all_gather(got)
        assert all(torch.equal(everyone[q * rows:(q + 1) * rows], got) for q in range(world)), \
            f"rank {me}: gemm_ar results differ between ranks"

    weft.barrier()
    if me == 0:
        print(f"05_gemm_rs: gemm_rs ({world * m}, {k}) @ ({k}, {n}) -> ({m}, {n}) per rank and gemm_ar ({rows}, {k}) "
              f"@ ({k}, {n}) in {str(dtype)[6:]} on {world} ranks, 3 calls each, max relative error {worst:.1e}")
    weft.finalize()


if __name__ == "__main__":
    main()
