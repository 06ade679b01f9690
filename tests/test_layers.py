"""The tensor-parallel decoder's layers (weft/layers/transformer.py) on cpu ranks, each against its dense torch
counterpart written out here (rope by complex rotation, attention by an explicit masked softmax), in both
layouts (sequence-parallel and plain TP) and with both comms; and their refusals of shapes that do not
divide by the world size, before anything is allocated."""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 200


def _rms(x, weight, eps=1e-6):
    return weight * (x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt())


def _rope(x, positions, theta):
    """x (..., S, heads, d) rotated at positions (S,): the halves (x1, x2) as x1 + i x2 times e^(i pos θ^(-2j/d))."""
    import torch

    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2).double() / d)
    turn = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64), positions[:, None].double() * freqs)
    z = torch.complex(x[..., :d // 2].double(), x[..., d // 2:].double()) * turn[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).float()


def _attention(x, wq, wk, wv, wo, heads, kv_heads, positions, theta, q_norm=None, k_norm=None):
    """Dense causal grouped-query attention of one sequence x (S, hidden) at positions (S,)."""
    import torch

    s, d = x.shape[0], wq.shape[0] // heads
    q, k, v = (x @ w.t() for w in (wq, wk, wv))
    q, k, v = q.view(s, heads, d), k.view(s, kv_heads, d), v.view(s, kv_heads, d)
    if q_norm is not None:
        q, k = _rms(q, q_norm), _rms(k, k_norm)
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1) @ wo.t()


def _close(got, want, what):
    import torch

    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda s: f"{what}: {s}")


def _layers_match_dense():
    import torch
    import torch.nn.functional as F

    import weft
    from weft.layers import (ParallelLMHead, Positions, RMSNorm, RotaryEmbedding, TensorParallelAttention,
                             TensorParallelMLP, VocabParallelEmbedding)

    me, w = weft.rank(), weft.world_size()
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    hidden, tokens = 32, 6 * w
    x = randn(tokens, hidden, scale=1.0)
    mine = slice(me * 6, (me + 1) * 6)  # this rank's rows in the sequence-parallel layout
    for comm in ("weft", "nccl"):
        # Embedding and LM head: 37 tokens of vocabulary, not a multiple of the world size.
        table = randn(37, hidden)
        ids = torch.randint(0, 37, (tokens,), generator=g)
        emb = VocabParallelEmbedding.from_dense(table, me, w, comm)
        assert torch.equal(emb(ids), F.embedding(ids, table)), comm  # one non-zero term per sum: exact
        assert torch.equal(emb(ids, sequence_parallel=True), F.embedding(ids, table)[mine]), comm
        head = ParallelLMHead.from_dense(table, me, w, comm)
        _close(head(x), x @ table.t(), f"{comm} lm head")
        _close(head(x[mine], sequence_parallel=True), x @ table.t(), f"{comm} lm head, sequence-parallel")

        norm_weight, residual = randn(hidden) + 1, randn(tokens, hidden)
        _close(RMSNorm(norm_weight, 1e-6)(x), _rms(x, norm_weight), "rmsnorm")
        normed, stream = RMSNorm(norm_weight, 1e-6)(x, residual)
        assert torch.equal(stream, x + residual)
        _close(normed, _rms(x + residual, norm_weight), "rmsnorm of x + residual")

        gate, up, down = randn(24 * w, hidden), randn(24 * w, hidden), randn(hidden, 24 * w)
        mlp = TensorParallelMLP.from_dense(gate, up, down, me, w, comm)
        want = (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
        _close(mlp(x[mine]), want[mine], f"{comm} mlp, sequence-parallel")
        _close(mlp(x, sequence_parallel=False), want, f"{comm} mlp, plain TP")

    # Attention: 2 sequences of 3 * W tokens, prefill then 2 decode steps; Qwen3's q/k norms; GQA. head_dim 64 for
    # flash_decode (under the interpreter here), 16 for the SDPA path.
    theta = 500.0
    batch, seq = 2, 3 * w
    for comm, d, decode_attention, qk_norm in (("weft", 16, "sdpa", True), ("nccl", 16, "auto", False),
                                               ("weft", 64, "flash_decode", True)):
        heads, kv_heads = 4 * w, 2 * w
        wq, wk, wv = randn(heads * d, hidden), randn(kv_heads * d, hidden), randn(kv_heads * d, hidden)
        wo = randn(hidden, heads * d)
        qn, kn = (randn(d) + 1, randn(d) + 1) if qk_norm else (None, None)
        attn = TensorParallelAttention.from_dense(wq, wk, wv, wo, heads, kv_heads, me, w, q_norm=qn, k_norm=kn,
                                                  comm=comm, decode_attention=decode_attention)
        assert attn.decode_attention == ("sdpa" if decode_attention == "auto" else decode_attention)
        rope = RotaryEmbedding(d, theta)
        seqs = randn(batch, seq + 2, hidden, scale=1.0)
        want = [_attention(s, wq, wk, wv, wo, heads, kv_heads, torch.arange(seq + 2), theta, qn, kn) for s in seqs]
        what = f"{comm} attention d={d} {decode_attention}"
        cache = torch.full((2, batch, seq + 4, kv_heads // w, d), 1e4)  # positions past a length: must not count
        rows = slice(me * batch * seq // w, (me + 1) * batch * seq // w)
        prompts = seqs[:, :seq].reshape(-1, hidden)[rows]
        want_prefill = torch.cat([y[:seq] for y in want])[rows]
        _close(attn(prompts, Positions.prefill(batch, seq, rope)), want_prefill, f"{what}: prefill, no cache")
        _close(attn(prompts, Positions.prefill(batch, seq, rope), (cache[0], cache[1])), want_prefill,
               f"{what}: prefill")
        for j in range(2):
            got = attn.decode(seqs[:, seq + j], Positions.decode(torch.tensor([seq + j] * batch), rope),
                              (cache[0], cache[1]))
            _close(got, torch.stack([y[seq + j] for y in want]), f"{what}: decode step {j}")
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_layers_match_dense(world_size):
    run_ranks(_layers_match_dense, world_size, timeout=TIMEOUT, env=ENV)


def test_shapes_that_do_not_divide_are_refused():
    import torch

    from weft.layers import TensorParallelAttention, TensorParallelMLP, VocabParallelEmbedding
    from weft.testing.checks import rejects

    def attn(heads, kv_heads, world_size, d=16, rank=0, **kw):
        w = {name: torch.zeros(n * d, 32) for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
        args = kw.pop("args", (w["q"], w["k"], w["v"], torch.zeros(32, heads * d)))
        return lambda: TensorParallelAttention.from_dense(*args, heads, kv_heads, rank, world_size, device="cpu", **kw)

    rejects(attn(4, 2, 3), ValueError, "heads = 4 is not divisible by the group size 3", [])
    rejects(attn(8, 2, 4), ValueError, "kv_heads = 2 is not divisible by the group size 4", [])
    rejects(attn(6, 4, 2), ValueError, "heads = 6 is not a multiple of kv_heads = 4", [])
    rejects(attn(4, 2, 2, rank=2), ValueError, "rank must be in [0, 2)", [])
    rejects(attn(4, 2, 2, args=(torch.zeros(64, 32), torch.zeros(16, 32), torch.zeros(32, 32), torch.zeros(32, 64))),
            ValueError, "k_weight has shape (16, 32), expected (32, 32)", [])
    rejects(attn(4, 2, 2, args=("q", None, None, None)), TypeError, "q_weight must be a torch.Tensor", [])
    rejects(attn(4, 2, 2, decode_attention="flash"), ValueError, "decode_attention must be one of", [])
    rejects(attn(4, 2, 2, decode_attention="flash_decode"), ValueError, "needs head_dim in", [])
    gate = torch.zeros(10, 32)
    rejects(lambda: TensorParallelMLP.from_dense(gate, gate, torch.zeros(32, 10), 0, 4, device="cpu"), ValueError,
            "intermediate_size = 10 is not divisible by the group size 4", [])
    rejects(lambda: TensorParallelMLP.from_dense(gate, gate, torch.zeros(10, 32), 0, 2, device="cpu"), ValueError,
            "down_weight has shape", [])
    rejects(lambda: VocabParallelEmbedding.from_dense(torch.zeros(37), 0, 2, device="cpu"), ValueError,
            "weight has shape", [])
