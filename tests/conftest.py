import os

import pytest

# The backend is the default one (cpu without a GPU, where these tests run in CI); the gpu tests run
# under `weft run -n N -m pytest -m gpu` (scripts/gpu_suite.sh).
import weft  # noqa: E402  (sets TRITON_INTERPRET before any test module defines a kernel)


# CI (CI=true, 2 cores) skips the `long` cases, the largest sizes of tests that also run smaller, so that `make test`
# stays within its 20 minutes there; WEFT_LONG_TESTS=1 runs them, and every run outside CI does.
LONG = os.environ.get("CI") == "true" and os.environ.get("WEFT_LONG_TESTS") != "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs GPUs; run under `weft run -n N -m pytest -m gpu`")
    config.addinivalue_line("markers", "long: the largest size of a test that also runs smaller; skipped in CI")


def pytest_collection_modifyitems(config, items):
    if LONG:
        skip_long = pytest.mark.skip(reason="long: skipped in CI (WEFT_LONG_TESTS=1 runs it)")
        for item in items:
            if "long" in item.keywords:
                item.add_marker(skip_long)
    if weft.BACKEND == "cuda" and "WORLD_SIZE" in os.environ:
        return
    skip = pytest.mark.skip(reason="gpu test: run under `weft run -n N -m pytest -m gpu` on GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
