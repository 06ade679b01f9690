"""References the tests, the demo and the benchmarks compare against: the process group's own collectives (the
same calls weft's `auto` falls back to), the torch form of weft's fp8 quantization (what a traced call runs), and
M2N's combine in the order of its sums."""
import torch

from ..kernels.common import nccl_all_gather as all_gather_ref  # noqa: F401
from ..kernels.common import nccl_reduce_scatter as reduce_scatter_ref  # noqa: F401
from ..kernels.pointwise import fp8_rows_torch as fp8_rows_ref  # noqa: F401


def m2n_combine_ref(x, dest, weights, processed) -> torch.Tensor:
    """What m2n_combine returns a sender of rows x (T, hidden) routed by dest (T, k) with weights (T, k), receiver d
    having turned row t into processed(x[t], d): in its order of fp32 sums (weft/kernels/m2n.py), each receiver's
    entries of a row in j order, then the receivers in the order of their first entries, rounded to x's dtype."""
    want = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for d in dict.fromkeys(int(d) for d in dest[t] if d >= 0):
            row = processed(x[t], d).float()
            part = torch.zeros(x.shape[1], device=x.device)
            for j in range(dest.shape[1]):
                if int(dest[t, j]) == d:
                    part += weights[t, j] * row
            want[t] += part
    return want.to(x.dtype)
