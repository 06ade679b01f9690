"""GPU checks of the tensor-parallel decoder (weft.models), on every rank:
`weft run -n N -m pytest tests/test_gpu_model.py -m gpu` (scripts/gpu_suite.sh, part e2e).

A Qwen3-8B-shaped model cut to 2 layers, random bf16 weights, against transformers' Qwen3ForCausalLM with
the same weights on one GPU (every rank runs it on its own):
- the full forward's logits, on weft's ops and on NCCL + cuBLAS, for prompts long enough for the
  overlapped GEMMs (ag_gemm / gemm_rs) and not a multiple of every world size;
- prefill into the KV cache then decode steps, against transformers' full forward at those positions;
- decode replayed from the CUDA graph against eager decode, and generate() with graphs (batch 3 in the
  bucket of 4) against generate() without;
- the fused decode path (WEFT_DECODE=fused) against the layers path and transformers, both graph-replayed;
- at one rank, the persistent decode step (WEFT_DECODE=persistent, weft/kernels/decode_step.py) over 200
  graph-replayed steps: the same bits in two sessions, with and without its L2 prefetch, and within tolerance of
  the fused path and transformers.
"""
import pytest
import torch

import weft
from weft.models import DecodeSession, from_hf

pytestmark = pytest.mark.gpu

QWEN3_8B_2_LAYERS = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, tie_word_embeddings=False)
TOL = 3e-2  # relative error of bf16 logits: the two sum their GEMMs' partial products in different orders


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    yield weft.world()


@pytest.fixture(scope="module")
def reference(world):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    with torch.device(world.device):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_8B_2_LAYERS)).to(torch.bfloat16).eval()
    # .to(bfloat16) casts the rotary frequencies too (a buffer), which from_pretrained(dtype=bfloat16) keeps in
    # fp32: their bf16 rounding turns angles by up to position * 2^-9 rad, 0.2 relative error in the logits at
    # position 2048. Back to fp32, as a loaded model has them.
    rotary = model.model.rotary_emb
    half = torch.arange(0, QWEN3_8B_2_LAYERS["head_dim"], 2, dtype=torch.int64, device=world.device).float()
    rotary.inv_freq = 1.0 / QWEN3_8B_2_LAYERS["rope_theta"] ** (half / QWEN3_8B_2_LAYERS["head_dim"])
    if hasattr(rotary, "original_inv_freq"):
        rotary.original_inv_freq = rotary.inv_freq
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def models(reference):
    model = from_hf(reference.config, state_dict=reference.state_dict())
    return {"weft": model, "nccl": model.with_comm("nccl")}


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _ids(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, QWEN3_8B_2_LAYERS["vocab_size"], (batch, seq), generator=g).to(weft.device())


@pytest.mark.parametrize("comm", ["weft", "nccl"])
def test_forward_matches_transformers(reference, models, comm):
    ids = _ids(2, 601, 1)  # 1202 tokens: overlapped GEMMs; padded to a multiple of 4 and 8 ranks
    with torch.no_grad():
        want = reference(ids).logits
    got = models[comm](ids)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert _rel(got, want) < TOL, _rel(got, want)


@pytest.mark.parametrize("comm", ["weft", "nccl"])
def test_prefill_and_graph_decode_match_transformers(reference, models, comm):
    model = models[comm]
    seqs = _ids(2, 604, 2)
    with torch.no_grad():
        want = reference(seqs).logits
    caches = [model.new_cache(2, 640) for _ in range(2)]
    graphed = DecodeSession(model, caches[0])  # captured before its cache is filled (its warm-up writes position 0)
    for cache in caches:
        got = model.prefill(seqs[:, :600], cache)
        assert _rel(got, want[:, 599]) < TOL, ("prefill", _rel(got, want[:, 599]))
    for j in range(4):
        eager = model.decode(seqs[:, 600 + j], torch.full((2,), 600 + j, device=weft.device()), caches[1])
        replayed = graphed.step(seqs[:, 600 + j], 600 + j)
        assert _rel(replayed, want[:, 600 + j]) < TOL, (j, _rel(replayed, want[:, 600 + j]))
        assert _rel(replayed, eager) < 1e-3, (j, _rel(replayed, eager))


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_fused_decode_matches_layers_under_graph_replay(reference, models, batch):
    """The fused decode path (weft/kernels/decode.py; split-K GEMVs at these shapes) against the layers path and
    transformers, both replayed from their CUDA graphs, steps after a prefill of the same prompts."""
    model = models["weft"]
    seqs = _ids(batch, 68, 4 + batch)
    with torch.no_grad():
        want = reference(seqs).logits
    sessions = {path: DecodeSession(model, model.new_cache(batch, 128), path=path) for path in ("fused", "layers")}
    for s in sessions.values():
        assert s.graph is not None and s.path in sessions
        model.prefill(seqs[:, :64], s.cache)
    for j in range(4):
        got = {path: s.step(seqs[:, 64 + j], 64 + j).clone() for path, s in sessions.items()}
        assert _rel(got["fused"], want[:, 64 + j]) < TOL, (j, _rel(got["fused"], want[:, 64 + j]))
        assert _rel(got["fused"], got["layers"]) < TOL, (j, _rel(got["fused"], got["layers"]))


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("prefetch_rows", [16, 0])
def test_persistent_decode_under_graph_replay(reference, models, batch, prefetch_rows):
    """The persistent decode step (one launch for both layers; tasks ordered by counters in global memory) over 200
    steps replayed from its CUDA graph: the same bits in two sessions (a task that read its input before the phase
    before had written it, or a stale L1 line, would make them differ at some step), within TOL of the fused path's
    six kernels a layer at every step and of transformers at the first steps. Not bit for bit against the fused
    path: the same program bodies compiled into one kernel round a few q/k elements differently (measured on 1x
    H200: last-bit differences in the rotated keys at some positions, which the cache then carries). One session at
    a time: a session's graph uses its plans' workspaces, so the plans are dropped only once its session is, and
    the module's earlier plans are put back (the model's cached sessions replay into their workspaces)."""
    from weft import tuning
    from weft.kernels.decode_step import settings

    model, world = models["weft"], weft.world()
    if model.persistent_refusal() is not None:
        pytest.skip(model.persistent_refusal())
    seqs = _ids(batch, 40, 21 + batch)
    with torch.no_grad():
        want = reference(seqs[:, :36]).logits
    runs, saved = [], dict(world.plans)
    with tuning.overrides({"decode.persistent": dict(settings(world.device), prefetch_rows=prefetch_rows)}):
        for path in ("fused", "persistent", "persistent"):
            world.plans.clear()
            session = DecodeSession(model, model.new_cache(batch, 256), path=path)
            assert session.graph is not None and session.path == path
            model.prefill(seqs[:, :32], session.cache)
            runs.append(torch.stack([session.step(seqs[:, 32 + j % 8], 32 + j).clone() for j in range(200)]))
            del session
            torch.cuda.synchronize()
    world.plans.clear()
    world.plans.update(saved)
    fused, persistent, again = runs
    for j in range(4):
        assert _rel(persistent[j], want[:, 32 + j]) < TOL, (j, _rel(persistent[j], want[:, 32 + j]))
    differ = (persistent != again).flatten(1).any(1).nonzero().flatten().tolist()
    assert not differ, f"steps {differ[:10]} of the persistent step differ between two sessions"
    worst = max(_rel(persistent[j], fused[j]) for j in range(200))
    assert worst < TOL, f"the persistent step differs from the fused path by {worst:.2e} (relative) at worst"


def test_generate_with_graphs_equals_eager(models):
    prompts = _ids(3, 40, 3)  # batch 3 runs in the bucket of 4, with graphs and without
    with_graphs = models["weft"].generate(prompts, 16)
    assert models["weft"].sessions.keys() >= {(4, True, models["weft"].decode_path(4))}
    assert torch.equal(with_graphs, models["weft"].generate(prompts, 16, cuda_graph=False))  # the same kernels
    sampled = models["weft"].generate(prompts, 8, do_sample=True, top_k=50, seed=1)
    everyone = [torch.empty_like(sampled) for _ in range(weft.world_size())]
    torch.distributed.all_gather(everyone, sampled, group=weft.world().group)
    assert all(torch.equal(t, sampled) for t in everyone), "ranks sampled different tokens"


def test_pipeline_stages_match_one_process(reference):
    """The same model as a pipeline of 2 stages over the world, each stage a TP group of half the ranks (the 2 layers
    one per stage: PP 2 on 2 GPUs, PP 2 x TP 2 on 4; on 1 GPU one stage): the full forward's logits, and greedy
    generation in micro-batches, against the one-process model of weft's own (the same bf16 kernels, so the tokens
    agree where the logits do)."""
    world = weft.world_size()
    stages = min(2, world)
    if world % stages:
        pytest.skip("the world does not split into 2 stages")
    tp = world // stages
    tp_group = weft.new_subgroups(tp)
    pp = None
    for first in range(tp):  # stage s holds ranks s * tp ... s * tp + tp - 1; a pipeline links one rank of each
        made = weft.new_group(range(first, world, tp))  # None on the ranks outside it
        pp = pp or made
    staged = from_hf(reference.config, state_dict=reference.state_dict(), tp_group=tp_group, pp_group=pp)
    alone = from_hf(reference.config, state_dict=reference.state_dict(), tp_group=weft.new_subgroups(1))
    ids = torch.randint(0, 151936, (3, 37), generator=torch.Generator().manual_seed(8)).to(weft.device())
    with torch.no_grad():
        assert _rel(staged(ids), reference(ids).logits) < TOL
        got = staged.generate(ids, 6, cuda_graph=False)
        want = alone.generate(ids, 6, cuda_graph=False)
    assert torch.equal(got[:, :37], ids) and got.shape == (3, 43)
    assert (got == want).float().mean().item() > 0.8, (got, want)  # bf16 near-ties may flip a late token
