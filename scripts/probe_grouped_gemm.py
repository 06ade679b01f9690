"""Config sweep of weft's grouped GEMM (weft.ops.grouped_gemm) against torch._grouped_mm and a torch.matmul loop.

    python3 scripts/probe_grouped_gemm.py            # 1 GPU, under 5 minutes; JSON to $OUT/probe_grouped_gemm.json
    python3 scripts/probe_grouped_gemm.py --scale 32 # cpu smoke run (interpreter): shapes cut 32-fold
    python3 scripts/probe_grouped_gemm.py --fp8      # the fp8 kernel (block scales) and its configs

For each shape (experts x rows per expert, K -> N, bf16) every config is first checked against torch.bmm on
the rows under the counts (the rows past them hold NaN, which must not leak), then the configs that pass are
timed together with the torch baselines by weft.bench.timing (CUDA-graph replay, samples round-robin).
A config that does not compile or fit shared memory is reported as such. "default" is what the plan picks
with no config (weft/kernels/moe/grouped_gemm.py: grouped_config); TFLOP/s count the rows under the counts only.
--fp8: the same values quantized as DeepSeek-V3 does (rows per 128 channels, weights per 128 x 128 block:
fp8_rows / fp8_blocks), checked against the product of the dequantized values, and timed with the fp8 configs
against torch._grouped_mm on the bf16 values and torch._scaled_grouped_mm (rowwise fp8) where it runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft.bench.moe import TorchGrouped, torch_scaled_grouped  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402
from weft.kernels.gemm import GemmConfig  # noqa: E402
from weft.kernels.moe.grouped_gemm import CPU_CONFIG, grouped_config  # noqa: E402

# (name, experts, rows per expert, K, N, counts): "full" gives every expert its rows, "uneven" random counts
# in [0, rows] with two empty experts, "few" 16 to 48 of them (EPMoE's decode buffers: W * 128 rows, ~32 used),
# "decode" 2 to 14 (Qwen3-30B-A3B's 128 experts at 128 tokens per rank, top-8: ~8 rows an expert; the weights'
# bytes are the whole cost).
SHAPES = [
    ("DeepSeek-ish gate 32x256 7168->2048", 32, 256, 7168, 2048, "full"),
    ("DeepSeek-ish down 32x256 2048->7168", 32, 256, 2048, 7168, "full"),
    ("Qwen3-30B-A3B gate_up 128x512 2048->1536", 128, 512, 2048, 1536, "full"),
    ("Qwen3-30B-A3B down 128x512 768->2048", 128, 512, 768, 2048, "full"),
    ("Mixtral w1|w3 8x2048 4096->14336", 8, 2048, 4096, 14336, "full"),
    ("Mixtral w2 8x2048 14336->4096", 8, 2048, 14336, 4096, "full"),
    ("uneven 32x<=512 7168->2048", 32, 512, 7168, 2048, "uneven"),
    ("EP decode-like 32x~32 of 1024 7168->2048", 32, 1024, 7168, 2048, "few"),
    ("Qwen3 EP decode gate_up 128x~8 of 256 2048->1536", 128, 256, 2048, 1536, "decode"),
    ("Qwen3 EP decode down 128x~8 of 256 768->2048", 128, 256, 768, 2048, "decode"),
]

# BLOCK_M 64/128, BLOCK_N 128/256, BLOCK_K 64, 3/4 stages, 4/8 warps: the combinations whose accumulator fits
# the registers of their warps (128x256 needs 8) and whose stages fit shared memory; the dense GEMM's H200
# config also with its tile and K loops fused; the smallest tile also 2 programs per SM; for the weight-bound
# decode shapes, 64-row tiles with their loops fused, deeper K blocks or more stages (more bytes in flight).
GPU_SWEEP = [
    GemmConfig(64, 128, 64, 8, 3, 4, False), GemmConfig(64, 128, 64, 8, 4, 4, False),
    GemmConfig(64, 256, 64, 8, 3, 4, False), GemmConfig(64, 256, 64, 8, 4, 4, False),
    GemmConfig(128, 128, 64, 8, 3, 8, False), GemmConfig(128, 128, 64, 8, 4, 8, False),
    GemmConfig(128, 128, 64, 8, 4, 4, False), GemmConfig(64, 128, 64, 8, 4, 4, False, 2),
    GemmConfig(128, 256, 64, 8, 3, 8, False), GemmConfig(128, 256, 64, 8, 3, 8, True),
    GemmConfig(64, 128, 64, 8, 4, 4, True), GemmConfig(64, 128, 128, 8, 3, 4, False),
    GemmConfig(64, 128, 128, 8, 4, 4, True), GemmConfig(64, 256, 64, 8, 4, 4, True),
    GemmConfig(64, 128, 64, 8, 6, 4, True),
]
CPU_SWEEP = [CPU_CONFIG, GemmConfig(32, 32, 32, 1, 1, 4, False)]
# fp8: K slices of 128 (a scale block) or 64, 128 or 64 columns (within a weight scale block; 256 would hold two
# fp32 accumulators of 128x256 in registers), 3/4 stages; tiles of 4 warps also 2 programs per SM (their
# registers and stages fit twice: one program's MMAs then run under the other's scaling FMAs).
FP8_SWEEP = [
    GemmConfig(128, 128, 128, 8, 3, 8, False), GemmConfig(128, 128, 128, 8, 4, 8, True),
    GemmConfig(64, 128, 128, 8, 4, 4, False), GemmConfig(64, 128, 128, 8, 3, 4, False, 2),
    GemmConfig(64, 128, 128, 8, 4, 4, False, 2), GemmConfig(64, 128, 128, 8, 3, 4, True, 2),
    GemmConfig(128, 64, 128, 8, 4, 4, False), GemmConfig(128, 64, 128, 8, 3, 4, False, 2),
    GemmConfig(128, 64, 128, 8, 4, 4, True, 2),
]
CPU_FP8_SWEEP = [CPU_CONFIG, GemmConfig(16, 32, 128, 1, 1, 4, False)]
SMEM_BYTES = 232448  # an H100 / H200 block's shared memory


def smem(cfg: GemmConfig, size: int = 2) -> int:
    """Shared memory of a program of the TMA kernel: the stages of x and w tiles (`size` bytes an element), the
    bf16 output tile."""
    return size * cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k + 2 * cfg.block_m * cfg.block_n


def make_case(experts, rows, k, n, kind, dev, gen):
    """x (E, C, K) with NaN past the counts, w (E, K, N), counts; the reference and the rows it holds."""
    x = torch.randn(experts, rows, k, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(experts, k, n, device=dev, generator=gen) / k ** 0.5).to(torch.bfloat16)
    if kind == "full":
        counts = torch.full((experts,), rows, dtype=torch.int32, device=dev)
    elif kind in ("few", "decode"):
        lo, hi = (16, 48) if kind == "few" else (2, 14)
        counts = torch.randint(min(lo, rows), min(hi, rows) + 1, (experts,), device=dev, dtype=torch.int32,
                               generator=gen)
    else:
        counts = torch.randint(0, rows + 1, (experts,), device=dev, dtype=torch.int32, generator=gen)
        counts[1] = counts[experts // 2] = 0
    live = torch.arange(rows, device=dev)[None, :] < counts[:, None]
    x[~live] = float("nan")
    ref = torch.bmm(torch.where(live[..., None], x, 0), w)
    return x, w, counts, ref, live


def max_error(out, ref, live) -> float:
    return (out.float() - ref.float()).abs()[live].max().item() if bool(live.any()) else 0.0


def probe(name, experts, rows, k, n, kind, sweep, args, dev, gen, deadline) -> list[dict]:
    x, w, counts, ref, live = make_case(experts, rows, k, n, kind, dev, gen)
    sizes = counts.tolist()
    flops = 2.0 * sum(sizes) * k * n
    scales = {}
    if args.fp8:  # the operands quantized; the reference from their dequantized values
        xq, xs = weft.ops.fp8_rows(x)
        wq, ws = weft.ops.fp8_blocks(w)
        scales = dict(x_scales=xs, w_scales=ws)
        wd = (wq.float() * ws.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :, :n]).to(torch.bfloat16)
        ref = torch.bmm(torch.where(live[..., None], xq.float() * xs.repeat_interleave(128, -1), 0)
                        .to(torch.bfloat16), wd)
    a, b = (xq, wq) if args.fp8 else (x, w)
    default = grouped_config(rows, a.dtype, dev, True)
    results, impls = [], {}
    configs = [("default", None)] + [(c.label(), c) for c in sweep if c != default]
    for cname, cfg in configs:
        row = dict(shape=name, impl="weft", config=cname if cfg is not None else f"default ({default.label()})")
        if dev.type == "cuda" and time.monotonic() > deadline and cfg is not None:
            results.append(dict(row, status="skipped (time)"))
            continue
        need = smem(cfg, a.element_size()) * cfg.programs_per_sm if cfg is not None else 0
        if dev.type == "cuda" and need > SMEM_BYTES:
            results.append(dict(row, status=f"skipped ({need >> 10} KiB of shared memory an SM)"))
            continue
        try:
            out = weft.ops.grouped_gemm(a, b, counts, config=cfg, **scales)
            err = max_error(out, ref, live)
        except Exception as e:  # noqa: BLE001 - a config that does not compile or launch: reported, not fatal
            results.append(dict(row, status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
            continue
        ok = err <= 5e-2  # outputs ~N(0, 1): bf16 rounding of the product stays well under this
        results.append(dict(row, status="ok" if ok else f"WRONG (max error {err:.3g})", max_error=err))
        if ok:
            impls[row["config"]] = lambda cfg=cfg: weft.ops.grouped_gemm(a, b, counts, config=cfg, **scales)
    grouped = TorchGrouped(dev)
    packed = torch.cat([x[e, :m] for e, m in enumerate(sizes)])
    ends = counts.cumsum(0, dtype=torch.int32)
    if grouped.grouped:
        impls["torch._grouped_mm"] = lambda: grouped(packed, w, ends)
    out = torch.empty_like(ref)
    if args.fp8:
        scaled = torch_scaled_grouped(packed, w, ends, torch.bmm(torch.where(live[..., None], x, 0), w), sizes)
        if scaled is not None:
            impls["torch._scaled_grouped_mm (rowwise fp8)"] = scaled

    def loop():
        for e, m in enumerate(sizes):
            torch.matmul(x[e, :m], w[e], out=out[e, :m])

    impls["torch.matmul loop"] = loop
    times = time_calls(impls, calls=args.calls, samples=args.samples, warmup=2, graph=dev.type == "cuda")
    for r in results:
        ms = times.get(r["config"])
        if ms is not None:
            r.update(ms=ms, tflops=flops / ms / 1e9)
    results += [dict(shape=name, impl=impl, config="", status="ok", ms=ms, tflops=flops / ms / 1e9)
                for impl, ms in times.items() if impl.startswith("torch")]
    return results


def table(results: list[dict]) -> str:
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = [r for r in results if r["shape"] == shape]
        base = next((r["ms"] for r in rows if r["impl"].startswith("torch._grouped_mm")), None)
        lines += [f"\n## {shape}", f"| {'impl / config':<40} | {'us':>8} | {'TFLOP/s':>7} | {'vs _grouped_mm':>14} | check",
                  f"|{'-' * 42}|{'-' * 10}|{'-' * 9}|{'-' * 16}|------"]
        for r in sorted(rows, key=lambda r: r.get("ms", float("inf"))):
            what = r["config"] if r["impl"] == "weft" else r["impl"]
            if "ms" in r:
                ratio = f"{base / r['ms']:.2f}x" if base else "-"
                lines.append(f"| {what:<40} | {r['ms'] * 1e3:8.1f} | {r['tflops']:7.1f} | {ratio:>14} | {r['status']}")
            else:
                lines.append(f"| {what:<40} | {'-':>8} | {'-':>7} | {'-':>14} | {r['status']}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=1, help="divide rows, K and N by this (cpu smoke runs)")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--fp8", action="store_true", help="the fp8 kernel (block scales) and its configs")
    p.add_argument("--shapes", default="", help="only the shapes whose name holds one of these comma-separated words")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="after this many seconds only the default config and the torch baselines are timed")
    args = p.parse_args()
    world = weft.init(heap_size=64 << 20, workspace_bytes=1 << 20)
    dev = world.device
    if dev.type == "cuda":
        print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    sweep = {(True, False): GPU_SWEEP, (False, False): CPU_SWEEP, (True, True): FP8_SWEEP,
             (False, True): CPU_FP8_SWEEP}[dev.type == "cuda", args.fp8]
    gen = torch.Generator(device=dev).manual_seed(0)
    deadline = time.monotonic() + args.budget_s
    results = []
    words = [w for w in args.shapes.split(",") if w]
    for name, experts, rows, k, n, kind in SHAPES:
        if words and not any(w in name for w in words):
            continue
        if args.scale > 1:
            cut = lambda v, step=16: max(step, v // args.scale // step * step)  # noqa: E731
            experts, rows, k, n = max(2, experts // args.scale), cut(rows), cut(k, 128 if args.fp8 else 16), cut(n)
            name = f"{name} /{args.scale}"
        t0 = time.monotonic()
        found = probe(name, experts, rows, k, n, kind, sweep, args, dev, gen, deadline)
        results += found
        print(table(found), f"\n({time.monotonic() - t0:.1f} s)", flush=True)
    best = {}
    for r in results:
        if r["impl"] == "weft" and "ms" in r and r["ms"] < best.get(r["shape"], {}).get("ms", float("inf")):
            best[r["shape"]] = r
    print("\n## best weft config per shape")
    for shape, r in best.items():
        base = next((b["ms"] for b in results if b["shape"] == shape and b["impl"] == "torch._grouped_mm"), None)
        vs = f", {base / r['ms']:.2f}x torch._grouped_mm" if base else ""
        print(f"{shape}: {r['config']} {r['ms'] * 1e3:.1f} us{vs}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"probe_grouped_gemm{'_fp8' if args.fp8 else ''}.json"), "w") as f:
            json.dump(results, f, indent=1)
    weft.finalize()
    return 1 if any(r["status"].startswith("WRONG") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
