"""The fused decode GEMVs (weft/kernels/decode.py) alone, at a model's one-GPU decode shapes (or one rank's at
--tp N), against torch.matmul of the same weight, as a fraction of the copy bandwidth; on one GPU.

    python3 -m weft run -n 1 scripts/bench_gemv.py --out $OUT/bench_gemv.json                   # Qwen3-8B, M 1,8,16,64
    python3 -m weft run -n 1 scripts/bench_gemv.py --sweep --ms 1,8 --samples 10 --out $OUT/bench_gemv_sweep.json
    python3 -m weft run -n 1 scripts/bench_gemv.py --model tiny --ms 1,3 --samples 2 --out /tmp/bench_gemv.json
                                                                                                # cpu smoke run

Per op (norm_qkv_rope: the QKV projection; linear_residual: the O and down projections; norm_gate_up_silu: the
gate/up projection) and rows M: µs per call of the fused op and of torch.matmul(x, W) (cuBLAS: the layers path's
GEMM without its norm, rotary, SiLU or residual kernels), and each as a fraction of the copy bandwidth (a large
device-to-device copy, read + write bytes over its time, measured in the same run): the bytes the op must move
(weight, x, outputs) over its time. Calls replay from a CUDA graph, and go round a set of weight copies larger
than L2, so the weights come from HBM as in a decode step. --layout nk stores every weight K-contiguous (an (N, K)
tensor, nn.Linear's layout, the ops and torch.matmul given its transpose) and scopes the sweep's keys with nk
(`{op}.{K}x{N}.nk.{few|many}.{field}`). --sweep: every launch setting of a grid (weft.tuning
decode.gemv's fields: block_n, block_k, num_stages, num_warps, programs_per_sm, dot) for each fused op and M, set
as that op's weight shape's and row range's keys (`{op}.{K}x{N}.{few|many}.{field}`, weft.kernels.decode.resolve),
best per op and M reported beside cuBLAS, and at the end the keys to write into weft/tuning/data as measured values
(the op's `{op}.{few|many}.{field}` at one GPU's shapes, the shape's at --tp > 1). The default
grid (SWEEP: the dot-free path's tiles, stages and programs per SM, on 4 warps or 8 where 4 would spill, then
tl.dot's; 44 settings at M = 1, 20 at M = 8, where most dot-free tiles would spill; for QKV block_n // 64 heads a
program) is 256 compiles and timings for the four ops at M = 1 and 8, about 4 minutes at ~1 s each (an estimate,
not yet timed); --grid replaces it. Each setting prints as it is timed; GPUs only (the cpu backend keeps its
interpreter settings). The issue's target: >= 95 % of the copy bandwidth at M = 1..16.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import weft  # noqa: E402
from weft import tuning  # noqa: E402
from weft.bench.e2e import MODELS, copy_bandwidth  # noqa: E402
from weft.bench.timing import time_calls  # noqa: E402
from weft.kernels.decode import LAYOUTS, launch_settings  # noqa: E402

L2_BYTES = {"cuda": 256 << 20, "cpu": 0}  # weight bytes cycled through per call: well past an H100/H200's L2
# --sweep's default grid (--grid replaces it), product grids each: the dot-free path (two runs of block_n columns
# a program, block_k rows a step), then tl.dot's. A compile each per op and M.
SWEEP = [dict(dot=(False,), block_n=(64, 128, 256), block_k=(16, 32, 64), num_stages=(2, 4), num_warps=(4, 8),
              programs_per_sm=(2, 4)),
         dict(dot=(True,), block_n=(64, 128), block_k=(128,), num_stages=(3, 4), num_warps=(4,),
              programs_per_sm=(1, 2))]
# fp32 accumulator registers a thread the dot-free path may take (rows x block_k x 2 block_n over the threads):
# above, it spills (ptxas: 187 registers in all at 128, no spills, for one row of 32 x 2 x 256).
FMA_REGISTERS = 128
# The largest relative difference from the layers path a swept setting may show (bf16 roundings give ~1e-3).
MAX_ERROR = 1e-2


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-8B", choices=sorted(MODELS))
    p.add_argument("--ms", default="1,8,16,64", help="rows (tokens) per call")
    p.add_argument("--tp", type=int, default=1,
                   help="the shapes of one rank of this tensor-parallel size (heads and intermediate split)")
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--ops", default=",".join(OPS), help=f"of {', '.join(OPS)}")
    p.add_argument("--layout", default="kn", choices=LAYOUTS,
                   help="how the weights are stored: kn N-contiguous (weft's layout), nk K-contiguous (nn.Linear's; "
                        "the ops get their transposes, and the sweep's keys carry nk)")
    p.add_argument("--sweep", action="store_true", help="every launch setting of a small grid (module doc)")
    p.add_argument("--grid", default=None,
                   help='the sweep\'s grid as JSON, each decode.gemv field a list ({"block_n": [64, 128], ...}), or '
                        'a list of such grids')
    p.add_argument("--out", required=True, help="the JSON report's path")
    return p.parse_args(argv)


class Case:
    """One op at one M: `copies` sets of (weights, inputs); fused() and torch_matmul() run every copy once."""

    def __init__(self, op: str, config: dict, m: int, dtype, device, copies_bytes: int, layout: str):
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        eps = config["rms_norm_eps"]
        k, n = {"qkv": (hidden, (heads + 2 * kv) * d), "o": (heads * d, hidden), "down": (inter, hidden),
                "gate_up": (hidden, 2 * inter)}[op]
        self.op, self.m, self.k, self.n = op, m, k, n
        g = torch.Generator(device).manual_seed(0)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        weight_bytes = k * n * dtype.itemsize
        self.copies = max(1, -(-copies_bytes // weight_bytes))
        if layout == "nk":  # (N, K) stored, the ops given its transpose
            self.weights = [randn(n, k, scale=k ** -0.5).t() for _ in range(self.copies)]
        else:
            self.weights = [randn(k, n, scale=k ** -0.5) for _ in range(self.copies)]
        self.x = randn(m, k)
        out = n // 2 if op == "gate_up" else (n if op != "qkv" else heads * d)
        # What the fused op moves: the weight, x, its output (and for linear_residual the residual; for QKV the
        # new k and v).
        extra = {"o": m * n, "down": m * n, "qkv": 2 * m * kv * d, "gate_up": 0}[op]
        self.bytes = weight_bytes + (m * k + m * out + extra) * dtype.itemsize
        self.matmul_bytes = weight_bytes + (m * k + m * n) * dtype.itemsize
        if op in ("o", "down"):
            res = randn(m, n)
            self.calls = [lambda w=w: weft.ops.linear_residual(self.x, w, res) for w in self.weights]
            self.reference = lambda: ((self.x.float() @ self.weights[0].float()).to(dtype).float()
                                      + res.float()).to(dtype)
        elif op == "gate_up":
            nw = randn(k, scale=0.1) + 1
            self.calls = [lambda w=w: weft.ops.norm_gate_up_silu(self.x, nw, w, eps) for w in self.weights]

            def reference():
                gate, up = (weft.ops.rms_norm(self.x, nw, eps) @ self.weights[0]).chunk(2, dim=-1)
                return torch.nn.functional.silu(gate) * up
            self.reference = reference
        else:
            nw, qw, kw = (randn(dim, scale=0.1) + 1 for dim in (k, d, d))
            theta = config["rope_theta"]
            inv_freq = (1.0 / theta ** (torch.arange(0, d, 2, device=device).float() / d))
            rows = torch.arange(m, device=device)
            positions = torch.full((m,), 511, dtype=torch.int64, device=device)
            k_cache, v_cache = (torch.zeros(m, 512, kv, d, dtype=dtype, device=device) for _ in range(2))
            args = (heads, kv, inv_freq, rows, positions, k_cache, v_cache, qw, kw, eps)
            self.calls = [lambda w=w: weft.ops.norm_qkv_rope(self.x, nw, w, *args) for w in self.weights]

            def reference():
                qkv = weft.ops.rms_norm(self.x, nw, eps) @ self.weights[0]
                return weft.ops.qk_norm_rope(qkv, m, heads, kv, inv_freq, rows, positions, k_cache, v_cache, qw, kw,
                                             eps)
            self.reference = reference

    def fused(self):
        for call in self.calls:
            call()

    def torch_matmul(self):
        for w in self.weights:
            torch.matmul(self.x, w)

    def error(self) -> float:
        """The fused op's relative difference from the layers path's ops (the same weights)."""
        got, want = self.calls[0]().float(), self.reference().float()
        return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


OPS = ("qkv", "o", "gate_up", "down")
NAMES = {"qkv": "norm_qkv_rope", "o": "linear_residual (O)", "gate_up": "norm_gate_up_silu",
         "down": "linear_residual (down)"}


def _time(fns: dict, samples: int) -> dict:
    gpu = weft.device().type == "cuda"
    return time_calls(fns, calls=1, samples=samples, warmup=2, graph=gpu)


def sweep_settings(grid, m: int, head_half: int = 1) -> list[dict]:
    """Every setting of `grid` (a product grid of decode.gemv fields, or a list of them) for m rows, less the
    dot-free ones whose accumulators would spill, or would fit in fewer of the grid's warps (the same tile on fewer
    threads). head_half: QKV's, whose runs are whole half heads (block_n // head_half of them, one at least)."""
    out = []
    for g in grid if isinstance(grid, list) else [grid]:
        for values in itertools.product(*g.values()):
            s = dict(zip(g, values))
            if not s.get("dot", True):
                rows = max(1, 1 << (m - 1).bit_length())
                accumulators = rows * s["block_k"] * 2 * max(s["block_n"], head_half)

                def fits(warps):
                    return accumulators <= FMA_REGISTERS * 32 * warps
                if not fits(s["num_warps"]) or any(fits(w) for w in g["num_warps"] if w < s["num_warps"]):
                    continue
            out.append(s)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    weft.init()
    w = weft.world()
    if w.world_size != 1:
        raise SystemExit("bench_gemv.py runs on one rank: `weft run -n 1`")
    device = w.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dict(MODELS[args.model])
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if config[key] % args.tp:
            raise SystemExit(f"--tp {args.tp} does not divide {key} = {config[key]}")
        config[key] //= args.tp
    bandwidth = copy_bandwidth(device)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"{args.model}, {gpu_name}, copy bandwidth {bandwidth / 1e9:,.0f} GB/s, {dtype}", flush=True)
    rows = []
    ops = [op for op in args.ops.split(",") if op]
    for op in ops:
        if op not in OPS:
            raise SystemExit(f"--ops: {op!r} is not one of {', '.join(OPS)}")
    grid = SWEEP if args.grid is None else json.loads(args.grid)
    table = tuning.value("decode.gemv", device)
    best_keys = {}
    for op, m in itertools.product(ops, [int(v) for v in args.ms.split(",") if v]):
        case = Case(op, config, m, dtype, device, L2_BYTES[device.type], args.layout)
        # linear_residual resolves "down" at K > N, else "o": the bench's op names.
        row_range = 'few' if m <= table.get('few_max_m', 0) else 'many'
        # Each setting tried under this weight shape's scope (the most specific key, whatever the table holds); the
        # keys to write: the op's at one GPU's shapes, the shape's at one rank's of a larger TP size (resolve).
        nk = ".nk" if args.layout == "nk" else ""
        tried = f"{op}.{case.k}x{case.n}{nk}.{row_range}"
        scope = f"{op}{nk}.{row_range}" if args.tp == 1 else tried
        settings = [None]
        if args.sweep:
            settings = sweep_settings(grid, m, config["head_dim"] // 2 if op == "qkv" else 1)
        fused, errors = {}, {}
        for s in settings:
            scoped = {f"{tried}.{field}": v for field, v in (s or {}).items()}
            with tuning.overrides({"decode.gemv": dict(table, **scoped)} if s else {}):
                w.plans.clear()
                try:
                    ms = _time({"fused": case.fused}, args.samples)
                except Exception as e:  # noqa: BLE001 - a setting that does not compile (registers, shared memory)
                    print(f"  {NAMES[op]} M={m} {s}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                    continue
                key = json.dumps(s)
                fused[key], errors[key] = next(iter(ms.values())) / case.copies, case.error()
                if s is not None:
                    print(f"  {NAMES[op]} M={m} {s}: {fused[key] * 1e3:.1f} µs, error {errors[key]:.1e}", flush=True)
            w.plans.clear()
        # A setting whose results are off is no candidate (the error is reported either way).
        right = {k: v for k, v in fused.items() if errors[k] <= MAX_ERROR} or fused
        best, fused_ms = min(right.items(), key=lambda kv: kv[1])
        error = errors[best]
        matmul_ms = _time({"torch.matmul": case.torch_matmul}, args.samples)
        matmul_ms = next(iter(matmul_ms.values())) / case.copies
        row = dict(op=NAMES[op], m=m, k=case.k, n=case.n, fused_us=round(fused_ms * 1e3, 2),
                   fused_bandwidth_fraction=round(case.bytes / (fused_ms * 1e-3) / bandwidth, 3),
                   matmul_us=round(matmul_ms * 1e3, 2),
                   matmul_bandwidth_fraction=round(case.matmul_bytes / (matmul_ms * 1e-3) / bandwidth, 3),
                   error_vs_layers=float(f"{error:.2e}"),
                   settings=json.loads(best) or launch_settings(device, op, m, (case.k, case.n), args.layout))
        if args.sweep:
            row["sweep_us"] = {k: round(v * 1e3, 2) for k, v in sorted(fused.items(), key=lambda kv: kv[1])}
        rows.append(row)
        if args.sweep:
            best_keys.update({f"{scope}.{field}": v for field, v in row["settings"].items()})
        print(f"{row['op']:>24} M={m:<3} fused {row['fused_us']:9.1f} µs {row['fused_bandwidth_fraction']:6.1%}   "
              f"torch.matmul {row['matmul_us']:9.1f} µs {row['matmul_bandwidth_fraction']:6.1%}   "
              f"error {error:.1e}" + (f"   best {best}" if args.sweep else ""), flush=True)
    report = dict(meta=dict(device=gpu_name, torch=torch.__version__, model=args.model, dtype=str(dtype),
                            commit=os.environ.get("WEFT_COMMIT"), sweep=args.sweep, layout=args.layout),
                  copy_bandwidth_gbps=round(bandwidth / 1e9, 1), rows=rows)
    if args.sweep:
        # The best setting of each op and row range, as decode.gemv keys (added to the table's present value).
        report["decode.gemv"] = dict(table, **best_keys)
        print("decode.gemv with the best settings:", json.dumps(report["decode.gemv"]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written to {args.out}")
    weft.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
