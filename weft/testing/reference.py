"""References the tests, the demo and the benchmarks compare against: the process group's own collectives (the
same calls weft's `auto` falls back to), and the torch form of weft's fp8 quantization (what a traced call runs)."""
from ..kernels.common import nccl_all_gather as all_gather_ref  # noqa: F401
from ..kernels.common import nccl_reduce_scatter as reduce_scatter_ref  # noqa: F401
from ..kernels.pointwise import fp8_rows_torch as fp8_rows_ref  # noqa: F401
