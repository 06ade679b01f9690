"""Host ops: argument checks, cached workspaces, kernel launches."""
from .kernels.all_gather import all_gather
from .kernels.barrier import device_barrier

__all__ = ["all_gather", "device_barrier"]
