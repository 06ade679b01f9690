"""CUDA-graph capture for tests and benchmarks: the runtime's, so that they capture as the model does."""
from ..runtime.graphs import capture  # noqa: F401
