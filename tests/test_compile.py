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


def test_grouped_gemm_tma_kernels_do_not_spill():
    """ptxas's register report (weft.testing.compile --registers): the grouped GEMM's TMA kernels, bf16 and fp8
    at their GPU configs, keep their accumulators in registers (the fp8 kernel's pointer-stored output tile
    once spilled 400 bytes; its pointer form, for rows not whole 16 bytes, still may)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["WEFT_BACKEND"] = "cuda"
    res = subprocess.run([sys.executable, "-m", "weft.testing.compile", "90", "--registers", "grouped_gemm"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    kernels = ("grouped_gemm_tma_kernel", "grouped_gemm_fp8_kernel")
    tma = [line for line in res.stdout.splitlines()
           if any(k in line for k in kernels) and "'OUT_TMA': False" not in line]
    assert len(tma) >= 6, res.stdout
    for line in tma:
        assert line.endswith(" 0 bytes spilled"), line
