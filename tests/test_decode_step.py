"""The persistent decode step (weft/kernels/decode_step.py, WEFT_DECODE=persistent) on cpu ranks, where it runs as
one program (the interpreter runs programs one after another):

- weft.ops.decode_step against the fused path's kernels called layer by layer (norm_qkv_rope, flash_decode,
  linear_residual, norm_gate_up_silu): the same bits out and in the KV cache, Qwen3-like (q/k norm) and
  Llama-like shapes, fp32 and bf16, 1, 3 and 5 rows (the dot-free and the tl.dot GEMVs), shapes where every
  projection splits K and shapes where some do not, positions in different attention splits, two calls in a
  row (the counters reset);
- the decoder's decode steps with path="persistent" against the fused path (bit for bit, with flash_decode as the
  fused path's attention) and transformers (test_model.py's tolerance), Qwen3 and Llama-3, batch 1 and 3, two
  steps in a row, and greedy generation against transformers';
- bad arguments refused naming them, and the decoder's refusals of TP > 1 and of a pipeline.
"""
import pytest

from weft.testing import run_ranks

TIMEOUT = 600
ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}


def _weights(g, layers, hidden, heads, kv_heads, d, inter, qk_norm, dtype, k_major=()):
    """decode_step's weights (8 a layer) with normal(0, 0.1)-ish matrices and norms near 1; the projections named in
    k_major (of "qkv", "o", "gate_up", "down") stored K-contiguous (transposes of (N, K) tensors, nn.Linear's
    layout)."""
    import torch

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def weight(name, k, n):
        if name in k_major:
            return randn(n, k, scale=k ** -0.5).t()
        return randn(k, n, scale=k ** -0.5)

    out = []
    for _ in range(layers):
        norms = [randn(d, scale=0.1) + 1, randn(d, scale=0.1) + 1] if qk_norm else [None, None]
        out += [randn(hidden, scale=0.1) + 1, weight("qkv", hidden, (heads + 2 * kv_heads) * d), *norms,
                weight("o", heads * d, hidden), randn(hidden, scale=0.1) + 1, weight("gate_up", hidden, 2 * inter),
                weight("down", inter, hidden)]
    return out


def _fused_layers(h, weights, inv_freq, rows, positions, lengths, cache, heads, kv_heads, eps):
    """What the fused decode path runs, kernel after kernel, layer after layer."""
    import weft

    ops = weft.ops
    m = h.shape[0]
    for layer in range(cache.shape[0]):
        an, qkv, qn, kn, o, mn, gu, down = weights[8 * layer:8 * layer + 8]
        k, v = cache[layer, 0], cache[layer, 1]
        q = ops.norm_qkv_rope(h, an, qkv, heads, kv_heads, inv_freq, rows, positions, k, v, qn, kn, eps)
        attn = ops.flash_decode(q, k, v, lengths)
        h = ops.linear_residual(attn.reshape(m, -1), o, h)
        h = ops.linear_residual(ops.norm_gate_up_silu(h, mn, gu, eps), down, h)
    return h


def _any_order(plan, seed):
    """The plan's task table in a random order that keeps only what the table itself says: every task after the
    tasks it waits for (its counters at their targets), nothing else. Run by one program, it computes what the
    phase-major order computes only if each task waits for everything it reads, and nothing it reads is rewritten
    by a task that does not wait for it (a layer's buffers reused by the next)."""
    import numpy as np
    import torch

    from weft.kernels import decode_step as ds

    tasks = plan.tasks.cpu().numpy()
    signal, signals, wait, waits, target = (tasks[:, c.value] for c in (ds.SIGNAL_FIRST, ds.SIGNAL_COUNT,
                                                                       ds.WAIT_FIRST, ds.WAIT_COUNT, ds.WAIT_TARGET))
    rng = np.random.default_rng(seed)
    done = np.zeros(plan.done.numel(), dtype=np.int64)
    pending, order = list(range(len(tasks))), []
    while pending:
        ready = [j for j in pending if (done[wait[j]:wait[j] + waits[j]] >= target[j]).all()]
        # Half the time the latest task ready (a consumer as early as its waits let it run), else any.
        j = ready[-1] if rng.random() < 0.5 else ready[rng.integers(len(ready))]
        pending.remove(j)
        order.append(j)
        done[signal[j]:signal[j] + signals[j]] += 1
    assert order != sorted(order)
    return torch.from_numpy(tasks[order]).to(plan.tasks.device)


def _step_against_fused(case):
    import torch

    import weft

    dtype, m, heads, kv_heads, inter, qk_norm, k_major = case
    hidden, d, layers, max_len, eps = 64, 64, 2, 40, 1e-6
    g = torch.Generator().manual_seed(7 + m)
    weights = _weights(g, layers, hidden, heads, kv_heads, d, inter, qk_norm, dtype, k_major)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    rows = torch.arange(m)
    cache = torch.randn(layers, 2, m, max_len, kv_heads, d, generator=g).to(dtype)
    want_cache = cache.clone()
    # The second call: the counters and the split-K tile counters were reset. The third: the task table in another
    # order its waits allow (_any_order).
    for call in range(3):
        # Positions in the cpu backend's attention splits of 16 (0, 1 and 2).
        positions = (torch.tensor([7, 20, 37, 3, 30])[:m] + call).to(torch.int64)
        lengths = (positions + 1).to(torch.int32)
        h = torch.randn(m, hidden, generator=g).to(dtype)
        if call == 2:
            from weft.kernels.decode_step import DecodeStepPlan
            from weft.kernels.common import world_or_raise

            plan, = [p for p in world_or_raise().plans.values() if isinstance(p, DecodeStepPlan)]
            plan.tasks = _any_order(plan, seed=m)
        got = weft.ops.decode_step(h, weights, inv_freq, positions, lengths, cache, heads, kv_heads, eps)
        want = _fused_layers(h, weights, inv_freq, rows, positions, lengths, want_cache, heads, kv_heads, eps)
        assert torch.equal(got, want), (case, call, (got.float() - want.float()).abs().max().item())
        assert torch.equal(cache, want_cache), (case, call, "the KV cache")
        assert torch.isfinite(got.float()).all(), case
    return True


# (dtype, rows, heads, kv_heads, intermediate, q/k norm, the projections stored K-contiguous). With the cpu
# settings (K blocks of 32, 8 programs): 2 + 1 heads and I = 32 split K in every projection; 4 + 2 heads and I = 96
# leave QKV and gate/up unsplit. 1 and 3 rows take the dot-free GEMV, 5 rows tl.dot. The first case stores QKV and
# down K-contiguous, O and gate/up not (each GEMV body both ways), the third all four.
# CI runs the first (the other two: `long`, for the suite's time; the fused kernels' own tests cover their paths).
STEP_CASES = [pytest.param(("float32", 1, 2, 1, 32, True, ("qkv", "down")), id="qwen-fp32-m1"),
              pytest.param(("bfloat16", 3, 4, 2, 96, False, ()), id="llama-bf16-m3", marks=pytest.mark.long),
              pytest.param(("float32", 5, 2, 1, 32, True, ("qkv", "o", "gate_up", "down")), id="qwen-fp32-m5",
                           marks=pytest.mark.long)]


@pytest.mark.parametrize("case", STEP_CASES)
def test_step_matches_fused_kernels(case):
    import torch

    dtype, *rest = case
    assert run_ranks(_step_against_fused, 1, (getattr(torch, dtype), *rest), timeout=TIMEOUT, env=ENV)[0]


def _tiny_hf(kind, kv_heads=1):
    """A tiny transformers model of head_dim 64 (flash_decode's smallest), random weights as test_model's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from test_model import LLAMA3_ROPE

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    rope = {"rope_parameters": LLAMA3_ROPE} if kind == "llama" else {}
    config = config_cls(hidden_size=64, num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=64,
                        intermediate_size=96, num_hidden_layers=2, vocab_size=96, rms_norm_eps=1e-6, **rope)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() == 2 else p.normal_(1.0, 0.1)
    model.generation_config.eos_token_id = None
    return model


def _model_paths(kind, batch):
    """Two decode steps on the persistent path against the fused one (bit for bit: flash_decode as its attention,
    as on GPUs) and transformers, from prompts of 18 tokens (the steps' positions in the second attention split),
    and greedy generation on the persistent path against transformers'."""
    import os

    import torch

    from test_model import _close, _decode_steps
    from weft.models import from_hf

    ref = _tiny_hf(kind)
    model = from_hf(ref.config, state_dict=ref.state_dict())
    for block in model.blocks:
        block.attn.decode_attention = "flash_decode"  # the cpu backend's default is SDPA
    assert model.decode_path(batch, "persistent") == "persistent"
    os.environ["WEFT_DECODE"] = "persistent"
    assert model.decode_path(batch) == "persistent"
    del os.environ["WEFT_DECODE"]
    g = torch.Generator().manual_seed(3 + batch)
    prompts = torch.randint(0, 96, (batch, 18), generator=g)
    cont = torch.randint(0, 96, (batch, 2), generator=g)
    want, got = _decode_steps(model, ref, prompts, cont, ("fused", "persistent"), 40)
    with torch.no_grad():
        for j in range(2):
            assert torch.equal(got["persistent"][j], got["fused"][j]), f"{kind} batch {batch} step {j}"
            _close(got["persistent"][j], want[:, j], f"{kind} batch {batch} step {j}: against transformers")
        if batch == 1:
            tokens = model.generate(prompts, 3, decode_path="persistent")
            mask = torch.ones_like(prompts)
            assert tokens.tolist() == ref.generate(prompts, attention_mask=mask, max_new_tokens=3,
                                                   do_sample=False).tolist(), kind
    return True


@pytest.mark.parametrize("kind, batch", [("qwen3", 1), pytest.param("llama", 3, marks=pytest.mark.long)])
def test_persistent_decode_matches_fused_and_transformers(kind, batch):
    assert run_ranks(_model_paths, 1, kind, batch, timeout=TIMEOUT, env=ENV)[0]


def _bad_arguments():
    import torch

    import weft
    from weft.testing.checks import rejects

    g = torch.Generator().manual_seed(1)
    m, hidden, heads, kv_heads, d, inter = 2, 64, 2, 1, 64, 32
    w = _weights(g, 1, hidden, heads, kv_heads, d, inter, True, torch.float32)
    h = torch.randn(m, hidden, generator=g)
    inv = torch.ones(d // 2)
    pos, lens = torch.zeros(m, dtype=torch.int64), torch.ones(m, dtype=torch.int32)
    cache = torch.zeros(1, 2, m, 16, kv_heads, d)

    def step(h=h, w=w, inv=inv, pos=pos, lens=lens, cache=cache, heads=heads, kv_heads=kv_heads, eps=1e-6):
        return lambda: weft.ops.decode_step(h, w, inv, pos, lens, cache, heads, kv_heads, eps)

    def swap(j, t):
        return [t if i == j else x for i, x in enumerate(w)]
    no_qk = swap(2, None)
    cases = [
        (step(), None, None),
        (step(h=h.double()), TypeError, "h has dtype torch.float64"),
        (step(h=h.numpy()), TypeError, "h must be a torch.Tensor"),
        (step(w=swap(1, w[1].bfloat16())), TypeError, "weights[1] (layer 0's qkv) has dtype torch.bfloat16"),
        (step(w=swap(4, w[4][:, :32])), ValueError, "weights[4] (layer 0's o) has shape (128, 32)"),
        (step(w=swap(7, w[7].t().contiguous().t())), None, None),  # stored K-contiguous
        (step(w=swap(7, torch.randn(inter, 2 * hidden)[:, ::2])), ValueError,
         "weights[7] (layer 0's down) must be contiguous, or the transpose of a contiguous tensor"),
        (step(w=w + swap(7, w[7].t().contiguous().t()), cache=torch.zeros(2, 2, m, 16, kv_heads, d)), ValueError,
         "weights[15] (layer 1's down) is stored K-contiguous, layer 0's N-contiguous"),
        (step(w=w[:7]), ValueError, "weights holds 7 tensors: 8 a layer"),
        (step(w=no_qk), ValueError, "give q_norm and k_norm in every layer, or in none"),
        (step(w=[*w[:7], "down"]), TypeError, "weights must be a list of tensors"),
        (step(inv=torch.ones(4)), ValueError, "inv_freq gives head_dim 8"),
        (step(inv=inv.double()), TypeError, "inv_freq has dtype torch.float64"),
        (step(pos=pos.int()), TypeError, "positions has dtype torch.int32"),
        (step(pos=pos[:1]), ValueError, "positions has shape (1,)"),
        (step(lens=lens.long()), TypeError, "lengths has dtype torch.int64"),
        (step(cache=cache[:, :, :1]), ValueError, "cache must be (layers, 2, 2, max_len, 1, 64)"),
        (step(cache=cache.bfloat16()), TypeError, "cache has dtype torch.bfloat16"),
        (step(cache=torch.zeros(2, 2, m, 16, kv_heads, d)), ValueError, "8 a layer for the cache's 2 layers"),
        (step(heads=3, kv_heads=2), ValueError, "heads = 3 is not a multiple of kv_heads = 2"),
        (step(heads=2.0), TypeError, "heads must be an int"),
        (step(eps=-1.0), ValueError, "eps must be >= 0"),
    ]
    for call, error, text in cases:
        if error is None:
            call()  # the valid call the others are variations of
        else:
            rejects(call, error, text, [cache])
    return True


def test_bad_arguments_are_refused():
    assert run_ranks(_bad_arguments, 1, timeout=TIMEOUT, env=ENV)[0]


def _refusals():
    """path="persistent" on a model split over 2 ranks (TP) or 2 stages (a pipeline) is a ValueError saying why;
    WEFT_DECODE=persistent there falls back to the default choice."""
    import os

    import weft
    from weft.models import from_hf
    from weft.testing.checks import rejects

    ref = _tiny_hf("qwen3", kv_heads=2)  # 1 + 1 heads a rank
    tp = from_hf(ref.config, state_dict=ref.state_dict())
    rejects(lambda: tp.decode_path(1, "persistent"), ValueError, "it runs one rank (TP = 1)", [])
    pp = from_hf(ref.config, state_dict=ref.state_dict(), tp_group=weft.new_subgroups(1),
                 pp_group=weft.new_group(range(2)))
    rejects(lambda: pp.decode_path(1, "persistent"), ValueError, "pipeline of 2", [])
    rejects(lambda: tp.with_comm("nccl").decode_path(1, "persistent"), ValueError, "on weft's kernels", [])
    os.environ["WEFT_DECODE"] = "persistent"
    assert tp.decode_path(1) == tp.decode_path(1, None) != "persistent" and pp.decode_path(1) == "layers"
    del os.environ["WEFT_DECODE"]
    return True


def test_tp_and_pipeline_refused():
    assert all(run_ranks(_refusals, 2, timeout=TIMEOUT, env=ENV))
