"""EPMoE and TPMoE on cpu ranks against the Hugging Face blocks they are built from (Qwen3-MoE, Mixtral).

Every rank builds the same dense block (seeded weights, bf16) and every rank's tokens; it runs the block on its
own tokens as the reference and the weft layer, built from the block for its rank, on the same tokens.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 240
HIDDEN, INTER = 32, 16


def _block(kind: str, experts: int, k: int, seed: int):
    """A transformers sparse MoE block with seeded weights, bf16."""
    import torch

    if kind == "qwen3":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER,
                                                      num_experts=experts, num_experts_per_tok=k, norm_topk_prob=True))
    else:
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                                    num_local_experts=experts, num_experts_per_tok=k))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block.to(torch.bfloat16).eval()


def _layer_case(layer_name, kind, experts, k, tokens, seed, modes=()):
    import torch

    import weft
    from weft.layers import EPMoE, TPMoE

    me, w = weft.rank(), weft.world_size()
    block = _block(kind, experts, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(1, tokens, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(w)]
    with torch.no_grad():
        want = block(xs[me])
    want = (want[0] if isinstance(want, tuple) else want).float()  # transformers 4 adds the router logits
    if layer_name == "tp":
        layer = TPMoE.from_dense(block, rank=me, world_size=w)
        assert layer.w_gate_up.shape == (experts, HIDDEN, 2 * INTER // w)
        got = {"tp": layer(xs[me])}
    else:
        layer = EPMoE.from_dense(block, rank=me, world_size=w, decode_tokens=4)
        assert layer.w_gate_up.shape == (experts // w, HIDDEN, 2 * INTER)
        got = {mode: layer(xs[me], mode=mode) for mode in modes}
    for mode, out in got.items():
        assert out.shape == xs[me].shape and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2, msg=f"{layer_name} {kind} {mode}")
    return True


def _layer_cases(cases):
    for case in cases:
        _layer_case(*case)
    return True


@pytest.mark.parametrize("w", [1, 2, 4])
def test_tp_moe_matches_dense_block(w):
    cases = [("tp", "qwen3", 4, 2, 5, 1), ("tp", "mixtral", 4, 2, 3, 2)]
    assert all(run_ranks(_layer_cases, w, cases[:1] if w == 4 else cases, timeout=TIMEOUT, env=ENV))


@pytest.mark.parametrize("w", [1, 2, 4])
def test_ep_moe_matches_dense_block(w):
    # 3 tokens: decode (LL) on its own (mode None) and forced through the prefill (HT) path; 6 tokens: HT.
    cases = [("ep", "qwen3", 8, 2, 3, 3, (None, "ht")), ("ep", "mixtral", 8, 2, 6, 4, (None,))]
    assert all(run_ranks(_layer_cases, w, cases[:1] if w == 4 else cases, timeout=TIMEOUT, env=ENV))


def _compiled_and_opchecks():
    """TPMoE under torch.compile(fullgraph=True) against eager (the ops stay in the graph as torch.ops.weft),
    and torch.library.opcheck of both operators."""
    import torch

    import weft
    from weft.layers import TPMoE

    me, w = weft.rank(), weft.world_size()
    layer = TPMoE.from_dense(_block("qwen3", 4, 2, 7), rank=me, world_size=w)
    fn = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for step in range(2):  # the second call replays what the first compiled
        x = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(10 * step + me)).to(torch.bfloat16)
        torch.testing.assert_close(fn(x), layer(x))
    from torch._dynamo.utils import counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(me)).to(torch.bfloat16)
    idx, weights = layer.route(x)
    args = (x, layer.w_gate_up, idx, w)
    result = torch.library.opcheck(torch.ops.weft.ag_group_gemm, args)
    assert all(v == "SUCCESS" for v in result.values()), result
    inter, meta, row_of_pair = torch.ops.weft.ag_group_gemm(*args)
    h = torch.nn.functional.silu(inter[:, :layer.slice]) * inter[:, layer.slice:]
    result = torch.library.opcheck(torch.ops.weft.group_gemm_rs, (h, layer.w_down, idx, weights, meta, row_of_pair, w))
    assert all(v == "SUCCESS" for v in result.values()), result
    return True


def test_tp_moe_compiled_and_opcheck():
    assert all(run_ranks(_compiled_and_opchecks, 2, timeout=TIMEOUT, env=ENV))
