"""Host ops: argument checks, cached workspaces, kernel launches."""
from .kernels.ag_gemm import ag_gemm
from .kernels.all_gather import all_gather
from .kernels.all_reduce import all_reduce, broadcast, reduce_scatter
from .kernels.barrier import device_barrier
from .kernels.flash_decode import flash_decode, sp_flash_decode
from .kernels.gemm_ar import gemm_ar
from .kernels.gemm_rs import gemm_rs
from .kernels.moe import (ep_combine, ep_combine_ll, ep_dispatch, ep_dispatch_ll, grouped_gemm, routing_layout,
                          check_routing_values)

__all__ = ["ag_gemm", "all_gather", "all_reduce", "reduce_scatter", "broadcast", "device_barrier", "gemm_rs", "gemm_ar",
           "flash_decode", "sp_flash_decode", "routing_layout", "check_routing_values", "ep_dispatch", "ep_combine",
           "ep_dispatch_ll", "ep_combine_ll", "grouped_gemm"]
