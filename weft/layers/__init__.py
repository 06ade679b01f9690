"""torch.nn.Module layers built on the weft ops."""
from .attention import SPDecodeAttention, UlyssesAttention

__all__ = ["UlyssesAttention", "SPDecodeAttention"]
