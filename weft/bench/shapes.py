"""The tensor-parallel GEMM shapes weft is measured on (bf16, M tokens, W ranks).

AG-GEMM: A (M, K) sharded on M, B (K, N) sharded on N: each rank computes (M, K) @ (K, N / W).
GEMM-RS: A (M, K) sharded on K, B (K, N) sharded on K: each rank computes (M, K / W) @ (K / W, N).
GEMM-AR: decode, the same sharding as GEMM-RS with a small M.
"""
AG_GEMM = [  # (M, N, K)
    (8192, 11008, 4096), (8192, 14336, 4096), (8192, 28672, 8192), (8192, 53248, 16384), (8192, 29568, 8192),
    (4096, 14336, 4096),
]
GEMM_RS = [
    (8192, 4096, 11008), (8192, 4096, 14336), (8192, 3584, 14336), (8192, 4608, 36864), (8192, 8192, 28672),
    (8192, 8192, 29568), (4096, 4096, 14336),
]
GEMM_AR = [(m, 5120, 25600) for m in (1, 8, 32, 128)]


def ag_local(m, n, k, w):
    """Per-rank GEMM (M, N, K) of an AG-GEMM: the full gathered M, an N / W column shard."""
    return m, n // w, k


def rs_local(m, n, k, w):
    """Per-rank GEMM of a GEMM-RS / GEMM-AR: the full M and N, a K / W shard."""
    return m, n, k // w


def scaled(x: int, scale: int, w: int) -> int:
    """x divided by `scale` (cpu runs), kept a positive multiple of 16 * w; x itself where scale is 1."""
    return max(16 * w, x // scale // (16 * w) * (16 * w)) if scale > 1 else x
