"""The op families: one module (or package) per family, its @triton.jit kernels beside its host ops, each op declared
once (registry.py) and planned, launched and given its workspace by the shared infrastructure (common.py)."""
