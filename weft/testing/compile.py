"""Compile kernels for a GPU target on a machine with no GPU.

Must run in a process where the interpreter is off (WEFT_BACKEND=cuda,
TRITON_INTERPRET unset): under the interpreter `@triton.jit` makes objects
that `triton.compile` cannot take. CI runs `python -m weft.testing.compile`
in a subprocess; it compiles every `*_kernel` in `weft.kernels` and its subpackages (weft.kernels.moe) with the
cases each module lists in `COMPILE_CASES` for its own kernels: (kernel, signature, constexprs[, options]); a
kernel with no case fails.

`python -m weft.testing.compile 90 --registers [module ...]` (modules as "gemm", "moe.tp"; `--registers-of=gemm,...`
compiles every module and reports these) also prints each case's registers and spilled bytes from the log of Triton's
own ptxas run (kept in Triton's cache for the next run): register spills in a GEMM's accumulator are a slowdown that
shows without a GPU (a report, not a check: some kernels spill).

`--shard=K/N` compiles every N-th case from the K-th on (K from 0), so that N processes share the work; the check for
kernels with no case is shard 0's.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile


def compile_kernel(fn, signature: dict, constexprs: dict | None = None, arch: int = 90, num_warps: int = 4,
                   divisible=(), unaligned=(), ptx_options: str | None = None):
    """Compile `fn` for sm_`arch` as the JIT would for a launch whose pointers are 16-byte aligned (torch's
    allocations: the JIT specialises them, and the vector loads and stores follow from it) but those named in
    `unaligned`, and whose integer arguments named in `divisible` are multiples of 16 (a row stride of a
    hidden size: the JIT specialises those too). `ptx_options` go to ptxas: "-c" for a kernel that calls a
    device library linked in only on GPUs (NVSHMEM's), whose calls stay unresolved in a relocatable cubin."""
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
    options = {"num_warps": num_warps}
    if ptx_options is not None:
        options["ptx_options"] = ptx_options
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def kernel_modules(names=None):
    """The modules of weft.kernels, its subpackages' too (weft.kernels.moe.tp), or those of `names` (relative to
    weft.kernels: "gemm", "moe.tp")."""
    import weft.kernels

    for info in pkgutil.walk_packages(weft.kernels.__path__, "weft.kernels."):
        if names is None or info.name.removeprefix("weft.kernels.") in names:
            yield importlib.import_module(info.name)


ACCOUNT_FILE = "weft_ptxas_account.txt"  # beside the kernel in Triton's cache


def compile_with_registers(fn, signature: dict, constexprs: dict | None = None, arch: int = 90, **options):
    """`compile_kernel` and ptxas's account of the kernel: (compiled, "N registers, M bytes spilled"). The account
    is the log of the compile's own ptxas run (-v), kept in Triton's cache entry of the kernel: a cache hit runs no
    ptxas and reads it there (or, where an entry lacks it, runs `registers`)."""
    import contextlib
    import io

    from triton import knobs
    from triton.runtime.cache import get_cache_manager

    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # printed by Triton's make_cubin
        compiled = compile_kernel(fn, signature, constexprs, arch, **options)
    cache = get_cache_manager(compiled.hash)  # the compile's own entry
    kept = cache.get_file(ACCOUNT_FILE)
    if "Used " in log.getvalue():
        account = _ptxas_account(log.getvalue())
    elif kept:
        with open(kept) as f:
            account = f.read()
    else:
        account = registers(compiled, arch)
    if not kept:
        cache.put(account, ACCOUNT_FILE)
    return compiled, account


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
    return _ptxas_account(res.stderr)


def _ptxas_account(log: str) -> str:
    """"N registers, M bytes spilled" from ptxas -v's log."""
    regs = next((line.split("Used ")[1].split(",")[0] for line in log.splitlines() if "Used " in line), "?")
    spill = next((line.split(",")[1].split(" spill")[0].strip() for line in log.splitlines()
                  if "spill stores" in line), "?")
    return f"{regs}, {spill} spilled"


def main(arch: int = 90, report=False, names=None, shard: tuple[int, int] = (0, 1)) -> int:
    """Compile every case of the modules `names` (all of weft.kernels by default), with `shard` (K, N) every N-th of
    those cases from the K-th only; print each case's registers and spills where `report` is True, or is a collection
    of module names (as `names` takes them) holding it."""
    import triton

    index, of = shard
    if not 0 <= index < of:
        raise ValueError(f"shard must be K/N with 0 <= K < N, got {index}/{of}")
    failures, count, position = [], 0, 0
    for mod in kernel_modules(names):
        kernels = {name for name, obj in vars(mod).items()  # the module's own kernels, not those it imports
                   if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel")
                   and obj.fn.__module__ == mod.__name__}
        cases = getattr(mod, "COMPILE_CASES", [])
        covered = {c[0].__name__ for c in cases}
        for name in sorted(kernels - covered) if index == 0 else ():
            failures.append(f"{mod.__name__}.{name}: no entry in COMPILE_CASES")
        reported = report is True or (report and mod.__name__.removeprefix("weft.kernels.") in report)
        for fn, signature, constexprs, *options in cases:  # options: e.g. {"num_warps": 8, "min_arch": 90}
            options = dict(options[0]) if options else {}
            if arch < options.pop("min_arch", 0):
                continue  # e.g. TMA descriptors need sm_90
            position += 1
            if (position - 1) % of != index:
                continue  # another shard's
            count += 1
            try:
                if reported:
                    compiled, account = compile_with_registers(fn, signature, constexprs, arch, **options)
                else:
                    compiled = compile_kernel(fn, signature, constexprs, arch, **options)
            except Exception as e:  # noqa: BLE001
                failures.append(f"{mod.__name__}.{fn.__name__} {constexprs}: {type(e).__name__}: {e}")
                continue
            if reported:
                consts = {k: v for k, v in constexprs.items() if isinstance(k, str) and isinstance(v, (bool, int))}
                print(f"{mod.__name__}.{fn.__name__} {options.get('num_warps', 4)} warps {consts}: {account}",
                      flush=True)
    for f in failures:
        print("FAIL", f)
    compiled = count - len([f for f in failures if "COMPILE_CASES" not in f])
    print(f"compiled {compiled} of {count} kernel cases for sm_{arch}" + (f" (shard {index}/{of})" if of > 1 else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    # --registers: a report for every module compiled; --registers-of=a,b: compile all, report a and b only.
    # --shard=K/N: this process's share of the cases.
    of = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--registers-of=")), None)
    shard = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--shard=")), "0/1")
    args = [a for a in sys.argv[1:] if not a.startswith(("--registers", "--shard="))]
    arch = int(args[0]) if args else 90
    sys.exit(main(arch, set(of) if of else "--registers" in sys.argv, set(args[1:]) or None,
                  tuple(int(part) for part in shard.split("/"))))
