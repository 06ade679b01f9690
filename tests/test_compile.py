"""Every kernel in weft.kernels compiles for sm_90 and sm_80 through triton.compile, on this CPU machine, and the
TMA GEMM kernels keep their accumulators in registers.

The compiles run in subprocesses with the interpreter off (under TRITON_INTERPRET kernels cannot be compiled): an
architecture's cases in two shards at once, so that CI's two cores stay busy to the end. CI compiles for sm_90 only
(the sm_80 compile is marked long)."""
import os
import subprocess
import sys

import pytest

SHARDS = 2  # processes per architecture, each compiling every other case
# ptxas's register report for these modules' cases, from the sm_90 run itself (no second compile).
REPORTED = ["gemm", "ag_gemm", "gemm_rs", "moe.grouped_gemm", "moe.tp"]
TMA_KERNELS = ("matmul_kernel", "ag_gemm_kernel", "gemm_rs_kernel", "grouped_gemm_tma_kernel",
               "grouped_gemm_fp8_kernel", "group_gemm_chunks_kernel", "group_gemm_rs_kernel")
POINTER_FORMS = ("'OUT_TMA': False", "'W_TMA': False")


def _compile(arch: int, *extra: str) -> str:
    """Every kernel case for sm_`arch` in SHARDS processes at once; their output, asserting each succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["WEFT_BACKEND"] = "cuda"
    runs = [subprocess.Popen([sys.executable, "-m", "weft.testing.compile", str(arch), f"--shard={shard}/{SHARDS}",
                              *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for shard in range(SHARDS)]
    out = ""
    for shard, proc in enumerate(runs):
        stdout, stderr = proc.communicate(timeout=1800)
        assert proc.returncode == 0, f"sm_{arch} shard {shard}:\n{stdout}{stderr}"
        assert "FAIL" not in stdout, f"sm_{arch} shard {shard}:\n{stdout}"
        assert f"kernel cases for sm_{arch} (shard {shard}/{SHARDS})" in stdout, stdout
        out += stdout
    return out


def test_every_kernel_compiles_and_tma_gemms_do_not_spill():
    """sm_90 (H100 / H200): compile errors fail. The spill check: every GEMM kernel whose operands and output
    go by TMA, at its GPU configs, compiled as the JIT specialises a call on aligned tensors, spills nothing.
    Their pointer forms (unaligned tensors, rows not whole 16 bytes) may spill; the fp8 grouped GEMM's
    pointer-stored output once spilled 400 bytes, and a compile without the alignment specialisation showed
    thousands of bytes that a real launch does not have."""
    out = _compile(90, f"--registers-of={','.join(REPORTED)}")
    tma = [line for line in out.splitlines()
           if any(f".{k} " in line for k in TMA_KERNELS) and not any(f in line for f in POINTER_FORMS)]
    assert len(tma) >= 40, out
    for line in tma:
        assert line.endswith(" 0 bytes spilled"), line


@pytest.mark.long  # CI compiles for sm_90, the GPUs weft is measured on; the same kernels' sm_80 compile here
def test_every_kernel_compiles_for_sm80():
    _compile(80)
