"""disagg: disaggregated MoE serving (weft/models/disaggregated.py: attention ranks + expert ranks over M2N, k
micro-batches in ping-pong) against the same model served at the same rank count with every rank doing both:
data-parallel attention and EP experts on weft's EPMoE (ep_dispatch_ll / grouped GEMM / ep_combine_ll).

Per case (batch B over the world, prompt of --context tokens): the decode step latency, the period between
consecutive decode steps' starts within a generation of n + 1 tokens (`_decode_step_ms`), and the decode throughput per GPU
(B tokens per step over W ranks). Both run eagerly (no CUDA graphs), greedy, random weights. Medians of the slowest
rank (weft.bench.timing). Then a timeline of one generation's last decode step: each rank's compute spans (attention
of micro-batch i, layer l; the experts of micro-batch i, layer l) as bars, one row per rank, from CUDA events on
GPUs and perf_counter on cpu ranks, plotted to disagg_<W>_timeline_b<B>_k<k>.png (matplotlib), the spans in the
.json of the same name: the overlap of the two sides is what to look for.

Models: "tiny" (the tests' config) and "qwen3-30b-a3b" (hidden 2048, 32 heads / 4 KV of 128, 128 experts,
top-8, moe inter 768; --layers of its 48, random bf16 weights).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import weft
from weft.models import disaggregated

from .report import Row

SUITE = "disagg"
BASELINE = "EP (DP attention + EPMoE)"
BANDWIDTH = "decode throughput (tokens/s per GPU)"
HEAP_SIZE = "8GiB"
# The baseline's EPMoE: ep_dispatch_ll's receive buffers (E / W experts x W ranks' prefill chunk of 64 tokens) in
# the world's workspace.
WORKSPACE_BYTES = str(1 << 30)
MODELS = {
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                 num_experts=8, num_experts_per_tok=2, vocab_size=96),
    "qwen3-30b-a3b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, vocab_size=151936),
}


def add_arguments(p) -> None:
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="64,256", help="sequences in all (over the world), comma-separated")
    p.add_argument("--context", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=8, help="decode steps timed per generation")
    p.add_argument("--attention-ranks", type=int, default=None, help="default: half the world")
    p.add_argument("--micro-batches", default="2", help="k values of the disaggregated model, comma-separated")
    p.add_argument("--samples", type=int, default=5)


class Timeline:
    """Compute spans of one rank: span(side, what, layer, micro_batch) around each; times in ms from `start()`."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.spans, self.t0 = [], None

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self):
        self.spans, self.t0 = [], self._now()

    @contextlib.contextmanager
    def span(self, side, what, layer, micro_batch):
        begin = self._now()
        yield
        self.spans.append((side, what, layer, micro_batch, begin, self._now()))

    def resolved(self) -> list:
        """[(side, what, layer, micro_batch, start_ms, end_ms)]."""
        if self.cuda:
            torch.cuda.synchronize()
            ms = self.t0.elapsed_time
        else:
            def ms(t):
                return (t - self.t0) * 1e3
        return [(s, w, l, i, ms(a), ms(b)) for s, w, l, i, a, b in self.spans]


def _decode_step_ms(model, ids, n: int, k: int, timeline: Timeline, samples: int) -> float:
    """The decode step's period: on each attention (or colocated) rank, the time between the starts of consecutive
    decode steps' first attention span (layer 0, micro-batch 0) in a generation of n + 1 tokens, its median over the
    steps; the median over `samples` generations of the slowest rank's. (Subtracting a 1-token generation from an
    (n + 1)-token one left the steps inside the prefill's noise at large batches.)"""
    w = weft.world()
    model.generate(ids, 2, micro_batches=k)  # warm-up
    per_sample = []
    for _ in range(samples):
        weft.barrier()
        timeline.start()
        model.generate(ids, n + 1, micro_batches=k, timeline=timeline)
        starts = [s[4] for s in timeline.resolved() if s[:4] == ("attention", "decode", 0, 0)]
        mine = statistics.median(b - a for a, b in zip(starts, starts[1:])) if len(starts) > 1 else None
        every = [None] * w.world_size
        dist.all_gather_object(every, mine, group=w.process_group)
        per_sample.append(max(t for t in every if t is not None))
    return statistics.median(per_sample)


def _config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(num_hidden_layers=args.layers, rms_norm_eps=1e-6, norm_topk_prob=True,
                          **MODELS[args.model])


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def plot_timeline(spans_per_rank, roles, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(spans_per_rank)))
    colors = plt.get_cmap("tab10").colors
    for rank, spans in enumerate(spans_per_rank):
        for side, _, layer, mb, a, b in spans:
            ax.barh(rank, b - a, left=a, color=colors[mb % len(colors)], edgecolor="black", linewidth=0.3)
            if b - a > 0:
                ax.text((a + b) / 2, rank, f"L{layer}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(roles)), [f"rank {r}: {role}" for r, role in enumerate(roles)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (bar colour: micro-batch; label: layer)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> list[Row]:
    w = weft.world()
    world = w.world_size
    attention = args.attention_ranks if args.attention_ranks is not None else max(1, world // 2)
    cfg = _config(args)
    models = {BASELINE: (disaggregated.from_hf(cfg, colocated=True), 1)}
    for k in _ints(args.micro_batches):
        models[f"weft disaggregated {attention}+{world - attention} k={k}"] = (
            disaggregated.from_hf(cfg, attention_ranks=range(attention)), k)
    rows, n = [], args.new_tokens
    if n < 2:
        raise ValueError(f"disagg: --new-tokens must be at least 2 (two decode steps make a period), got {n}")
    timeline = Timeline(w.device)
    for batch in _ints(args.batches):
        ids = torch.randint(0, cfg.vocab_size, (batch, args.context), generator=torch.Generator().manual_seed(batch))
        case = f"{args.model} ({args.layers} layers) decode b{batch} ctx{args.context}"
        usable = {name: mk for name, mk in models.items()
                  if batch % ((world if mk[0].role == "colocated" else attention) * mk[1]) == 0}
        tokens = {name: m.generate(ids, 2, micro_batches=k) for name, (m, k) in usable.items()}
        first = next(iter(tokens.values()))
        for name, got in tokens.items():  # random weights: the same model, the same greedy tokens (bf16: nearly)
            agree = (got == first).float().mean().item()
            if w.rank == 0 and agree < 1:
                print(f"note: {name}'s tokens agree with {BASELINE}'s on {agree:.0%}", flush=True)
        for name, (m, k) in usable.items():
            step = _decode_step_ms(m, ids, n, k, timeline, args.samples)
            per_gpu = batch / (step / 1e3) / world
            rows.append(Row(SUITE, case, name, step, per_gpu, batch, world))
            if w.rank == 0:
                print(f"{case} {name}: {step:.3f} ms per decode step, {per_gpu:,.4g} tokens/s per GPU", flush=True)
        for name, (m, k) in usable.items():  # one generation's spans, its last decode step plotted
            if m.role == "colocated":
                continue
            weft.barrier()
            timeline.start()
            m.generate(ids, 2, micro_batches=k, timeline=timeline)
            spans = [s for s in timeline.resolved() if s[1] == "decode"]
            every = [None] * world
            dist.all_gather_object(every, spans, group=w.process_group)
            roles = [None] * world
            dist.all_gather_object(roles, m.role, group=w.process_group)
            if w.rank == 0:
                start = min((s[4] for spans in every for s in spans), default=0.0)
                every = [[(*s[:4], s[4] - start, s[5] - start) for s in spans] for spans in every]
                os.makedirs(args.out, exist_ok=True)
                stem = os.path.join(args.out, f"{SUITE}_{world}_timeline_b{batch}_k{k}")
                with open(stem + ".json", "w") as f:
                    json.dump({"case": case, "impl": name, "roles": roles, "spans": every}, f)
                plot_timeline(every, roles, stem + ".png", f"{case}: {name}, one decode step")
                print(f"timeline: {stem}.png", flush=True)
    return rows
