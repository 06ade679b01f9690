"""weft's ops as PyTorch operators (declared with each op: weft/kernels/registry.py) and the parallel linear
layers (weft/layers/linear.py): gradients against a single-process torch reference, torch.compile against eager, torch.library.opcheck, and
the eager path's direct calls.

Every rank builds every rank's inputs from one seed, so each checks its own gradients against the reference
on its own. fp32 throughout: the references are tight.
"""
import pytest

from weft.testing import run_ranks

ENV = {"WEFT_WAIT_TIMEOUT_S": "60"}
TIMEOUT = 240
TOL = dict(rtol=1e-5, atol=1e-5)


def _randn(seed, *shape):
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _op_gradients():
    """Every differentiable op: rank me's gradients of sum_r <y_r, g_r> against torch on all ranks' tensors."""
    import torch

    import weft

    w, me = weft.world_size(), weft.rank()
    m, k, n = 3, 5, 4

    def check(name, make_inputs, forward, reference):
        """make_inputs(r) -> rank r's inputs; forward(*inputs) -> weft's outputs (a tuple) on this rank;
        reference(all ranks' inputs) -> every rank's outputs (a list of tuples), in torch."""
        inputs = [[t.requires_grad_() for t in make_inputs(r)] for r in range(w)]
        outs = reference(inputs)
        grads = [[_randn(1000 + 10 * r + i, *o.shape) for i, o in enumerate(out)] for r, out in enumerate(outs)]
        sum((o * g).sum() for out, gs in zip(outs, grads) for o, g in zip(out, gs)).backward()
        mine = [t.detach().clone().requires_grad_() for t in inputs[me]]
        got = forward(*mine)
        for o, ref in zip(got, outs[me]):
            torch.testing.assert_close(o, ref, **TOL, msg=lambda s: f"{name} forward: {s}")
        sum((o * g).sum() for o, g in zip(got, grads[me])).backward()
        for i, (t, ref) in enumerate(zip(mine, inputs[me])):
            want = torch.zeros_like(ref) if ref.grad is None else ref.grad  # an input no output depends on
            torch.testing.assert_close(t.grad, want, **TOL, msg=lambda s: f"{name} grad of input {i}: {s}")

    def shards(total):  # rank q's row block of a (w * m, ...) tensor
        return [total[q * m:(q + 1) * m] for q in range(w)]

    check("all_reduce", lambda r: [_randn(r, m, n)], lambda x: (weft.ops.all_reduce(x),),
          lambda ins: [(sum(x for x, in ins),)] * w)
    check("all_gather", lambda r: [_randn(r, m, n)], lambda x: (weft.ops.all_gather(x),),
          lambda ins: [(torch.cat([x for x, in ins]),)] * w)
    check("reduce_scatter", lambda r: [_randn(r, w * m, n)], lambda x: (weft.ops.reduce_scatter(x),),
          lambda ins: [(s,) for s in shards(sum(x for x, in ins))])
    check("broadcast", lambda r: [_randn(r, m, n)], lambda x: (weft.ops.broadcast(x * 1, root=w - 1),),
          lambda ins: [(ins[w - 1][0] * 1,)] * w)
    # ag_gemm: a_shard (m, k), b (k, n) the rank's column shard; the gathered A's own gradient counts too.
    check("ag_gemm", lambda r: [_randn(r, m, k), _randn(50 + r, k, n)], lambda a, b: (weft.ops.ag_gemm(a, b),),
          lambda ins: [(torch.cat([a for a, _ in ins]) @ b,) for _, b in ins])
    check("ag_gemm return_gathered", lambda r: [_randn(r, m, k), _randn(50 + r, k, n)],
          lambda a, b: weft.ops.ag_gemm(a, b, return_gathered=True),
          lambda ins: [(torch.cat([a for a, _ in ins]) @ b, torch.cat([a for a, _ in ins])) for _, b in ins])
    check("ag_gemm, a only", lambda r: [_randn(r, m, k)], lambda a: (weft.ops.ag_gemm(a, _randn(50 + me, k, n)),),
          lambda ins: [(torch.cat([a for a, in ins]) @ _randn(50 + r, k, n),) for r in range(w)])
    # gemm_rs: a (w * m, k) and b_shard (k, n), the rank's slice of the contraction.
    check("gemm_rs", lambda r: [_randn(r, w * m, k), _randn(50 + r, k, n)], lambda a, b: (weft.ops.gemm_rs(a, b),),
          lambda ins: [(s,) for s in shards(sum(a @ b for a, b in ins))])
    check("gemm_rs, b only", lambda r: [_randn(50 + r, k, n)], lambda b: (weft.ops.gemm_rs(_randn(me, w * m, k), b),),
          lambda ins: [(s,) for s in shards(sum(_randn(r, w * m, k) @ b for r, (b,) in enumerate(ins)))])
    check("gemm_ar", lambda r: [_randn(r, m, k), _randn(50 + r, k, n)], lambda a, b: (weft.ops.gemm_ar(a, b),),
          lambda ins: [(sum(a @ b for a, b in ins),)] * w)


def _layer_gradients():
    """Column -> SiLU -> row, from the same nn.Linear pair, sequence-parallel and plain TP, against the
    single-process MLP: outputs, the input's gradient and every weight and bias gradient (this rank's shard)."""
    import torch
    from torch import nn

    import weft
    from weft.layers import ColumnParallelLinear, RowParallelLinear

    w, me = weft.world_size(), weft.rank()
    tokens, d, hidden = 2 * w, 6, 4 * w
    torch.manual_seed(0)  # the same reference model on every rank
    fc1, fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
    x = _randn(1, tokens, d).requires_grad_()
    g = _randn(2, tokens, d)
    (fc2(nn.functional.silu(fc1(x))) * g).sum().backward()
    ref = fc2(nn.functional.silu(fc1(x))).detach()
    h, t = hidden // w, tokens // w
    for sp in (True, False):
        col = ColumnParallelLinear.from_linear(fc1, me, w, sequence_parallel=sp)
        row = RowParallelLinear.from_linear(fc2, me, w, sequence_parallel=sp)
        rows = slice(me * t, (me + 1) * t) if sp else slice(None)
        xs = x.detach()[rows].clone().requires_grad_()
        y = row(nn.functional.silu(col(xs)))
        what = f"sequence_parallel={sp}"
        torch.testing.assert_close(y, ref[rows], **TOL, msg=lambda s: f"{what} output: {s}")
        (y * g[rows]).sum().backward()
        for name, got, want in (("x", xs.grad, x.grad[rows]),
                                ("column weight", col.weight.grad, fc1.weight.grad[me * h:(me + 1) * h].t()),
                                ("column bias", col.bias.grad, fc1.bias.grad[me * h:(me + 1) * h]),
                                ("row weight", row.weight.grad, fc2.weight.grad[:, me * h:(me + 1) * h].t()),
                                ("row bias", row.bias.grad, fc2.bias.grad)):
            torch.testing.assert_close(got, want, **TOL, msg=lambda s: f"{what} grad of {name}: {s}")


@pytest.mark.parametrize("w", [2, 3])
def test_gradients_match_single_process_torch(w):
    def body():
        _op_gradients()
        _layer_gradients()
    run_ranks(body, w, timeout=TIMEOUT, env=ENV)


def _compiled_mlps_match_eager():
    """A two-block TP MLP (column, SiLU, row, twice), sequence-parallel and plain TP, compiled with
    fullgraph=True against eager: outputs, the input's and every parameter's gradient, two calls."""
    import torch
    from torch import nn

    import weft
    from weft.layers import ColumnParallelLinear, RowParallelLinear

    w, me = weft.world_size(), weft.rank()
    d, hidden, t = 8, 4 * w, 2
    torch.manual_seed(0)
    linears = [nn.Linear(d, hidden), nn.Linear(hidden, d), nn.Linear(d, hidden), nn.Linear(hidden, d)]

    def mlp(sp):
        layers = [cls.from_linear(lin, me, w, sp)
                  for cls, lin in zip([ColumnParallelLinear, RowParallelLinear] * 2, linears)]
        return nn.Sequential(layers[0], nn.SiLU(), layers[1], layers[2], nn.SiLU(), layers[3])

    for sp in (True, False):
        eager, compiled = mlp(sp), mlp(sp)
        fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
        for step in range(2):  # the second call replays what the first compiled
            x = _randn(10 * step + (me if sp else 0), t, d)  # plain TP: the same tokens on every rank
            xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
            ye, yc = eager(xe), fn(xc)
            what = f"sequence_parallel={sp} step {step}"
            torch.testing.assert_close(yc, ye, **TOL, msg=lambda s: f"{what}: {s}")
            ye.square().sum().backward()
            yc.square().sum().backward()
            torch.testing.assert_close(xc.grad, xe.grad, **TOL, msg=lambda s: f"{what} x: {s}")
            for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
                torch.testing.assert_close(pc.grad, pe.grad, **TOL, msg=lambda s: f"{what} {name}: {s}")
    # The graph holds weft's operators, not a graph break around their direct calls.
    from torch._dynamo.utils import counters
    assert not counters["graph_break"], dict(counters["graph_break"])


def _compiled_collectives_match_eager():
    """In place (all_reduce(x, out=x), broadcast), into an `out`, and ag_gemm's gathered A with a gradient of its
    own, compiled against eager. broadcast's backward drops its all_reduce's result off the root: compiled, that
    all_reduce must survive dead-code elimination, or the ranks' collectives pair up wrongly."""
    import torch

    import weft

    w, me = weft.world_size(), weft.rank()

    def program(x, b):
        y = x * 2
        weft.ops.all_reduce(y, out=y)
        weft.ops.broadcast(y, root=w - 1)
        gathered = torch.empty(w * x.shape[0], x.shape[1])
        weft.ops.all_gather(y, out=gathered)
        c, a = weft.ops.ag_gemm(x, b, return_gathered=True)
        return c.sum() + (a * gathered).sum()

    fn = torch.compile(program, fullgraph=True, backend="aot_eager")
    x, b = _randn(me, 3, 4), _randn(10 + me, 4, 8)
    xe, be, xc, bc = (t.clone().requires_grad_() for t in (x, b, x, b))
    want, got = program(xe, be), fn(xc, bc)
    torch.testing.assert_close(got, want, **TOL)
    want.backward()
    got.backward()
    torch.testing.assert_close(xc.grad, xe.grad, **TOL)
    torch.testing.assert_close(bc.grad, be.grad, **TOL)


def test_compile_fullgraph_matches_eager():
    def body():
        _compiled_mlps_match_eager()
        _compiled_collectives_match_eager()
    run_ranks(body, 2, timeout=TIMEOUT, env=ENV)


def _opchecks():
    import torch

    import weft

    w, me, name = weft.world_size(), weft.rank(), weft.world().name  # operators take the group by name
    t = lambda seed, *shape: _randn(seed + me, *shape).requires_grad_()  # noqa: E731
    cases = [
        (torch.ops.weft.all_reduce, (t(0, 3, 4), name)),
        (torch.ops.weft.all_reduce_, (_randn(1 + me, 3, 4), name)),
        (torch.ops.weft.all_gather, (t(2, 3, 4), name)),
        (torch.ops.weft.reduce_scatter, (t(3, 2 * w, 4), name)),
        (torch.ops.weft.broadcast, (t(4, 5), name, 1)),
        (torch.ops.weft.broadcast_, (_randn(4 + me, 5), name, 1)),
        (torch.ops.weft.ag_gemm, (t(5, 3, 4), t(6, 4, 8), name)),
        (torch.ops.weft.ag_gemm, (t(7, 3, 4), t(8, 4, 8), name, "auto", True)),
        (torch.ops.weft.gemm_rs, (t(9, 2 * w, 4), t(10, 4, 8), name)),
        (torch.ops.weft.gemm_ar, (t(11, 3, 4), t(12, 4, 8), name)),
    ]
    q = _randn(20, 2, 2, 64)
    kv = _randn(21, 2, 16, 1, 64)
    cases += [(torch.ops.weft.flash_decode, (q, kv, kv, torch.tensor([16, 5], dtype=torch.int32))),
              (torch.ops.weft.sp_flash_decode, (q, kv, kv, torch.tensor([16, 5 * me], dtype=torch.int32), name))]
    for op, args in cases:
        # Every utility runs the op for real, several times; every rank runs the same sequence of calls, so
        # the collectives meet. The results are compared within a rank, never across.
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


def test_opcheck():
    run_ranks(_opchecks, 2, timeout=TIMEOUT, env=ENV)


def _eager_calls_are_direct():
    """With every torch.ops.weft operator replaced by one that raises, every eager call still works; a call
    that autograd must record goes through the operator."""
    import torch

    import weft

    w = weft.world_size()
    names = ["all_reduce", "all_reduce_", "all_gather", "reduce_scatter", "broadcast", "broadcast_", "ag_gemm", "gemm_rs",
             "gemm_ar", "flash_decode", "sp_flash_decode"]
    ns = torch.ops.weft
    saved = {name: getattr(ns, name) for name in names}
    calls = []

    def forbidden(name):
        def op(*args, **kwargs):
            calls.append(name)
            return saved[name](*args, **kwargs)
        return op

    for name in names:
        setattr(ns, name, forbidden(name))
    try:
        x = _randn(0, 2 * w, 4)
        assert torch.equal(weft.ops.all_reduce(x), x * w)
        weft.ops.all_reduce(x.clone(), out=x)
        weft.ops.all_gather(x)
        weft.ops.reduce_scatter(x)
        weft.ops.broadcast(x)
        weft.ops.ag_gemm(x, _randn(1, 4, 8))
        weft.ops.gemm_rs(x, _randn(1, 4, 8))
        weft.ops.gemm_ar(x, _randn(1, 4, 8))
        q, kv, lens = _randn(2, 1, 2, 64), _randn(3, 1, 8, 1, 64), torch.tensor([8], dtype=torch.int32)
        weft.ops.flash_decode(q, kv, kv, lens)
        weft.ops.sp_flash_decode(q, kv, kv, lens)
        with torch.no_grad():
            weft.ops.gemm_ar(x, _randn(1, 4, 8).requires_grad_())
        assert calls == [], calls
        weft.ops.gemm_ar(x, _randn(1, 4, 8).requires_grad_())
        assert calls == ["gemm_ar"], calls
        with pytest.raises(ValueError, match="no weft group of that name"):  # the operators' group is checked
            saved["all_gather"](x, "no-such-group")
    finally:
        for name in names:
            setattr(ns, name, saved[name])


def test_eager_calls_skip_the_operator_dispatch():
    run_ranks(_eager_calls_are_direct, 2, timeout=TIMEOUT, env=ENV)
