"""Every kernel in weft.kernels compiles for sm_90 (and sm_80) through triton.compile, on this CPU machine.

Runs in a subprocess with the interpreter off: under TRITON_INTERPRET kernels cannot be compiled."""
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("arch", [90, 80])
def test_every_kernel_compiles(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["WEFT_BACKEND"] = "cuda"
    res = subprocess.run([sys.executable, "-m", "weft.testing.compile", str(arch)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAIL" not in res.stdout
