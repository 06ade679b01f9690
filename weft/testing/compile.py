"""Compile kernels for a GPU target on a machine with no GPU.

Must run in a process where the interpreter is off (WEFT_BACKEND=cuda,
TRITON_INTERPRET unset): under the interpreter `@triton.jit` makes objects
that `triton.compile` cannot take. CI runs `python -m weft.testing.compile`
in a subprocess; it compiles every `*_kernel` in `weft.kernels` and its subpackages (weft.kernels.moe) with the
cases each module lists in `COMPILE_CASES` for its own kernels: (kernel, signature, constexprs[, options]); a
kernel with no case fails.

`python -m weft.testing.compile 90 --registers [module ...]` (modules as "gemm", "moe.tp"; `--registers-of=gemm,...`
compiles every module and reports these) also assembles each case's PTX with Triton's bundled ptxas and prints its registers and spilled bytes: register spills in a GEMM's
accumulator are a slowdown that shows without a GPU (a report, not a check: some kernels spill).
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile


def compile_kernel(fn, signature: dict, constexprs: dict | None = None, arch: int = 90, num_warps: int = 4,
                   divisible=(), unaligned=()):
    """Compile `fn` for sm_`arch` as the JIT would for a launch whose pointers are 16-byte aligned (torch's
    allocations: the JIT specialises them, and the vector loads and stores follow from it) but those named in
    `unaligned`, and whose integer arguments named in `divisible` are multiples of 16 (a row stride of a
    hidden size: the JIT specialises those too)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, paths = dict(signature), {}
    for key, value in (constexprs or {}).items():
        if isinstance(key, str):  # a constexpr argument
            sig[key] = "constexpr"
            paths[(fn.arg_names.index(key),)] = value
        else:  # (argument, index, ...): a constexpr inside a tuple argument (its signature says "constexpr" there)
            paths[(fn.arg_names.index(key[0]),) + tuple(key[1:])] = value
    attrs = {}
    for name, kind in sig.items():
        index = fn.arg_names.index(name)
        parts = [((), kind)] if isinstance(kind, str) else [((i,), k) for i, k in enumerate(kind)]
        for sub, k in parts:  # a tuple argument's pointers too (wl.TileMapping)
            if (k.startswith("*") and name not in unaligned) or (name in divisible and k[0] in "iu"):
                attrs[(index,) + sub] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=paths, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def kernel_modules(names=None):
    """The modules of weft.kernels, its subpackages' too (weft.kernels.moe.tp), or those of `names` (relative to
    weft.kernels: "gemm", "moe.tp")."""
    import weft.kernels

    for info in pkgutil.walk_packages(weft.kernels.__path__, "weft.kernels."):
        if names is None or info.name.removeprefix("weft.kernels.") in names:
            yield importlib.import_module(info.name)


def registers(compiled, arch: int) -> str:
    """ptxas's account of a compiled kernel: "N registers, M bytes spilled" (Triton's bundled ptxas, -v)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        res = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{'a' if arch == 90 else ''}", ptx, "-o",
                              os.path.join(d, "kernel.cubin")], capture_output=True, text=True)
    regs = next((line.split("Used ")[1].split(",")[0] for line in res.stderr.splitlines() if "Used " in line), "?")
    spill = next((line.split(",")[1].split(" spill")[0].strip() for line in res.stderr.splitlines()
                  if "spill stores" in line), "?")
    return f"{regs}, {spill} spilled"


def main(arch: int = 90, report=False, names=None) -> int:
    """Compile every case of the modules `names` (all of weft.kernels by default); print each case's registers
    and spills where `report` is True, or is a collection of module names (as `names` takes them) holding it."""
    import triton

    failures, count = [], 0
    for mod in kernel_modules(names):
        kernels = {name for name, obj in vars(mod).items()  # the module's own kernels, not those it imports
                   if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel")
                   and obj.fn.__module__ == mod.__name__}
        cases = getattr(mod, "COMPILE_CASES", [])
        covered = {c[0].__name__ for c in cases}
        for name in sorted(kernels - covered):
            failures.append(f"{mod.__name__}.{name}: no entry in COMPILE_CASES")
        for fn, signature, constexprs, *options in cases:  # options: e.g. {"num_warps": 8, "min_arch": 90}
            options = dict(options[0]) if options else {}
            if arch < options.pop("min_arch", 0):
                continue  # e.g. TMA descriptors need sm_90
            count += 1
            try:
                compiled = compile_kernel(fn, signature, constexprs, arch, **options)
            except Exception as e:  # noqa: BLE001
                failures.append(f"{mod.__name__}.{fn.__name__} {constexprs}: {type(e).__name__}: {e}")
                continue
            if report is True or (report and mod.__name__.removeprefix("weft.kernels.") in report):
                consts = {k: v for k, v in constexprs.items() if isinstance(k, str) and isinstance(v, (bool, int))}
                print(f"{mod.__name__}.{fn.__name__} {options.get('num_warps', 4)} warps {consts}: "
                      f"{registers(compiled, arch)}", flush=True)
    for f in failures:
        print("FAIL", f)
    compiled = count - len([f for f in failures if "COMPILE_CASES" not in f])
    print(f"compiled {compiled} of {count} kernel cases for sm_{arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    # --registers: a report for every module compiled; --registers-of=a,b: compile all, report a and b only.
    of = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--registers-of=")), None)
    args = [a for a in sys.argv[1:] if not a.startswith("--registers")]
    arch = int(args[0]) if args else 90
    sys.exit(main(arch, set(of) if of else "--registers" in sys.argv, set(args[1:]) or None))
