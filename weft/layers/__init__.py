"""torch.nn.Module layers built on weft's ops (tensor, sequence and context parallelism)."""
from .attention import SPDecodeAttention, UlyssesAttention
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "UlyssesAttention", "SPDecodeAttention"]
