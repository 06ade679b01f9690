"""Helpers for multi-rank tests: run one function on N cpu ranks; compile kernels for sm_90."""
from .ranks import RankFailure, run_ranks
