"""e2e: a whole tensor-parallel decoder (weft.models) on weft's ops against the same model on NCCL + cuBLAS.

Qwen3-8B and Qwen3-32B shapes with random bf16 weights, every layer (--layers cuts them where memory
forces it), split over all ranks; both implementations share the weights (Transformer.with_comm):
- prefill: --prefill batches × prompt lengths (default 1 × 8192 and 8 × 2048) into a KV cache, to the last
  tokens' logits, eager calls (a prefill is tens of ms of GEMMs);
- decode: one step of every sequence (embedding, every layer with flash_decode over the cache, LM head) at
  --batches (1, 8, 64, 128) and --contexts tokens already cached (512, 4096), replayed from a CUDA graph in
  both (the decode session of weft.models), on one KV cache shared by both.
Before timing, each case's logits are compared across the two (bf16: they reduce in different orders). A
decode case whose KV cache does not fit the free memory of every rank is skipped, with a note.
Medians of the slowest rank, implementations sampled round-robin (weft.bench.timing); µs per call.
"""
from __future__ import annotations

import gc

import torch

import weft
from weft.models import DecodeSession, from_hf

from .report import Row
from .sweep import note
from .timing import time_calls

SUITE = "e2e"
BASELINE = "NCCL+cuBLAS"
BANDWIDTH = None  # cases are model steps, not sizes: µs per call, bars
HEAP_SIZE = "4GiB"  # the op workspaces; the rest of the memory holds the weights and the KV caches
# Qwen3's config.json files, but for the weights.
_QWEN3 = dict(model_type="qwen3", num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
              rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu")
MODELS = {
    "Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
    "Qwen3-32B": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64),
    # The same architecture at a size Triton's interpreter runs (cpu smoke runs of the harness).
    "tiny": dict(_QWEN3, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16, vocab_size=512),
}
# Memory a decode case leaves free besides its KV cache (activations, graph pools, the allocator's slack).
MARGIN_BYTES = 6 << 30


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(p) -> None:
    p.add_argument("--models", default="Qwen3-8B,Qwen3-32B", help=f"of {', '.join(MODELS)}")
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (default: all)")
    p.add_argument("--prefill", default="1x8192,8x2048", help="BATCHxTOKENS prefill cases")
    p.add_argument("--batches", default="1,8,64,128", help="decode batch sizes")
    p.add_argument("--contexts", default="512,4096", help="decode: tokens already in the cache")
    p.add_argument("--samples", type=int, default=20, help="samples per decode case")
    p.add_argument("--prefill-samples", type=int, default=5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _agree(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = _rel(got, want)
    if weft.rank() == 0:
        print(f"{what}: weft vs {BASELINE} logits differ by {err:.1e} (relative)", flush=True)
    if not err < 0.1:
        raise RuntimeError(f"{what}: weft's logits are off by {err:.2e} against {BASELINE}'s")


def _fits(nbytes: int, device: torch.device) -> bool:
    """Whether every rank has nbytes free and the margin (agreed by all ranks)."""
    if device.type != "cuda":
        return True
    free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN, group=weft.world().group)
    return nbytes + MARGIN_BYTES <= free.item()


def _prefill_rows(label, models, cases, samples, w) -> list[Row]:
    rows = []
    cfg = models["weft"].config
    for batch, seq in cases:
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seq))
        ids = ids.to(w.device)
        cache = models["weft"].new_cache(batch, seq)
        case = f"{label} prefill {batch}×{seq}"
        _agree(case, models["weft"].prefill(ids, cache), models[BASELINE].prefill(ids, cache))
        fns = {name: (lambda m=m, cache=cache: m.prefill(ids, cache)) for name, m in models.items()}
        for name, ms in time_calls(fns, calls=1, samples=samples, warmup=2).items():
            rows.append(Row(SUITE, case, name, ms, 0.0, batch * seq, w.world_size, "eager"))
            if w.rank == 0:
                print(f"{case} {name}: {ms:.2f} ms ({batch * seq / ms * 1e3:,.0f} tokens/s)", flush=True)
    return rows


def _decode_rows(label, models, batches, contexts, samples, w) -> list[Row]:
    rows = []
    cfg = models["weft"].config
    attn = models["weft"].blocks[0].attn
    for ctx in contexts:
        for batch in batches:
            case = f"{label} decode b{batch} ctx{ctx}"
            per_slot = cfg.num_layers * 2 * attn.kv_heads * attn.head_dim * models["weft"].dtype.itemsize
            if not _fits(batch * (ctx + 1) * per_slot, w.device):
                note(f"{case}: skipped, its KV cache ({batch * (ctx + 1) * per_slot / 2**30:.1f} GiB) does not fit")
                continue
            cache = models["weft"].new_cache(batch, ctx + 1)
            tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
            sessions = {name: DecodeSession(m, cache) for name, m in models.items()}
            for s in sessions.values():  # every sequence has ctx tokens cached: the step attends to ctx + 1
                s.tokens.copy_(tokens)
                s.positions.fill_(ctx)
            logits = {}
            for name, s in sessions.items():
                (s.run if s.graph is None else s.graph.replay)()
                logits[name] = s.logits.clone()
            _agree(case, logits["weft"], logits[BASELINE])
            graph = all(s.graph is not None for s in sessions.values())
            fns = {name: s.run if s.graph is None else s.graph.replay for name, s in sessions.items()}
            for name, ms in time_calls(fns, calls=1, samples=samples).items():
                rows.append(Row(SUITE, case, name, ms, 0.0, batch, w.world_size, "graph" if graph else "eager"))
                if w.rank == 0:
                    print(f"{case} {name}: {ms * 1e3:.0f} µs per step ({batch / ms * 1e3:,.0f} tokens/s)", flush=True)
            del sessions, cache, logits
            gc.collect()
    return rows


def run(args) -> list[Row]:
    w = weft.world()
    rows = []
    prefill = [tuple(int(x) for x in case.split("x")) for case in args.prefill.split(",") if case]
    for label in args.models.split(","):
        if label not in MODELS:
            raise ValueError(f"--models: {label!r} is not one of {', '.join(MODELS)}")
        config = dict(MODELS[label])
        if args.layers:
            config["num_hidden_layers"] = min(args.layers, config["num_hidden_layers"])
            label = f"{label} ({config['num_hidden_layers']} layers)"
        model = from_hf(config, comm="weft")
        models = {"weft": model, BASELINE: model.with_comm("nccl")}
        rows += _prefill_rows(label, models, prefill, args.prefill_samples, w)
        rows += _decode_rows(label, models, _ints(args.batches), _ints(args.contexts), args.samples, w)
        del model, models
        gc.collect()
        if w.device.type == "cuda":
            torch.cuda.empty_cache()
        weft.barrier()
    return rows
