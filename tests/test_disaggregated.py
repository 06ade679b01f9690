"""Disaggregated MoE serving (weft.models.disaggregated) on cpu ranks against transformers' Qwen3MoeForCausalLM
in one process, the same tiny random weights (fp32): greedy tokens equal at 2 attention + 2 expert ranks with 2
micro-batches in ping-pong, at 3 + 1 with 4 (an M2N channel each: on one they would deadlock), and the colocated
baseline (DP attention + EPMoE over every rank).
And the p2p workspace's first use between 2 of 4 ranks, the other two busy elsewhere.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}


def _hf_moe(layers=2):
    """A tiny Qwen3-MoE with random weights: normal(0, 0.1) matrices, norms normal(1, 0.1), the same on every rank."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=layers, vocab_size=96,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() >= 2 else p.normal_(1.0, 0.1)
    model.generation_config.eos_token_id = None
    return model


# (name, placement, batch, micro-batches, new tokens): 3 + 1 at k = 4 deadlocks in its first decode step on one M2N
# channel; a 5-token prefill in chunks of 4 tokens takes 2 M2N calls per micro-batch and layer. 2 + 2 runs two
# decode steps (its M2N channels reused from step to step), the others one.
PLACEMENTS = {"2+2": (dict(attention_ranks=[0, 1]), 4, 2, 3),
              "3+1": (dict(attention_ranks=[0, 1, 2]), 12, 4, 2),
              "colocated": (dict(colocated=True), 4, 1, 2)}


def _generation_matches_transformers(names):
    import torch

    import weft
    from weft.models import disaggregated

    ref = _hf_moe()
    results = {}
    for name in names:
        kwargs, batch, micro, new = PLACEMENTS[name]
        prompts = torch.randint(0, 96, (batch, 5), generator=torch.Generator().manual_seed(len(name) + batch))
        model = disaggregated.from_hf(ref.config, ref.state_dict(), **kwargs)
        got = model.generate(prompts, new, micro_batches=micro, prefill_chunk=4)
        with torch.no_grad():
            want = ref.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, do_sample=False)
        assert got.tolist() == want.tolist(), (name, weft.rank(), got.tolist(), want.tolist())
        results[name] = got.tolist()
    return results


@pytest.mark.parametrize("names", [("2+2", "colocated"),
                                   pytest.param(("3+1",), marks=pytest.mark.long)])  # CI: the 2 + 2
def test_generation_matches_transformers(names):
    results = run_ranks(_generation_matches_transformers, 4, names, timeout=600, env=ENV)
    assert all(r == results[0] for r in results)


def _p2p_between_two_of_four():
    """Ranks 2 and 3 exchange through weft's p2p (its workspace's first use) while ranks 0 and 1 wait in a gloo
    receive from rank 3, which it sends after the exchange: a first use that needed the other members (an
    allocation or a barrier over the world) would hang here."""
    import torch
    import torch.distributed as dist

    import weft
    from weft import ops

    me = weft.rank()
    used = weft.world().heap.used
    if me in (0, 1):
        got = torch.zeros(3)
        dist.recv(got, src=3)
        assert "p2p" not in weft.world().contexts
        return got.tolist()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(me))
    peer = 5 - me
    want = torch.randn(1000, generator=torch.Generator().manual_seed(peer))
    got = torch.empty(1000)
    ops.batch_isend_irecv([ops.P2POp(ops.isend, x, peer), ops.P2POp(ops.irecv, got, peer)])
    assert torch.equal(got, want)
    if me == 2:
        ops.send(x * 2, 3)
    else:
        back = torch.empty(1000)
        ops.recv(back, 2)
        assert torch.equal(back, want * 2)
        for q in (0, 1):
            dist.send(torch.tensor([1.0, 2.0, float(q)]), dst=q)
    assert weft.world().heap.used == used  # the workspace sits in the heap's tail: no allocation
    return True


def test_p2p_first_use_between_two_of_four_ranks():
    assert run_ranks(_p2p_between_two_of_four, 4, timeout=120, env=ENV) == [[1.0, 2.0, 0.0], [1.0, 2.0, 1.0],
                                                                            True, True]
