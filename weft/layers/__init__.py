"""torch.nn.Module layers built on weft's ops (tensor, sequence, context and expert parallelism)."""
from .attention import SPDecodeAttention, UlyssesAttention
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import EPMoE, TPMoE

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "UlyssesAttention", "SPDecodeAttention", "EPMoE", "TPMoE"]
