"""torch.nn.Module layers built on weft's ops (tensor, sequence, context and expert parallelism)."""
from .attention import SPDecodeAttention, UlyssesAttention
from .comm import Comm, NcclComm, WeftComm, make_comm
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import EPMoE, TPMoE
from .transformer import (ParallelLMHead, Positions, RMSNorm, RotaryEmbedding, TensorParallelAttention,
                          TensorParallelMLP, VocabParallelEmbedding)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "UlyssesAttention", "SPDecodeAttention", "RMSNorm",
           "RotaryEmbedding", "VocabParallelEmbedding", "ParallelLMHead", "TensorParallelAttention",
           "TensorParallelMLP", "Positions", "Comm", "WeftComm", "NcclComm", "make_comm", "EPMoE", "TPMoE"]
