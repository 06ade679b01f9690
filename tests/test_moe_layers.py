"""EPMoE and TPMoE on cpu ranks against the Hugging Face blocks they are built from (Qwen3-MoE, Mixtral).

Every rank builds the same dense block (seeded weights, bf16) and every rank's tokens; it runs the block on its
own tokens as the reference and the weft layer, built from the block for its rank, on the same tokens.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 240
HIDDEN, INTER = 32, 16


def _block(kind: str, experts: int, k: int, seed: int, hidden: int = HIDDEN, inter: int = INTER):
    """A transformers sparse MoE block with seeded weights, bf16."""
    import torch

    if kind == "qwen3":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                                                      num_experts=experts, num_experts_per_tok=k, norm_topk_prob=True))
    else:
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=hidden, intermediate_size=inter,
                                                    num_local_experts=experts, num_experts_per_tok=k))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block.to(torch.bfloat16).eval()


def _layer_case(layer_name, kind, experts, k, tokens, seed, modes=(), bounded=False):
    """bounded: EPMoE's prefill with max_recv_tokens (every rank's tokens: no row dropped)."""
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
        layer = EPMoE.from_dense(block, rank=me, world_size=w, decode_tokens=4,
                                 max_recv_tokens=w * tokens if bounded else None)
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
    # 3 tokens: decode (LL) on its own (mode None) and forced through the prefill (HT) path; 6 tokens: HT; HT
    # with a bound on the rows received and k = 4, more than a rank's experts at 4 ranks.
    cases = [("ep", "qwen3", 8, 2, 3, 3, (None, "ht")), ("ep", "mixtral", 8, 2, 6, 4, (None,)),
             ("ep", "qwen3", 8, 4, 5, 5, ("ht",), True)]
    assert all(run_ranks(_layer_cases, w, cases[::2] if w == 4 else cases, timeout=TIMEOUT, env=ENV))


def _fp8_reference(block, x, idx, weights):
    """EPMoE(fp8=True)'s math in torch on the dequantized values: the weights quantized per 128 x 128 block, the
    rows and the activations before the down GEMM per row and 128 channels, each GEMM rounded to bf16."""
    import torch
    import torch.nn.functional as F

    import weft
    from weft.layers.moe import dense_weights

    _, gate, up, down, _, _ = dense_weights(block)
    inter = gate.shape[1]

    def blocks(w):  # quantized per 128 x 128 block, back in fp64
        q, scales = weft.ops.fp8_blocks(w)
        return q.double() * scales.double().repeat_interleave(128, 1).repeat_interleave(128, 2)

    def rows(h):  # quantized per row and 128 channels, back in fp64
        q, scales = weft.ops.fp8_rows(h)
        return q.double() * scales.double().repeat_interleave(128, -1)

    w_gu = blocks(torch.cat([gate, up], dim=1).transpose(1, 2))
    w_dn = blocks(down.transpose(1, 2))
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        xd = rows(x[t:t + 1])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gu = (xd @ w_gu[e]).to(torch.bfloat16)
            y = (rows(F.silu(gu[:, :inter]) * gu[:, inter:]) @ w_dn[e]).to(torch.bfloat16)
            out[t] += weights[t, j] * y[0].float()
    return out.to(torch.bfloat16)


def _fp8_case(kind, experts, k, tokens, seed, modes):
    """EPMoE(fp8=True) against _fp8_reference (decode: the fp8 dispatch's rows and scales straight into the
    gate/up GEMM; prefill: the rows quantized in the layer) and, loosely, against the dense bf16 block."""
    import torch

    import weft
    from weft.layers import EPMoE

    me, w = weft.rank(), weft.world_size()
    block = _block(kind, experts, k, seed, 128, 128)
    layer = EPMoE.from_dense(block, rank=me, world_size=w, decode_tokens=4, fp8=True)
    assert layer.w_gate_up.dtype == torch.float8_e4m3fn and layer.w_gate_up.shape == (experts // w, 128, 256)
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(tokens, 128, generator=g).to(torch.bfloat16) for _ in range(w)]
    idx, weights = layer.route(xs[me])
    want = _fp8_reference(block, xs[me], idx, weights).float()
    with torch.no_grad():
        dense = block(xs[me][None])
    dense = (dense[0] if isinstance(dense, tuple) else dense)[0].float()
    for mode in modes:
        out = layer(xs[me], mode=mode)
        assert out.shape == xs[me].shape and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2, msg=f"fp8 {kind} {mode}")
        err = (out.float() - dense).norm() / dense.norm()
        assert err < 0.1, f"fp8 {kind} {mode}: relative error {float(err)} against the bf16 block"
    return True


def _fp8_cases(cases):
    for case in cases:
        _fp8_case(*case)
    return True


@pytest.mark.parametrize("w", [1, 2, pytest.param(4, marks=pytest.mark.long)])
def test_ep_moe_fp8(w):
    cases = [("qwen3", 8, 2, 3, 5, (None, "ht")), ("mixtral", 8, 2, 6, 6, (None,))]
    # Both blocks at 2 ranks; at 1 and 4, Qwen3's alone (its decode and prefill paths).
    assert all(run_ranks(_fp8_cases, w, cases if w == 2 else cases[:1], timeout=TIMEOUT, env=ENV))


def _fp8_rejected():
    import pytest

    from weft.layers import EPMoE

    with pytest.raises(ValueError, match="multiples of 128"):
        EPMoE.from_dense(_block("qwen3", 4, 2, 1), rank=0, world_size=1, fp8=True)
    return True


def test_ep_moe_fp8_needs_blocks_of_128():
    assert run_ranks(_fp8_rejected, 1, timeout=TIMEOUT)[0]


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
    args = (x, layer.w_gate_up, idx, weft.world().name)  # the operators take the group by name
    result = torch.library.opcheck(torch.ops.weft.ag_group_gemm, args)
    assert all(v == "SUCCESS" for v in result.values()), result
    inter, meta, row_of_pair = torch.ops.weft.ag_group_gemm(*args)
    h = torch.nn.functional.silu(inter[:, :layer.slice]) * inter[:, layer.slice:]
    result = torch.library.opcheck(torch.ops.weft.group_gemm_rs, (h, layer.w_down, idx, weights, meta, row_of_pair,
                                                                  weft.world().name))
    assert all(v == "SUCCESS" for v in result.values()), result
    return True


def test_tp_moe_compiled_and_opcheck():
    assert all(run_ranks(_compiled_and_opchecks, 2, timeout=TIMEOUT, env=ENV))
