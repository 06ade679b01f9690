"""The cross-rank signature check on GPUs: members whose all_reduce plans disagree get weft.SignatureMismatch from
weft.check_errors() (the device records it; the host reads it without a sync), after both plans are warm and when
one member replays a captured call while the other calls another size; then matching calls work again.
Run: `WEFT_WAIT_TIMEOUT_S=30 weft run -n 2 -m pytest tests/test_gpu_signature.py -m gpu` (2 or more GPUs)."""
import pytest
import torch

import weft

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world():
    weft.init()
    if weft.world_size() < 2:
        weft.finalize()
        pytest.skip("needs 2 or more ranks")
    yield
    weft.finalize()


def _sizes():
    # Two sizes one-shot takes alike (same grid and passes): the disagreement only the check can see.
    return (10_000, 12_000) if weft.rank() == 0 else (12_000, 10_000)


def _matching(n=4096):
    x = torch.full((n,), float(weft.rank() + 1), device="cuda")
    got = weft.ops.all_reduce(x, method="one_shot")
    torch.cuda.synchronize()
    assert torch.all(got == sum(range(1, weft.world_size() + 1)))


def _expect_mismatch(call):
    """`call()` disagrees with the peer's call: the mismatch raises at that call (when the record is already
    there as the host looks) or at weft.check_errors() after it, never later."""
    with pytest.raises(weft.SignatureMismatch, match="all_reduce"):
        call()
        torch.cuda.synchronize()
        weft.check_errors()


def test_a_mismatch_between_warm_plans_is_reported_on_every_rank():
    a, b = _sizes()
    for n in sorted((a, b)):  # both plans made and run, matching, on every rank (the same order)
        x = torch.ones(n, device="cuda")
        torch.testing.assert_close(weft.ops.all_reduce(x, method="one_shot"), x * weft.world_size())
    _expect_mismatch(lambda: weft.ops.all_reduce(torch.ones(a, device="cuda"), method="one_shot"))  # 10k / 12k
    _matching()


def test_a_replayed_call_that_disagrees_is_reported():
    n = 10_000
    x = torch.ones(n, device="cuda")
    weft.ops.all_reduce(x, method="one_shot")  # plan made outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = weft.ops.all_reduce(x, method="one_shot")
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * weft.world_size())
    if weft.rank() == 0:
        _expect_mismatch(graph.replay)  # 10k from the graph
    else:
        _expect_mismatch(lambda: weft.ops.all_reduce(torch.ones(12_000, device="cuda"), method="one_shot"))
    _matching()
