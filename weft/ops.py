"""Host ops: argument checks, cached workspaces, kernel launches."""
from .kernels.all_gather import all_gather
from .kernels.all_reduce import all_reduce, broadcast, reduce_scatter
from .kernels.barrier import device_barrier

__all__ = ["all_gather", "all_reduce", "reduce_scatter", "broadcast", "device_barrier"]
