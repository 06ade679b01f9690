"""Issue-34 checks on GPUs: a device-side bounds check under CUDA-graph replay (a captured flash_decode whose block
table later names a page that does not exist reports it at weft.check_errors(), reads nothing outside the cache, and
the next good replay is right), and the soak of tests/test_soak.py (random ops, groups, sizes, dtypes, every result
against torch, heap and memory constant after warm-up) on the rank's GPU.
Run: `weft run -n N -m pytest tests/test_gpu_faults.py -m gpu` (N = 1, 2, ...); WEFT_SOAK_CALLS sets the soak's
length (default 2000)."""
import os
import re

import pytest
import torch

import weft
from weft.kernels import flash_decode as fd

from test_soak import _soak

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world(gpu_world):
    return gpu_world


def _paged_case(batch=3, heads=4, kv_heads=2, dim=64, page=16, pages_per_row=4):
    g = torch.Generator(device="cuda").manual_seed(7)
    n_pages = batch * pages_per_row
    q = torch.randn(batch, heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    k_pages = torch.randn(n_pages, page, kv_heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    v_pages = torch.randn(n_pages, page, kv_heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    table = torch.randperm(n_pages, device="cuda", generator=g).view(batch, pages_per_row).to(torch.int32)
    lens = torch.tensor([page * pages_per_row, 5, page + 3], device="cuda", dtype=torch.int32)
    return q, k_pages, v_pages, lens, table


def _reference(q, k_pages, v_pages, lens, table):
    """Attention of each row over its pages, gathered through the table (torch, fp32)."""
    batch, heads, dim = q.shape
    kv_heads = k_pages.shape[2]
    outs = []
    for b in range(batch):
        k = k_pages[table[b].long()].flatten(0, 1)[:lens[b]].float()
        v = v_pages[table[b].long()].flatten(0, 1)[:lens[b]].float()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].float(), k) / dim ** 0.5
        outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(outs)


def test_a_bad_page_in_a_replayed_graph_is_reported_and_never_read():
    q, k_pages, v_pages, lens, table = _paged_case()
    out = fd.flash_decode(q, k_pages, v_pages, lens, block_table=table)  # the plan, outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fd.flash_decode(q, k_pages, v_pages, lens, block_table=table)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), _reference(q, k_pages, v_pages, lens, table), atol=2e-2, rtol=2e-2)
    good = table.clone()
    table[1, 0] = 1_000_000  # a page far outside the cache: reading it would fault
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=re.escape("block_table row 1 names page 1000000")):
        weft.check_errors()
    weft.check_errors()  # reported once
    table.copy_(good)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), _reference(q, k_pages, v_pages, lens, table), atol=2e-2, rtol=2e-2)


def test_soak_on_the_gpu():
    calls = int(os.environ.get("WEFT_SOAK_CALLS", 2000))
    assert _soak(calls, f"cuda:{torch.cuda.current_device()}")
