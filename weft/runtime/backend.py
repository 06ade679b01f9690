"""Which backend this process runs on, decided once, before any kernel is defined.

`cpu` runs every kernel under Triton's interpreter, so it must set
TRITON_INTERPRET before the first `@triton.jit` executes: `import weft` does
that by importing this module first. `weft.language` reads `INTERPRET` at
trace time to pick a primitive's interpreter form or its PTX form.
"""
import os

from . import settings

BACKENDS = ("cpu", "cuda")


def _choose() -> str:
    name = settings.get("WEFT_BACKEND")
    if name:
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


BACKEND = _choose()
if BACKEND == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
# Kernels are interpreted exactly when Triton was told so; the sm_90 compile
# check runs with WEFT_BACKEND=cuda and the interpreter off on a CPU machine.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Multicast (NVLS) can take a shared host's GPUs out of service: never on.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
for _k, _v in SAFE_ENV.items():
    os.environ[_k] = _v
