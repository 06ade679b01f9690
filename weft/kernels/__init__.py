"""@triton.jit kernels, one module per family, each with its host op."""
