"""Compile kernels for a GPU target on a machine with no GPU.

Must run in a process where the interpreter is off (WEFT_BACKEND=cuda,
TRITON_INTERPRET unset): under the interpreter `@triton.jit` makes objects
that `triton.compile` cannot take. CI runs `python -m weft.testing.compile`
in a subprocess; it compiles every `*_kernel` in `weft.kernels` with the
cases each module lists in `COMPILE_CASES`: (kernel, signature, constexprs[, options]); a kernel
with no case fails.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys


def compile_kernel(fn, signature: dict, constexprs: dict | None = None, arch: int = 90, num_warps: int = 4):
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
    src = ASTSource(fn=fn, signature=sig, constexprs=paths)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def kernel_modules():
    import weft.kernels

    for info in pkgutil.iter_modules(weft.kernels.__path__):
        yield importlib.import_module(f"weft.kernels.{info.name}")


def main(arch: int = 90) -> int:
    import triton

    failures, count = [], 0
    for mod in kernel_modules():
        kernels = {name for name, obj in vars(mod).items()
                   if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel")}
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
                compile_kernel(fn, signature, constexprs, arch, **options)
            except Exception as e:  # noqa: BLE001
                failures.append(f"{mod.__name__}.{fn.__name__} {constexprs}: {type(e).__name__}: {e}")
    for f in failures:
        print("FAIL", f)
    print(f"compiled {count - len([f for f in failures if 'COMPILE_CASES' not in f])} of {count} kernel cases for sm_{arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
