import os

import pytest

# The backend is the default one (cpu without a GPU, where these tests run in CI); the gpu tests run
# under `weft run -n N -m pytest -m gpu` (scripts/gpu_suite.sh).
import weft  # noqa: E402  (sets TRITON_INTERPRET before any test module defines a kernel)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs GPUs; run under `weft run -n N -m pytest -m gpu`")


def pytest_collection_modifyitems(config, items):
    if weft.BACKEND == "cuda" and "WORLD_SIZE" in os.environ:
        return
    skip = pytest.mark.skip(reason="gpu test: run under `weft run -n N -m pytest -m gpu` on GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
