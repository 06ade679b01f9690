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


def test_tma_gemm_kernels_do_not_spill():
    """ptxas's register report (weft.testing.compile --registers, compiled as the JIT specialises a call on
    aligned tensors): every GEMM kernel whose operands and output go by TMA, at its GPU configs, keeps its
    accumulator in registers. Their pointer forms (unaligned tensors, rows not whole 16 bytes) may spill; the
    fp8 grouped GEMM's pointer-stored output once spilled 400 bytes, and a compile without the alignment
    specialisation showed thousands of bytes that a real launch does not have."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["WEFT_BACKEND"] = "cuda"
    modules = ["gemm", "ag_gemm", "gemm_rs", "moe.grouped_gemm", "moe.tp"]
    res = subprocess.run([sys.executable, "-m", "weft.testing.compile", "90", "--registers", *modules],
                         capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stdout + res.stderr
    kernels = ("matmul_kernel", "ag_gemm_kernel", "gemm_rs_kernel", "grouped_gemm_tma_kernel",
               "grouped_gemm_fp8_kernel", "group_gemm_chunks_kernel", "group_gemm_rs_kernel")
    pointer_forms = ("'OUT_TMA': False", "'W_TMA': False")
    tma = [line for line in res.stdout.splitlines()
           if any(f".{k} " in line for k in kernels) and not any(f in line for f in pointer_forms)]
    assert len(tma) >= 40, res.stdout
    for line in tma:
        assert line.endswith(" 0 bytes spilled"), line
