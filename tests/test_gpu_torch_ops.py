"""GPU checks of weft's PyTorch operators and parallel layers, on every rank:
`weft run -n N -m pytest tests/test_gpu_torch_ops.py -m gpu` (scripts/gpu_suite.sh, part torchops).

- torch.compile(mode="reduce-overhead") of a sequence-parallel TP MLP: CUDA-graph trees capture weft's
  operators, and the replays (fresh inputs copied in by the graph tree) match eager;
- forward and backward of the layers (sequence-parallel and plain TP) in bf16 against the same MLP on one GPU;
- forward and backward of the sequence-parallel block captured in one CUDA graph (as `weft bench tpmlp` times
  it) and replayed on fresh inputs: the same gradients as eager calls.
"""
import pytest
import torch
from torch import nn

import weft
from weft.layers import ColumnParallelLinear, RowParallelLinear
from weft.testing.graphs import capture

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    yield weft.world()


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _reference(d, hidden, dtype):
    torch.manual_seed(0)  # the same model on every rank
    return nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d)).to(weft.device(), dtype)


def _parallel(ref, sequence_parallel):
    w, me = weft.world_size(), weft.rank()
    return nn.Sequential(ColumnParallelLinear.from_linear(ref[0], me, w, sequence_parallel), nn.SiLU(),
                         RowParallelLinear.from_linear(ref[2], me, w, sequence_parallel))


@pytest.mark.parametrize("tokens", [256, 4096])  # the baseline path and the overlapped kernels
def test_reduce_overhead_compile_replays(tokens):
    w, me = weft.world_size(), weft.rank()
    d, hidden = 1024, 1024 * w
    ref = _reference(d, hidden, torch.bfloat16)
    mlp = _parallel(ref, True)
    torch._dynamo.reset()  # each size compiled on its own, static shapes (not the previous case's recompile)
    fn = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
    # A pool tensor no output accounts for is reported with the stack that allocated it.
    with torch.no_grad(), torch._inductor.config.patch({"triton.cudagraph_trees_history_recording": True}):
        for step in range(6):  # warm-up, recording, then replays
            g = torch.Generator(device=weft.device()).manual_seed(step)
            x = torch.randn(tokens, d, device=weft.device(), generator=g, dtype=torch.bfloat16)
            mine = x[me * tokens // w:(me + 1) * tokens // w]
            got = fn(mine).clone()
            want = mlp(mine)
            assert _rel(got, want) < 1e-2, (step, _rel(got, want))
            assert _rel(got, ref(x)[me * tokens // w:(me + 1) * tokens // w]) < 2e-2, step


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("tokens", [256, 4096])
def test_layers_forward_backward_match_one_gpu(sequence_parallel, tokens):
    w, me = weft.world_size(), weft.rank()
    d, hidden = 1024, 2048 * w
    ref = _reference(d, hidden, torch.bfloat16)
    mlp = _parallel(ref, sequence_parallel)
    g = torch.Generator(device=weft.device()).manual_seed(7)
    x = torch.randn(tokens, d, device=weft.device(), generator=g, dtype=torch.bfloat16).requires_grad_()
    grad_y = torch.randn(tokens, d, device=weft.device(), generator=g, dtype=torch.bfloat16)
    ref(x).backward(grad_y)
    rows = slice(me * tokens // w, (me + 1) * tokens // w) if sequence_parallel else slice(None)
    xs = x.detach()[rows].clone().requires_grad_()
    y = mlp(xs)
    y.backward(grad_y[rows])
    h = hidden // w
    assert _rel(y, ref(x)[rows]) < 2e-2
    for name, got, want in (("x", xs.grad, x.grad[rows]),
                            ("column weight", mlp[0].weight.grad, ref[0].weight.grad[me * h:(me + 1) * h].t()),
                            ("column bias", mlp[0].bias.grad, ref[0].bias.grad[me * h:(me + 1) * h]),
                            ("row weight", mlp[2].weight.grad, ref[2].weight.grad[:, me * h:(me + 1) * h].t()),
                            ("row bias", mlp[2].bias.grad, ref[2].bias.grad)):
        assert _rel(got, want) < 2e-2, (name, _rel(got, want))


@pytest.mark.parametrize("tokens", [256, 4096])
def test_layers_forward_backward_replay_from_a_cuda_graph(tokens):
    w = weft.world_size()
    d, hidden = 1024, 2048 * w
    mlp = _parallel(_reference(d, hidden, torch.bfloat16), True)
    inputs = [torch.zeros(tokens // w, d, device=weft.device(), dtype=torch.bfloat16, requires_grad=True)]
    wrt = inputs + list(mlp.parameters())
    grad_y = torch.zeros(tokens // w, d, device=weft.device(), dtype=torch.bfloat16)

    def step():
        return torch.autograd.grad(mlp(inputs[0]), wrt, grad_y)

    def fresh(seed):  # drawn on the host: no random draw near a capture
        g = torch.Generator().manual_seed(seed * 100 + weft.rank())
        with torch.no_grad():
            inputs[0].copy_(torch.randn(inputs[0].shape, generator=g))
            grad_y.copy_(torch.randn(grad_y.shape, generator=g))

    fresh(0)
    step()  # plans and workspaces are made outside capture
    captured = []
    graph = capture(lambda: captured.append(step()), warmups=3)
    for trial in range(1, 4):
        fresh(trial)
        graph.replay()
        want = step()
        for i, (got, ref) in enumerate(zip(captured[-1], want)):
            assert _rel(got, ref) < 1e-2, (trial, i, _rel(got, ref))
