"""e2e: a whole tensor-parallel decoder (weft.models) on weft's ops against the same model on NCCL + cuBLAS.

Qwen3-8B, Qwen3-32B and Llama-3-8B shapes with random bf16 weights, every layer (--layers cuts them where memory
forces it), split over all ranks; both implementations share the weights (Transformer.with_comm):
- prefill: --prefill batches × prompt lengths (default 1 × 8192 and 8 × 2048) into a KV cache, to the last
  tokens' logits, eager calls (a prefill is tens of ms of GEMMs);
- decode: one step of every sequence (embedding, every layer with flash_decode over the cache, LM head) at
  --batches (1, 8, 64, 128) and --contexts tokens already cached (512, 4096), replayed from a CUDA graph in
  both (the decode session of weft.models), and the same steps called eagerly (every kernel launched from the
  host; a table of its own, "eager"; --no-eager leaves it out), on one KV cache shared by both; weft on each
  of its decode paths, a row each: "weft (fused)" (weft/kernels/decode.py's GEMVs with the pointwise work
  fused in), "weft (layers)" (the layers' GEMMs and pointwise kernels) and, where it applies (one rank: the
  model's persistent_refusal), "weft (persistent)" (weft/kernels/decode_step.py: every layer in one launch),
  whatever WEFT_DECODE says.
Beside them, for decode:
- "HBM floor": the bytes a step must read on a rank (its weights and the KV cache it attends over,
  Transformer.decode_bytes) over the copy bandwidth measured at the start of the same run (a large
  device-to-device copy, read + write bytes over its time); the table's "best weft vs best HBM floor" is
  the fraction of that floor weft reaches;
- "transformers" (at -n 1 only: its model is not split): transformers' own Qwen3ForCausalLM /
  LlamaForCausalLM of the same config and the same random weights, SDPA attention over a StaticCache of
  the same batch and context, its decode step captured in a CUDA graph (static input ids, position ids
  and cache position) and replayed, as weft's is; where its weights or cache do not fit, left out with a note.
Before timing, each decode case's logits are compared across all of them on the same cache contents
(zeros but the step's own position; bf16: they reduce in different orders), and each prefill case's
across weft and NCCL+cuBLAS. A decode case whose KV cache does not fit the free memory of every rank is
skipped, with a note. Medians of the slowest rank, implementations sampled round-robin
(weft.bench.timing); µs per call.
"""
from __future__ import annotations

import gc

import torch

import weft
from weft.models import DecodeSession, from_hf
from weft.models.weights import RandomWeights, hf_shapes
from weft.testing.graphs import capture

from .report import Row
from .sweep import note
from .timing import time_calls

SUITE = "e2e"
# Decode rows: weft's decode paths (persistent where the model allows it).
WEFT_PATHS = {"fused": "weft (fused)", "layers": "weft (layers)", "persistent": "weft (persistent)"}
BASELINE = "NCCL+cuBLAS"
TRANSFORMERS = "transformers"
FLOOR = "HBM floor"
RIVAL = FLOOR  # "best weft vs best HBM floor": floor time / weft time, the fraction of the floor reached
BANDWIDTH = None  # cases are model steps, not sizes: µs per call, bars
HEAP_SIZE = "4GiB"  # the op workspaces; the rest of the memory holds the weights and the KV caches
# Qwen3's config.json files, but for the weights.
_QWEN3 = dict(model_type="qwen3", num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
              rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu")
MODELS = {
    "Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
    "Qwen3-32B": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64),
    # Llama-3.1-8B's config.json (rope scaling included), but for the weights.
    "Llama-3-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu",
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # The same architecture at a size Triton's interpreter runs (cpu smoke runs of the harness).
    "tiny": dict(_QWEN3, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16, vocab_size=512),
}
# Memory a decode case leaves free besides its KV cache (activations, graph pools, the allocator's slack).
MARGIN_BYTES = 6 << 30
# The random weights (weft.models.from_hf's defaults, given to transformers' model too).
SEED, STD = 0, 0.02
# The copy that measures the memory bandwidth: source bytes (as much again written); small on cpu ranks.
COPY_BYTES = {"cuda": 2 << 30, "cpu": 32 << 20}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(p) -> None:
    p.add_argument("--models", default="Qwen3-8B,Qwen3-32B", help=f"of {', '.join(MODELS)}")
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (default: all)")
    p.add_argument("--prefill", default="1x8192,8x2048", help="BATCHxTOKENS prefill cases ('none': no prefill)")
    p.add_argument("--batches", default="1,8,64,128", help="decode batch sizes")
    p.add_argument("--contexts", default="512,4096", help="decode: tokens already in the cache")
    p.add_argument("--decode", default=None, help="BATCHxCONTEXT decode cases instead of --batches × --contexts")
    p.add_argument("--samples", type=int, default=20, help="samples per decode case")
    p.add_argument("--prefill-samples", type=int, default=5)
    p.add_argument("--no-transformers", action="store_true", help="leave out transformers' model (-n 1)")
    p.add_argument("--no-eager", action="store_true",
                   help="decode: time the CUDA-graph replay only, not also the same steps called eagerly")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# Logits of two implementations of the same weights agree to this (relative; bf16 reduction orders differ).
AGREE = 0.1


def _agree(what: str, got: torch.Tensor, want: torch.Tensor, against: str = BASELINE, impl: str = "weft") -> bool:
    err = _rel(got, want)
    if weft.rank() == 0:
        print(f"{what}: {impl} vs {against} logits differ by {err:.1e} (relative)", flush=True)
    if not err < AGREE and against == BASELINE:
        raise RuntimeError(f"{what}: {impl}'s logits are off by {err:.2e} against {BASELINE}'s")
    return err < AGREE


def copy_bandwidth(device: torch.device, samples: int = 10) -> float:
    """Bytes per second of a large device-to-device copy, read + write bytes counted (the slowest rank's):
    the bandwidth a memory-bound step can reach at best."""
    n = COPY_BYTES[device.type]
    src = torch.ones(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_calls({"copy": lambda: dst.copy_(src)}, calls=5, samples=samples, warmup=3)["copy"]
    return 2 * n / (ms * 1e-3)


class TransformersDecode:
    """transformers' own model of a config and weft's random weights (same names, seed, dtype: the same
    bits), and its decode step over a StaticCache: model(input_ids, position_ids, cache_position,
    past_key_values) with static inputs, as transformers decodes with a static cache; on GPUs the step is
    captured in a CUDA graph (torch's recipe, weft.testing.graphs.capture) and replayed."""

    def __init__(self, config: dict, twin):
        """config: the transformers config dict weft's model `twin` was made of (from_hf, SEED, STD)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype, device = twin.dtype, twin.device
        fields = {k: v for k, v in config.items() if k != "model_type"}
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
        hf_config._attn_implementation = "sdpa"
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
        weights = RandomWeights(hf_shapes(twin.config), SEED, dtype, device, STD)
        with torch.no_grad():
            for name, t in self.model.state_dict().items():  # one tensor at a time: no second copy of the model
                t.copy_(weights[name])

    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())

    def session(self, batch: int, context: int) -> "TransformersDecode.Session":
        return TransformersDecode.Session(self.model, batch, context)

    class Session:
        """One step of `batch` sequences at position `context` (context tokens cached, zeros): `tokens` (batch,)
        in, `logits` (batch, vocab) out; `graph` None where capture failed or off GPUs (then `run` eagerly).
        Every step writes the same position, as weft's replayed step does: transformers' static cache layers
        that count their length themselves (5.2x) are set back to `context` first, in one launch."""

        def __init__(self, model, batch: int, context: int):
            import inspect

            from transformers import StaticCache

            self.model = model
            device = model.device
            self.cache = StaticCache(config=model.config, max_cache_len=context + 1)
            self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
            # transformers 5.x renames forward's arguments from release to release: pass what this one takes.
            takes = inspect.signature(model.forward).parameters
            self.kwargs = {"cache" if "cache" in takes else "past_key_values": self.cache, "use_cache": True,
                           "position_ids": torch.full((batch, 1), context, dtype=torch.int64, device=device)}
            if "cache_position" in takes:
                self.kwargs["cache_position"] = torch.tensor([context], dtype=torch.int64, device=device)
            self.lengths = []
            self.run()  # outside any capture: the static cache's lazy allocation, cuBLAS's handles
            self.cache.reset()  # zeros, as weft's cache in the bench
            self.lengths = [layer.cumulative_length for layer in self.cache.layers
                            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
            self.starts = [torch.full_like(t, context) for t in self.lengths]
            self.graph, self.why_eager = None, "not on a GPU"
            if device.type == "cuda":
                try:
                    self.graph = capture(self.run, warmups=1)
                except Exception as e:  # noqa: BLE001 - a transformers version whose step cannot be captured
                    self.why_eager = f"capture failed: {type(e).__name__}: {e}"

        @torch.no_grad()
        def run(self) -> None:
            if self.lengths:
                torch._foreach_copy_(self.lengths, self.starts)
            self.logits = self.model(input_ids=self.tokens[:, None], **self.kwargs).logits[:, -1]

        def replay(self) -> None:
            (self.run if self.graph is None else self.graph.replay)()


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


def _decode_rows(label, models, hf, cases, samples, bandwidth, w, eager: bool = True) -> list[Row]:
    rows = []
    model = models["weft"]
    cfg = model.config
    for batch, ctx in cases:
        case = f"{label} decode b{batch} ctx{ctx}"
        need = model.decode_bytes(batch, ctx)
        if not _fits(need["kv"], w.device):
            note(f"{case}: skipped, its KV cache ({need['kv'] / 2**30:.1f} GiB) does not fit")
            continue
        cache = model.new_cache(batch, ctx + 1)
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
        # weft on its decode paths (WEFT_DECODE's values), one row each, on the same cache and weights.
        paths = [p for p in WEFT_PATHS if p != "persistent" or model.persistent_refusal() is None]
        sessions = {WEFT_PATHS[path]: DecodeSession(model, cache, path=path) for path in paths}
        sessions[BASELINE] = DecodeSession(models[BASELINE], cache)
        steps = {name: s.run if s.graph is None else s.graph.replay for name, s in sessions.items()}
        graph = all(s.graph is not None for s in sessions.values())
        hf_session = None
        if hf is not None and _fits(need["kv"], w.device):  # its own cache, as large as weft's
            hf_session = hf.session(batch, ctx)
            hf_session.tokens.copy_(tokens)
        elif hf is not None:
            note(f"{case}: {TRANSFORMERS} left out, a second KV cache ({need['kv'] / 2**30:.1f} GiB) does not fit")
        # Every sequence has ctx tokens cached, all zeros here (the same in every implementation's cache):
        # the step attends to ctx + 1 positions, its own written by the step.
        cache.data.zero_()
        logits = {}
        for name, s in sessions.items():
            s.tokens.copy_(tokens)
            s.positions.fill_(ctx)
            steps[name]()
            logits[name] = s.logits.clone()
        for impl in (WEFT_PATHS[p] for p in paths):
            _agree(case, logits[impl], logits[BASELINE], impl=impl)
        if hf_session is not None:
            hf_session.replay()
            if _agree(case, logits[WEFT_PATHS["fused"]], hf_session.logits, TRANSFORMERS, WEFT_PATHS["fused"]):
                eager_only = graph and hf_session.graph is None  # named so: not the same protocol as weft's
                if eager_only:
                    note(f"{case}: {TRANSFORMERS} timed eagerly ({hf_session.why_eager})")
                steps[f"{TRANSFORMERS} (eager)" if eager_only else TRANSFORMERS] = hf_session.replay
            else:
                note(f"{case}: {TRANSFORMERS} left out, its logits differ from weft's by more than {AGREE}")
        floor = (need["weights"] + need["kv"]) / bandwidth * 1e3
        timed = {"graph" if graph else "eager": steps}
        if graph and eager:  # the same steps called eagerly: every kernel launched from the host
            timed["eager"] = {name: s.run for name, s in sessions.items()}
            if TRANSFORMERS in steps:
                timed["eager"][TRANSFORMERS] = hf_session.run
        for view, fns in timed.items():
            times = time_calls(fns, calls=1, samples=samples)
            times[FLOOR] = floor
            for name, ms in times.items():
                rows.append(Row(SUITE, case, name, ms, 0.0, batch, w.world_size, view))
                if w.rank == 0 and name != FLOOR:
                    print(f"{case} {name} ({view}): {ms * 1e3:.0f} µs per step ({batch / ms * 1e3:,.0f} tokens/s, "
                          f"{floor / ms:.0%} of the HBM floor)", flush=True)
        if w.rank == 0:
            print(f"{case} {FLOOR}: {floor * 1e3:.0f} µs per step", flush=True)
        del sessions, steps, hf_session, cache, logits
        gc.collect()
    return rows


def run(args) -> list[Row]:
    w = weft.world()
    rows = []
    prefill = [] if args.prefill == "none" else [tuple(int(x) for x in case.split("x"))
                                                 for case in args.prefill.split(",") if case]
    if args.decode is not None:
        decode = [tuple(int(x) for x in case.split("x")) for case in args.decode.split(",") if case]
    else:
        decode = [(batch, ctx) for ctx in _ints(args.contexts) for batch in _ints(args.batches)]
    labels = args.models.split(",")
    for label in labels:
        if label not in MODELS:
            raise ValueError(f"--models: {label!r} is not one of {', '.join(MODELS)}")
    bandwidth = copy_bandwidth(w.device)
    if w.rank == 0:
        print(f"copy bandwidth (read + write): {bandwidth / 1e9:.4g} GB/s, the HBM floor's", flush=True)
    with_hf = not args.no_transformers and w.world_size == 1
    if not args.no_transformers and w.world_size > 1:
        note(f"{TRANSFORMERS}: its model runs on one device, at -n 1 only")
    for label in labels:
        config = dict(MODELS[label])
        if args.layers:
            config["num_hidden_layers"] = min(args.layers, config["num_hidden_layers"])
            label = f"{label} ({config['num_hidden_layers']} layers)"
        model = from_hf(config, comm="weft", seed=SEED, std=STD)
        models = {"weft": model, BASELINE: model.with_comm("nccl")}
        rows += _prefill_rows(label, models, prefill, args.prefill_samples, w)
        hf = None
        if with_hf:
            if _fits(sum(p.nbytes for p in model.parameters()), w.device):  # the same weights again
                hf = TransformersDecode(config, model)
            else:
                note(f"{label}: {TRANSFORMERS} left out, a second copy of the weights does not fit")
        rows += _decode_rows(label, models, hf, decode, args.samples, bandwidth, w, not args.no_eager)
        del model, models, hf
        gc.collect()
        if w.device.type == "cuda":
            torch.cuda.empty_cache()
        weft.barrier()
    return rows
