"""The tensor-parallel decoder (weft.models) on cpu ranks against transformers' own LlamaForCausalLM /
Qwen3ForCausalLM on one process, with the same tiny random weights (fp32):

- the full forward's logits at every position (prompt lengths that leave the sequence-parallel rows
  ragged: 14 tokens on 3 and 4 ranks);
- prefill, then 5 decode steps from the KV cache, two sequences of different lengths in one cache;
- greedy generation token for token (and with an eos token, padded after it as transformers does);
- sampled generation: the same tokens on every rank, and again for the same seed;
- comm="weft" (weft's ops under the interpreter) and comm="nccl" (gloo here), Llama-3 rope scaling,
  tied embeddings, a vocabulary that does not divide by the world size;
- data parallelism: TP=2 replicas on 4 ranks (tp_group), each serving its own batch;
- the refusals: heads or KV heads that do not divide by the world size, configs this decoder lacks, bad ids.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 300
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}


def _hf_model(kind, heads, kv_heads, vocab, tie=False, rope=None, layers=2):
    """A tiny transformers model with random weights: normal(0, 0.1) matrices, norms normal(1, 0.1) (so that
    every weight matters), the same on every rank."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    config = config_cls(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                        intermediate_size=96, num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=tie,
                        rms_norm_eps=1e-6, **({"rope_parameters": rope} if rope else {}))
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() == 2 else p.normal_(1.0, 0.1)
    model.generation_config.eos_token_id = None  # generate max_new_tokens, as weft does without eos_token_id
    return model


def _close(got, want, what):
    import torch

    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda s: f"{what}: {s}")


def _decode_steps(model, ref, prompts, cont, paths, cache_len):
    """transformers' logits at the continuation's positions, and per decode path the model's decode steps over the
    continuation after a prefill of the prompts: (want (batch, steps, vocab), {path: [each step's logits]})."""
    import torch

    batch, plen = prompts.shape
    with torch.no_grad():
        want = ref(torch.cat([prompts, cont], dim=1)).logits[:, plen:]
        got = {}
        for path in paths:
            cache = model.new_cache(batch, cache_len)
            model.prefill(prompts, cache)
            got[path] = [model.decode(cont[:, j], torch.full((batch,), plen + j), cache, path=path)
                         for j in range(cont.shape[1])]
    return want, got


def _matches_transformers(kind, heads, kv_heads, vocab, tie, rope, comm, extras):
    import torch

    import weft
    from weft.models import KVCache, from_hf
    from weft.testing.checks import rejects

    if weft.world_size() == 3:  # shapes that do not divide by the world size are refused
        rejects(lambda: from_hf(_hf_model("qwen3", 4, 2, vocab).config), ValueError, "heads = 4 is not divisible", [])
        rejects(lambda: from_hf(_hf_model("qwen3", 6, 2, vocab).config), ValueError, "kv_heads = 2 is not divisible",
                [])
    ref = _hf_model(kind, heads, kv_heads, vocab, tie, rope)
    model = from_hf(ref.config, state_dict=ref.state_dict(), comm=comm)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (2, 7), generator=g)
    with torch.no_grad():
        _close(model(prompts), ref(prompts).logits, "forward")

        # Prefill a 7-token and a 4-token prompt into rows 0 and 1 of one cache, then 5 decode steps of both.
        cont = torch.randint(0, vocab, (2, 5), generator=g)
        seqs = [torch.cat([prompts[0], cont[0]]), torch.cat([prompts[1, :4], cont[1]])]
        want = [ref(s[None]).logits[0] for s in seqs]
        cache = model.new_cache(2, 16)
        for row, n in ((0, 7), (1, 4)):
            got = model.prefill(seqs[row][None, :n], KVCache(cache.data[:, :, row:row + 1]))
            _close(got[0], want[row][n - 1], f"prefill of row {row}")
        for j in range(5):
            got = model.decode(cont[:, j], torch.tensor([7 + j, 4 + j]), cache)
            _close(got, torch.stack([want[0][7 + j], want[1][4 + j]]), f"decode step {j}")

        greedy = model.generate(prompts, 6)
        mask = torch.ones_like(prompts)
        assert greedy.tolist() == ref.generate(prompts, attention_mask=mask, max_new_tokens=6, do_sample=False).tolist()
    if not extras:  # the interpreter is slow: eos and sampling on the fast comm only
        return greedy.tolist()
    eos = int(greedy[0, 9])  # row 0's third new token: that row stops there
    stopped = model.generate(prompts, 6, eos_token_id=eos, pad_token_id=0)
    with torch.no_grad():
        assert stopped.tolist() == ref.generate(prompts, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                                eos_token_id=eos, pad_token_id=0).tolist()
    sampled = model.generate(prompts, 4, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    again = model.generate(prompts, 4, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert sampled.tolist() == again.tolist() and sampled.shape == (2, 11)
    assert torch.equal(sampled[:, :7], prompts)
    return greedy.tolist(), sampled.tolist()


@pytest.mark.parametrize("kind, heads, kv_heads, vocab, tie, rope, comm, world_size", [
    ("llama", 4, 2, 96, False, None, "weft", 2),
    ("qwen3", 6, 3, 96, False, None, "weft", 3),
    ("llama", 4, 2, 96, True, LLAMA3_ROPE, "nccl", 2),
])
def test_logits_and_generation_match_transformers(kind, heads, kv_heads, vocab, tie, rope, comm, world_size):
    results = run_ranks(_matches_transformers, world_size, kind, heads, kv_heads, vocab, tie, rope, comm,
                        comm == "nccl", timeout=TIMEOUT, env=ENV)
    assert all(r == results[0] for r in results), "ranks generated different tokens"


def _data_parallel_replicas(tp):
    """TP-sized replicas of one model (weft.new_subgroups), each serving its own batch at the same time: each
    replica's logits and greedy tokens equal transformers' on that batch."""
    import torch

    import weft
    from weft.models import from_hf

    me = weft.rank()
    group = weft.new_subgroups(tp)
    replica = me // tp
    ref = _hf_model("qwen3", 8, 4, 97, tie=True)  # 97: the last vocabulary slice is padded
    model = from_hf(ref.config, state_dict=ref.state_dict(), tp_group=group)
    assert model.comm.group is group and model.world_size == tp
    prompts = torch.randint(0, 97, (2, 5 + replica), generator=torch.Generator().manual_seed(10 + replica))
    with torch.no_grad():
        _close(model(prompts), ref(prompts).logits, f"replica {replica}: forward")
        greedy = model.generate(prompts, 4)
        assert greedy.tolist() == ref.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=4,
                                               do_sample=False).tolist()
        baseline = model.with_comm("nccl")  # the same group's process group under the baseline
        assert baseline.comm.group is group
        _close(baseline(prompts), ref(prompts).logits, f"replica {replica}: forward on the baseline comm")
    return replica, greedy.tolist()


def test_data_parallel_replicas_of_a_tensor_parallel_model():
    """TP=2 x DP=2 on 4 ranks: tied embeddings, a vocabulary that does not divide by the TP size."""
    results = run_ranks(_data_parallel_replicas, 4, 2, timeout=TIMEOUT, env=ENV)
    assert results[0] == results[1] and results[2] == results[3] and results[0] != results[2]


def _experts_over_the_world_attention_over_pairs():
    """One program, two axes: EPMoE over the world's 4 ranks (experts split 4 ways) and a TP=2 decoder (its
    attention and MLP) over pairs of ranks, their calls interleaved; each against its single-process reference."""
    import torch

    import weft
    from test_moe_layers import HIDDEN, _block
    from weft.layers import EPMoE
    from weft.models import from_hf

    me = weft.rank()
    pairs = weft.new_subgroups(2)
    ref = _hf_model("llama", 4, 2, 96)
    model = from_hf(ref.config, state_dict=ref.state_dict(), tp_group=pairs)
    block = _block("qwen3", 8, 2, seed=3)
    moe = EPMoE.from_dense(block, decode_tokens=4)  # the world: 2 experts per rank
    assert moe.w_gate_up.shape[0] == 2
    g = torch.Generator().manual_seed(20 + me // 2)  # the pair's batch
    for step, mode in enumerate(("ll", "ht")):  # the calls interleaved: EPMoE, the decoder, EPMoE, the decoder
        x = torch.randn(1, 3 + step, HIDDEN, generator=torch.Generator().manual_seed(30 + me + 10 * step))
        x = x.to(torch.bfloat16)
        with torch.no_grad():
            want = block(x)
            want = (want[0] if isinstance(want, tuple) else want).float()
            prompts = torch.randint(0, 96, (1, 6), generator=g)
            torch.testing.assert_close(moe(x, mode=mode).float(), want, rtol=3e-2, atol=3e-2,
                                       msg=f"EPMoE over the world, {mode}")
            _close(model(prompts), ref(prompts).logits, "TP=2 decoder over a pair")
    return True


def test_experts_over_the_world_and_attention_over_pairs():
    assert all(run_ranks(_experts_over_the_world_attention_over_pairs, 4, timeout=TIMEOUT, env=ENV))


def _pipeline(tp):
    """A pipeline of 2 stages (each TP = tp ranks): logits of the full forward, prefill + decode from the cache and
    greedy generation in micro-batches equal transformers'; every rank returns the same tokens. With TP (4 ranks
    on the interpreter) one decode step and a shorter generation: the stages' hand-offs are those of PP alone,
    whose run keeps the second step and the generation stopped at eos in 3 micro-batches."""
    import torch

    import weft
    from weft.models import from_hf

    world = weft.world_size()
    tp_group = weft.new_subgroups(tp)
    pp_group = None
    for first in range(tp):
        made = weft.new_group(range(first, world, tp))
        pp_group = pp_group or made
    ref = _hf_model("qwen3", 4, 2, 96, layers=3)  # 3 layers over 2 stages: 2 + 1
    model = from_hf(ref.config, state_dict=ref.state_dict(), tp_group=tp_group, pp_group=pp_group)
    assert len(model.blocks) == (2 if pp_group.rank == 0 else 1)
    assert (model.embed is None) == (pp_group.rank == 1) and (model.lm_head is None) == (pp_group.rank == 0)
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(0, 96, (3, 6), generator=g)
    with torch.no_grad():
        _close(model(prompts), ref(prompts).logits, "forward through the stages")
        cont = torch.randint(0, 96, (3, 2), generator=g)
        want = ref(torch.cat([prompts, cont], dim=1)).logits
        cache = model.new_cache(3, 16)
        _close(model.prefill(prompts, cache), want[:, 5], "prefill")
        for j in range(2 if tp == 1 else 1):
            got = model.decode(cont[:, j], torch.full((3,), 6 + j), cache)
            _close(got, want[:, 6 + j], f"decode step {j}")
        new_tokens = 5 if tp == 1 else 3
        greedy = model.generate(prompts, new_tokens)  # 3 sequences in 2 micro-batches
        mask = torch.ones_like(prompts)
        assert greedy.tolist() == ref.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens,
                                               do_sample=False).tolist()
        if tp > 1:
            return greedy.tolist()
        eos = int(greedy[1, 8])  # row 1's third new token
        stopped = model.generate(prompts, 5, eos_token_id=eos, pad_token_id=0, micro_batches=3)
        assert stopped.tolist() == ref.generate(prompts, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                                eos_token_id=eos, pad_token_id=0).tolist()
    return greedy.tolist(), stopped.tolist()


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)])
def test_pipeline_stages_match_transformers(world, tp):
    """PP=2 and PP=2 x TP=2."""
    results = run_ranks(_pipeline, world, tp, timeout=TIMEOUT, env=ENV)
    assert all(r == results[0] for r in results), "stages returned different tokens"


def _checkpoint_and_comms(path):
    """A checkpoint directory loads (safetensors, each rank slicing the full tensors); the same weights on weft's
    ops and on the process group's collectives give the same logits; the twin shares the weights; bad input
    ids are refused before anything runs."""
    import torch

    from weft.models import from_hf
    from weft.testing.checks import rejects

    ref = _hf_model("qwen3", 4, 2, 96)
    prompts = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _close(from_hf(path)(prompts), ref(prompts).logits, "from a checkpoint directory")
    model = from_hf(ref.config, seed=5)  # seeded random weights, the same on every rank
    twin = model.with_comm("nccl")
    assert twin.comm.name == "nccl" and model.comm.name == "weft"
    assert all(a is b for a, b in zip(model.parameters(), twin.parameters()))
    _close(model(prompts), twin(prompts), "weft vs nccl")
    assert model.generate(prompts, 3).tolist() == twin.generate(prompts, 3).tolist()
    rejects(lambda: model(torch.tensor([[1, 96]])), ValueError, "input_ids must lie in [0, 96)", [])
    rejects(lambda: model(torch.tensor([1, 2])), ValueError, "input_ids must be (batch, seq)", [])
    rejects(lambda: model(torch.tensor([[1.0]])), TypeError, "input_ids has dtype", [])
    rejects(lambda: model.generate(prompts, -1), ValueError, "max_new_tokens", [])
    rejects(lambda: model.with_comm("mpi"), ValueError, "comm must be one of", [])
    return True


def test_checkpoint_comms_and_bad_input(tmp_path):
    _hf_model("qwen3", 4, 2, 96).save_pretrained(tmp_path)  # config.json and model.safetensors
    run_ranks(_checkpoint_and_comms, 2, str(tmp_path), timeout=TIMEOUT, env=ENV)


def test_configs_the_decoder_lacks_are_refused():
    from transformers import LlamaConfig, MistralConfig

    from weft.models import ModelConfig
    from weft.testing.checks import rejects

    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                num_hidden_layers=1, vocab_size=96)
    rejects(lambda: ModelConfig.from_hf(MistralConfig(**base)), ValueError, "model_type 'mistral'", [])
    rejects(lambda: ModelConfig.from_hf(LlamaConfig(attention_bias=True, **base)), ValueError, "attention_bias", [])
    rejects(lambda: ModelConfig.from_hf(LlamaConfig(hidden_act="gelu", **base)), ValueError, "hidden_act", [])
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    rejects(lambda: ModelConfig.from_hf(LlamaConfig(rope_parameters=yarn, **base)), ValueError, "rope type 'yarn'", [])
    # transformers 5 keeps rope θ in rope_parameters, config.json files of older ones in rope_theta / rope_scaling.
    cfg = ModelConfig.from_hf(dict(model_type="llama", rope_theta=5e5, rope_scaling=LLAMA3_ROPE, **base))
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["factor"] == 8.0 and cfg.head_dim == 16 and not cfg.qk_norm
    assert ModelConfig.from_hf(LlamaConfig(rope_theta=123.0, **base)).rope_theta == 123.0


# -- the demo's correctness report: near-ties, agreeing greedy tokens, the next-token logits' difference ----------

def test_greedy_agreement_stops_at_the_first_near_tie():
    import torch

    from weft.demo import greedy_agreement, near_ties

    logits = torch.randn(3, 6, 50, generator=torch.Generator().manual_seed(0)) * 4
    top = logits.argmax(-1)
    logits[0, 3, (top[0, 3] + 1) % 50] = logits[0, 3, top[0, 3]]          # an exact tie at step 3 of row 0
    logits[1, 1, (top[1, 1] + 1) % 50] = logits[1, 1, top[1, 1]] * (1 - 2 ** -9)  # within bf16's precision
    logits[2, 4, (top[2, 4] + 1) % 50] = logits[2, 4, top[2, 4]] - 0.1 * logits[2, 4, top[2, 4]].abs()  # not one
    ties = near_ties(logits)
    assert ties.tolist() == [[False, False, False, True, False, False], [False, True] + [False] * 4, [False] * 6]
    reference = logits.argmax(-1)
    tokens = reference.clone()
    tokens[0, 5] += 1  # after row 0's near-tie: not compared
    tokens[2, 2] += 1  # row 2 differs before any near-tie: 2 of its 6 agree
    assert greedy_agreement(tokens, reference, ties) == (3 + 1 + 2, 3 + 1 + 6)
    assert greedy_agreement(reference, reference, ties) == (10, 10)
    # With a margin (two models' logits differing by that much), row 2's step 4 (0.1 of its top logit apart) is one.
    margin = 0.1 * logits[2, 4, top[2, 4]].abs().item()
    assert near_ties(logits, margin)[2, 4] and not near_ties(logits, margin / 2)[2, 4]


def _next_token_difference(config):
    import torch

    from weft.demo import next_token_difference
    from weft.models import from_hf

    model = from_hf(config, comm="weft", seed=0, std=0.1)
    prompts = torch.randint(0, config["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    same = next_token_difference(model, model.with_comm("nccl"), prompts)
    other = next_token_difference(from_hf(config, comm="weft", seed=1, std=0.1), model.with_comm("nccl"), prompts)
    return same, other


def test_next_token_difference_on_a_shared_cache():
    """The same weights on weft's ops and on gloo agree to fp32 rounding; other weights do not."""
    config = dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96)
    for same, other in run_ranks(_next_token_difference, 2, config, timeout=TIMEOUT, env=ENV):
        assert same[0] < 1e-5 and other[0] > 0.1, (same, other)  # relative
        assert same[1] < 1e-5 * other[1], (same, other)  # rms
