"""Host ops: argument checks, cached workspaces, kernel launches."""
from .kernels.ag_gemm import ag_gemm
from .kernels.all_gather import all_gather
from .kernels.all_reduce import all_reduce, broadcast, reduce_scatter
from .kernels.barrier import device_barrier
from .kernels.flash_decode import flash_decode, sp_flash_decode
from .kernels.gemm_ar import gemm_ar
from .kernels.gemm_rs import gemm_rs
from .kernels.ulysses import all_to_all_o_proj, qkv_all_to_all, ulysses_all_to_all

__all__ = ["ag_gemm", "all_gather", "all_reduce", "reduce_scatter", "broadcast", "device_barrier", "gemm_rs", "gemm_ar",
           "flash_decode", "sp_flash_decode", "ulysses_all_to_all", "qkv_all_to_all", "all_to_all_o_proj"]
