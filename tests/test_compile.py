"""Every kernel in weft.kernels compiles for sm_90 and sm_80 through triton.compile, on this CPU machine, and the
TMA GEMM kernels keep their accumulators in registers.

The compiles run in subprocesses with the interpreter off (under TRITON_INTERPRET kernels cannot be compiled): each
architecture's cases in two shards, four processes at once, so that CI's two cores stay busy to the end (sm_90 has
the TMA GEMMs, the heaviest cases: one process per architecture left one core idle for most of the run)."""
import os
import subprocess
import sys

SHARDS = 2  # processes per architecture, each compiling every other case
# ptxas's register report for these modules' cases, from the sm_90 run itself (no second compile).
REPORTED = ["gemm", "ag_gemm", "gemm_rs", "moe.grouped_gemm", "moe.tp"]
TMA_KERNELS = ("matmul_kernel", "ag_gemm_kernel", "gemm_rs_kernel", "grouped_gemm_tma_kernel",
               "grouped_gemm_fp8_kernel", "group_gemm_chunks_kernel", "group_gemm_rs_kernel")
POINTER_FORMS = ("'OUT_TMA': False", "'W_TMA': False")


def test_every_kernel_compiles_and_tma_gemms_do_not_spill():
    """Compile errors on either architecture fail. The spill check: every GEMM kernel whose operands and output
    go by TMA, at its GPU configs, compiled as the JIT specialises a call on aligned tensors, spills nothing.
    Their pointer forms (unaligned tensors, rows not whole 16 bytes) may spill; the fp8 grouped GEMM's
    pointer-stored output once spilled 400 bytes, and a compile without the alignment specialisation showed
    thousands of bytes that a real launch does not have."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["WEFT_BACKEND"] = "cuda"
    runs = {(arch, shard): subprocess.Popen([sys.executable, "-m", "weft.testing.compile", str(arch),
                                             f"--shard={shard}/{SHARDS}", *extra],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for arch, extra in ((90, [f"--registers-of={','.join(REPORTED)}"]), (80, [])) for shard in range(SHARDS)}
    out = {90: "", 80: ""}
    for (arch, shard), proc in runs.items():
        stdout, stderr = proc.communicate(timeout=1800)
        assert proc.returncode == 0, f"sm_{arch} shard {shard}:\n{stdout}{stderr}"
        assert "FAIL" not in stdout, f"sm_{arch} shard {shard}:\n{stdout}"
        assert f"kernel cases for sm_{arch} (shard {shard}/{SHARDS})" in stdout, stdout
        out[arch] += stdout
    tma = [line for line in out[90].splitlines()
           if any(f".{k} " in line for k in TMA_KERNELS) and not any(f in line for f in POINTER_FORMS)]
    assert len(tma) >= 40, out[90]
    for line in tma:
        assert line.endswith(" 0 bytes spilled"), line
