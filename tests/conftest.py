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


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect any item
def pytest_collection_modifyitems(config, items):
    check_race_tests(config, items)
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


# Tests that see races: one test per op family runs with the test delay (WEFT_TEST_DELAY, weft/runtime/settings.py):
# the odd ranks stall before every access to a peer and every copy-engine push, up to RACE_TESTS's most µs, so
# that a rank that forgets a wait reads a peer's data before it has arrived (rank 0 is never delayed: it is the
# early reader). One test per family, not the whole suite, to stay within CI's 20 minutes. An explicit
# WEFT_TEST_DELAY (empty: none) overrides the default for every test.
RACE_DELAY = "1,3,5,7:1:50000"
# ag_gemm's cpu pushes run on the host between its barrier and its GEMM launch, which takes an interpreted GEMM's
# start-up (tens of ms, more on a loaded machine) to read a peer's chunk: its stalls must be longer (it has only
# W - 1 pushes and one barrier per call).
RACE_TESTS = {
    "test_language.py::test_ring_of_producers_and_consumers[2]": RACE_DELAY,
    "test_tile.py::test_producer_consumer_mismatched_blocks[2ranks-cols]": RACE_DELAY,
    "test_all_gather.py::test_all_gather_methods[push-2]": RACE_DELAY,
    "test_all_gather.py::test_all_gather_methods[pull-2]": RACE_DELAY,
    "test_all_reduce.py::test_reduce_scatter[2]": RACE_DELAY,
    "test_all_reduce.py::test_broadcast[2]": RACE_DELAY,
    "test_ag_gemm.py::test_ag_gemm_matches_reference[2]": "1,3,5,7:1:300000",
    "test_gemm_rs.py::test_gemm_rs_2_ranks": RACE_DELAY,
    "test_gemm_ar.py::test_gemm_ar_2_ranks": RACE_DELAY,
    "test_flash_decode.py::test_sp_flash_decode_matches_reference[2]": RACE_DELAY,
    "test_ulysses.py::test_all_to_all_bit_exact[2]": RACE_DELAY,
    "test_moe.py::test_ep_dispatch_combine[2]": RACE_DELAY,
    "test_moe.py::test_ep_ll[2]": RACE_DELAY,
    "test_moe_tp.py::test_moe_tp_matches_reference[2]": RACE_DELAY,
}


def _race_test_id(item) -> str:
    return f"{os.path.basename(str(item.path))}::{item.name}"


def check_race_tests(config, items):
    """Every race test of a collected file must exist: a renamed test would silently lose its delay. (Not when
    tests are named one by one: then a file is collected in part.)"""
    if any("::" in str(arg) for arg in config.args):
        return
    collected = {_race_test_id(item) for item in items}
    files = {test.split("::")[0] for test in collected}
    missing = sorted(t for t in RACE_TESTS if t.split("::")[0] in files and t not in collected)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py RACE_TESTS names tests that do not exist: {missing}")


@pytest.fixture(autouse=True)
def race_delay(request, monkeypatch):
    """Forked ranks inherit the delay from this process's environment."""
    if _race_test_id(request.node) in RACE_TESTS and "WEFT_TEST_DELAY" not in os.environ:
        monkeypatch.setenv("WEFT_TEST_DELAY", RACE_TESTS[_race_test_id(request.node)])


@pytest.fixture(scope="module")
def gpu_world():
    """A GPU test module's world (the module runs under `weft run -n N -m pytest`): weft.init() before its first
    test, weft.finalize() after its last. Modules take it through their autouse `world` fixture."""
    w = weft.init()
    yield w
    weft.finalize()
