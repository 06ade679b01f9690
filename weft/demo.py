"""The main demo (`weft demo`, `make demo`): a Qwen3 decoder split over every rank, generating text.

On GPUs: a Qwen3-8B-shaped model (random bf16 weights, or a local checkpoint with --model PATH) over all
GPUs generates --new-tokens tokens for a batch of prompts, once on weft's ops and once on the NCCL +
cuBLAS tensor parallelism of the same weights (each decode step replayed from a CUDA graph in both), and
prints prefill time, per-token decode latency and tokens/s side by side; then how far weft's numbers are
from the baseline's: the relative difference of their next-token logits on the same cached prefix, and
the greedy tokens on which they agree up to the baseline's first near-tie (top-2 logits within bf16
rounding of each other, or closer than the two models' logits differ on the same prefix allows: TIE_SIGMAS;
where the order of a reduction decides the token, so that a difference after it says nothing about either).

On the cpu backend: a small model of the same architecture (or a small checkpoint: --model PATH) on 4 cpu
ranks (Triton's interpreter), its greedy tokens and logits checked against transformers' model on one
process with the same weights (or, without transformers, against the same model on one rank: `weft demo`
runs that first and passes its result with --reference).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist

import weft
from weft.models import from_hf

# A near-tie of the demo's greedy check: the baseline's top-2 logits closer than this many standard deviations of
# the difference of two logits' errors (sqrt(2) x the rms difference of the two models' logits on the same prefix;
# the fused decode path's folded RMSNorm rounds differently from the layers path: 5e-2 relative on random weights).
TIE_SIGMAS = 4

# Qwen3-8B's config.json, but for the weights (random here unless --model).
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu")
# The same architecture, small enough for the interpreter (heads and KV heads divide by 4 ranks).
QWEN3_TINY = dict(QWEN3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=16, vocab_size=512)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's options; -h and a bad option (or combination) exit with the usage."""
    p = argparse.ArgumentParser(prog="weft demo", description=__doc__.splitlines()[0],
                                epilog="On GPUs: a Qwen3-8B-shaped model over every GPU, weft against NCCL + cuBLAS. "
                                "On the cpu backend: a small Qwen3 (or --model) on cpu ranks, checked against "
                                "transformers.")
    p.add_argument("-n", type=int, help="ranks (default: every GPU, or 4 cpu ranks)")
    p.add_argument("--model", help="a local checkpoint directory (config.json, *.safetensors) in place of the "
                   "built-in model's random weights (on cpu ranks: a small one, checked against transformers)")
    p.add_argument("--batch", type=int, help="prompts (default 8 on GPUs, 2 on cpu)")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt (default 512 on GPUs, 8 on cpu)")
    p.add_argument("--new-tokens", type=int, help="tokens to generate (default 128 on GPUs, 12 on cpu)")
    p.add_argument("--layers", type=int, help="use only the first N layers (random weights)")
    p.add_argument("--prompt", help="with --model and its tokenizer: this text, repeated --batch times, as the "
                   "prompts (random tokens without a tokenizer)")
    p.add_argument("--reference", metavar="FILE", help="cpu without transformers: check against this saved run "
                   "(`weft demo` makes it with --save on one rank first)")
    p.add_argument("--save", metavar="FILE", help="cpu: save this run's tokens and logits there, check nothing")
    args = p.parse_args(argv)
    if args.prompt is not None and args.model is None:
        p.error("--prompt needs --model (the checkpoint's tokenizer makes the prompt's tokens)")
    if args.model is not None and args.layers is not None:
        p.error("--layers applies to the built-in model's random weights, not to a checkpoint (--model)")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        p.error(f"--model {args.model}: not a checkpoint directory (it has no config.json)")
    return args


def say(*lines) -> None:
    if weft.rank() == 0:
        print(*lines, sep="\n", flush=True)


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=weft.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=weft.world().group)
    return t.item()


def progress_bar():
    """rich's progress bar on rank 0, where rich is installed (the `bench` extra); else None: no bar."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return Progress(TextColumn("  {task.description:12s}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    disable=weft.rank() != 0)


def timed_generate(model, prompts, new_tokens, label):
    """generate() with a progress bar; returns (tokens, prefill seconds, decode seconds per token)."""
    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
    stamps = []
    bar = progress_bar()

    with bar or contextlib.nullcontext():
        task = bar.add_task(label, total=new_tokens) if bar else None

        def on_token(i, tokens):
            sync()  # every rank's step is done: the bar (and the clock) see finished tokens
            stamps.append(time.perf_counter())
            if bar:
                bar.advance(task)

        weft.barrier()
        start = time.perf_counter()
        tokens = model.generate(prompts, new_tokens, callback=on_token)
    prefill = slowest(stamps[0] - start)
    decode = slowest((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    return tokens, prefill, decode


def gpu_demo(args) -> None:
    w = weft.world()
    config = args.model or dict(QWEN3_8B, num_hidden_layers=args.layers or QWEN3_8B["num_hidden_layers"])
    batch, prompt_len, new = args.batch or 8, args.prompt_len or 512, args.new_tokens or 128
    say(f"weft demo: {'checkpoint ' + args.model if args.model else 'a Qwen3-8B-shaped model, random bf16 weights'}"
        f" over {w.world_size} × {torch.cuda.get_device_name(w.device)}")
    t0 = time.perf_counter()
    model = from_hf(config, comm="weft")
    baseline = model.with_comm("nccl")
    cfg = model.config
    say(f"  {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.heads} heads / {cfg.kv_heads} KV heads, "
        f"vocab {cfg.vocab_size}; loaded in {time.perf_counter() - t0:.1f} s")
    tokenizer = _tokenizer(args.model) if args.model and args.prompt else None
    if tokenizer is not None:
        prompts = tokenizer(args.prompt, return_tensors="pt").input_ids.repeat(batch, 1)
    else:
        prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    prompts = prompts.to(w.device)
    say(f"  batch of {batch} prompts × {prompts.shape[1]} tokens, {new} new tokens each (greedy)", "")
    results = {}
    for label, m in (("weft", model), ("NCCL+cuBLAS", baseline)):
        m.session(batch, prompts.shape[1] + new)  # capture the decode graph before the clock starts
        m.generate(prompts, 2)  # warm-up: compiled kernels, cuBLAS, NCCL
        results[label] = timed_generate(m, prompts, new, label)
    rows = [("", "prefill", "decode / token", "decode tokens/s")]
    for label, (_, prefill, decode) in results.items():
        rows.append((label, f"{prefill * 1e3:.1f} ms", f"{decode * 1e3:.2f} ms", f"{batch / decode:,.0f}"))
    (_, p_weft, d_weft), (_, p_base, d_base) = (r for r in results.values())
    rows.append(("weft speed-up", f"{p_base / p_weft:.2f}×", f"{d_base / d_weft:.2f}×", ""))
    say("", *(f"  {a:14s} {b:>12s} {c:>16s} {d:>16s}" for a, b, c, d in rows))
    prompt_len = prompts.shape[1]
    rel, rms = next_token_difference(model, baseline, prompts)
    base_tokens = results["NCCL+cuBLAS"][0]
    margin = TIE_SIGMAS * math.sqrt(2) * rms
    # The logits that chose each new token.
    ties = near_ties(baseline(base_tokens[:, :-1])[:, prompt_len - 1:], margin)
    agree, compared = greedy_agreement(results["weft"][0][:, prompt_len:], base_tokens[:, prompt_len:], ties)
    say("", f"  next-token logits on the same cached prefix: weft vs NCCL+cuBLAS differ by {rel:.1e} (relative)",
        f"  greedy tokens identical up to the baseline's first near-tie (its top-2 logits within bf16 rounding or "
        f"{margin:.2g}, {TIE_SIGMAS} sigmas of the two's difference): {agree} of {compared}")
    if agree < compared:
        say("  (a token that differs before any near-tie: weft computes something else than the baseline)")
    if tokenizer is not None:
        say("", f"  {args.prompt!r} →", "  " + repr(tokenizer.decode(results["weft"][0][0, prompts.shape[1]:])))


def next_token_difference(model, baseline, prompts) -> tuple[float, float]:
    """(||a - b|| / ||b||, rms(a - b)) of weft's (a) and the baseline's (b) logits of one decode step over the same
    KV cache: the prompts prefilled by the baseline, then the token it picks next at the following position."""
    batch, prompt_len = prompts.shape
    cache = baseline.new_cache(batch, prompt_len + 1)
    token = baseline.prefill(prompts, cache).argmax(dim=-1)
    positions = torch.full((batch,), prompt_len, dtype=torch.int64, device=prompts.device)
    a = model.decode(token, positions, cache).float()  # both write the step's own slot, the same k and v
    b = baseline.decode(token, positions, cache).float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item(), (a - b).pow(2).mean().sqrt().item()


def near_ties(logits: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """(batch, steps) bool: where the top-2 logits of (batch, steps, vocab) are within bf16 rounding of each
    other (apart by at most bf16's relative precision of the larger: a reduction order decides the argmax), or
    within `margin`: two implementations whose logits differ by that much may pick either."""
    top = logits.topk(2, dim=-1).values.float()  # no fp32 copy of every logit
    gap = top[..., 0] - top[..., 1]
    return (gap <= torch.finfo(torch.bfloat16).eps * top[..., 0].abs()) | (gap <= margin)


def greedy_agreement(tokens: torch.Tensor, reference: torch.Tensor, ties: torch.Tensor) -> tuple[int, int]:
    """(agreeing, compared): over every sequence, the new tokens before the reference's first near-tie
    (`ties`, (batch, steps)) are compared; agreeing counts those before the first that differs."""
    steps = tokens.shape[1]
    index = torch.arange(steps, device=tokens.device)
    first_tie = torch.where(ties, index, steps).min(dim=1).values
    first_diff = torch.where(tokens != reference, index, steps).min(dim=1).values
    return int(torch.minimum(first_diff, first_tie).sum()), int(first_tie.sum())


def _tokenizer(path):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - no tokenizer: random prompts instead
        say(f"  (no tokenizer in {path}: {type(e).__name__}; random prompts instead)")
        return None


def cpu_demo(args) -> None:
    w = weft.world()
    batch, prompt_len, new = args.batch or 2, args.prompt_len or 8, args.new_tokens or 12
    t0 = time.perf_counter()
    if args.model:
        say(f"weft demo: checkpoint {args.model} on {w.world_size} cpu ranks (Triton interpreter: every kernel runs "
            "in Python, a few seconds per layer and token even for a small model)")
        model = from_hf(args.model, dtype=torch.float32, comm="weft")
        config = None
    else:
        say(f"weft demo: a small Qwen3-architecture decoder on {w.world_size} cpu ranks (Triton interpreter)")
        config = dict(QWEN3_TINY, num_hidden_layers=args.layers or QWEN3_TINY["num_hidden_layers"])
        model = from_hf(config, comm="weft", seed=0, std=0.1)
    tokenizer = _tokenizer(args.model) if args.prompt else None
    if tokenizer is not None:
        prompts = tokenizer(args.prompt, return_tensors="pt").input_ids.repeat(batch, 1)
    else:
        prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                                generator=torch.Generator().manual_seed(0))
    prompt_len = prompts.shape[1]
    logits = model(prompts)
    tokens, prefill, decode = timed_generate(model, prompts, new, "weft")
    gloo = model.with_comm("nccl").generate(prompts, new)
    say(f"  prefill {prefill:.2f} s, decode {decode:.2f} s per token (interpreted: correctness, not speed)")
    if args.save:
        torch.save({"tokens": tokens, "logits": logits}, args.save)
        return
    if args.reference:
        ref = torch.load(args.reference)
        ref_tokens, ref_logits, what = ref["tokens"], ref["logits"], "the same model on one rank"
    else:
        hf, what = _transformers_reference(args.model, config, model)
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            ref_logits = hf(prompts).logits
            ref_tokens = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
    err = (logits - ref_logits).abs().max().item()
    scale = max(1.0, ref_logits.abs().max().item())  # a checkpoint's logits can be large: relative to them
    good = torch.equal(tokens, ref_tokens) and torch.equal(gloo, tokens) and err < 1e-3 * scale
    say(f"  against {what}: logits max |difference| {err:.1e}, greedy tokens "
        f"{'identical' if torch.equal(tokens, ref_tokens) else 'DIFFERENT'}; comm='nccl' (gloo) tokens "
        f"{'identical' if torch.equal(gloo, tokens) else 'DIFFERENT'}", f"  ({time.perf_counter() - t0:.0f} s)")
    for row in tokens[:, prompt_len:].tolist():
        say(f"  new tokens: {row}")
    if tokenizer is not None:
        say(f"  {args.prompt!r} →", "  " + repr(tokenizer.decode(tokens[0, prompt_len:])))
    if not good:
        raise SystemExit(f"rank {w.rank}: the tensor-parallel model does not match {what}")


def _transformers_reference(path, config, model):
    """transformers' model of the same weights on one process, fp32: the checkpoint's, or the built-in config's
    with the seeded random weights weft's model was made of. Returns (model, what it is in words)."""
    if path is not None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return hf, f"transformers' {type(hf).__name__} of the checkpoint on one process"
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from weft.models.weights import RandomWeights, hf_shapes

    weights = RandomWeights(hf_shapes(model.config), 0, torch.float32, weft.device(), std=0.1)
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in config.items() if k != "model_type"})).eval()
    hf.load_state_dict({name: weights[name] for name in weights.shapes})
    return hf, "transformers' Qwen3ForCausalLM on one process"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    weft.init()
    (gpu_demo if weft.device().type == "cuda" else cpu_demo)(args)
    weft.finalize()


if __name__ == "__main__":
    main()
