"""torch.nn.Module layers built on weft's ops (tensor and sequence parallelism)."""
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
