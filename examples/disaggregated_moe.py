"""Serve a Qwen3-MoE model disaggregated: attention on some ranks, experts on the others, decode micro-batches in
ping-pong over M2N; check the tokens against the same model in one process (transformers).

    weft run -n 4 examples/disaggregated_moe.py                       # 2 attention + 2 expert ranks, cpu: ~a minute
    weft run -n 4 examples/disaggregated_moe.py --attention-ranks 3   # 3 + 1
    weft run -n 8 examples/disaggregated_moe.py --attention-ranks 4 --hidden 1024 --experts 64 --layers 4 \\
        --batch 64 --micro-batches 4                                   # GPUs: any split

Every rank builds the same transformers Qwen3MoeForCausalLM (a small config, seeded random weights) and its part
of weft's disaggregated model (weft/models/disaggregated.py): the first --attention-ranks ranks hold the
attention layers, routers, embedding and LM head, each serving its own slice of the batch; the rest hold the
experts, split. Every rank prints its role, and rank 0 the tokens and the check against transformers' greedy
generation of the same prompts (on the cpu, in fp32 on both sides; on GPUs the reference runs on rank 0's GPU in
the model's dtype, where a near-tie of its top-2 logits may go either way: the tokens must agree up to each
sequence's first near-tie, and the script fails otherwise).
"""
import argparse
import time

import torch

import weft
from weft.demo import greedy_agreement, near_ties
from weft.models import disaggregated


def reference_model(args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                            head_dim=args.hidden // args.heads, moe_intermediate_size=args.moe_inter,
                            num_hidden_layers=args.layers, vocab_size=args.vocab, num_experts=args.experts,
                            num_experts_per_tok=args.topk, norm_topk_prob=True, rms_norm_eps=1e-6)
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() >= 2 else p.normal_(1.0, 0.1)
    model.generation_config.eos_token_id = None
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention-ranks", type=int, default=None, help="ranks of the attention side (default: half)")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--batch", type=int, default=None, help="sequences (default: 2 per attention rank and micro-batch)")
    p.add_argument("--prompt-len", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-inter", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    weft.init()
    world, me = weft.world_size(), weft.rank()
    attention = args.attention_ranks if args.attention_ranks is not None else max(1, world // 2)
    if not 1 <= attention < world:
        raise SystemExit(f"--attention-ranks must leave at least one expert rank of {world}, got {attention}")
    batch = args.batch or 2 * attention * args.micro_batches
    ref = reference_model(args)
    dtype = torch.bfloat16 if weft.BACKEND == "cuda" else torch.float32
    model = disaggregated.from_hf(ref.config, ref.state_dict(), attention_ranks=range(attention), dtype=dtype)
    print(f"rank {me}: {model.role} rank", flush=True)
    prompts = torch.randint(0, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    weft.barrier()
    start = time.perf_counter()
    tokens = model.generate(prompts, args.new_tokens, micro_batches=args.micro_batches)
    seconds = time.perf_counter() - start
    ok = True
    if me == 0:
        print(f"{attention} attention + {world - attention} expert ranks, {args.micro_batches} micro-batches, batch "
              f"{batch}: {args.new_tokens} tokens in {seconds:.2f} s")
        print("new tokens:", tokens[:, args.prompt_len:].tolist())
        ref = ref.to(weft.device(), dtype)
        with torch.no_grad():
            out = ref.generate(prompts.to(weft.device()), attention_mask=torch.ones_like(prompts).to(weft.device()),
                               max_new_tokens=args.new_tokens, do_sample=False, output_scores=True,
                               return_dict_in_generate=True)
        got, want = tokens[:, args.prompt_len:].cpu(), out.sequences[:, args.prompt_len:].cpu()
        if torch.equal(got, want):
            print("check: the tokens equal transformers' one-process model's")
        else:
            # In bf16 a near-tie of the reference's top-2 logits (within bf16 rounding) is decided by reduction
            # order; before the first one of a sequence the tokens must agree (fp32 on the cpu: everywhere).
            ties = near_ties(torch.stack(out.scores, dim=1)).cpu() if dtype == torch.bfloat16 \
                else torch.zeros_like(got, dtype=torch.bool)
            agreeing, compared = greedy_agreement(got, want, ties)
            ok = agreeing == compared
            row, col = (got != want).nonzero()[0].tolist()
            print(f"check: {'ok' if ok else 'FAILED'}: sequence {row} differs from transformers' at new token {col}; "
                  f"tokens before the reference's first bf16 near-tie: {agreeing} of {compared} agree")
    flags = [None] * world
    torch.distributed.all_gather_object(flags, ok, group=weft.world().process_group)
    weft.finalize()
    if not all(flags):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
