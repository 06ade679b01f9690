"""The GEMM under the overlapped ops: persistent, TMA-fed, grouped tile order (Hopper).

c = a @ b with a (M, K) and b (K, N) row-major; bf16, fp16 or fp32 inputs
(fp32 uses tf32 on the GPU), fp32 accumulation, output in the input dtype.

Shape of the kernel (after Triton's tutorial 09-persistent-matmul):
- a persistent grid of one program per SM walks the output tiles with a stride
  of the grid size, so there is one launch and no tail of half-empty waves;
- tiles are visited in groups of GROUP_M row-blocks, so the B columns a group
  needs stay in L2 while its A rows stream through;
- A and B tiles arrive by TMA (tensor descriptors made on the host), and the
  K loop is software-pipelined NUM_STAGES deep.

The building blocks (`tile_of`, `mma`, `dot`) are shared with the overlapped
kernels (ag_gemm, gemm_rs, gemm_ar), which add flag waits before the K loop
or signals after the epilogue.

TMA needs 16-byte aligned row strides: K and N must be multiples of 16 bytes
(8 bf16/fp16 elements, 4 fp32). Any M, N, K otherwise; ragged edges are
zero-filled by the descriptor on load and clipped on store.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import weft.language as wl

from .. import tuning

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# -- device building blocks -----------------------------------------------------

@triton.jit
def dot(a, b, acc):
    """acc + a @ b. (Triton 3.6's interpreter gets bf16 dots wrong: on the cpu backend, multiply in fp32.)"""
    if wl.INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def tile_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of the tile-th output tile in grouped order:
    GROUP_M row blocks are walked column by column, so a group reuses B from L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m, pid_n


@triton.jit
def mma(a_desc, b_desc, off_m, off_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """fp32 a[off_m:+BLOCK_M, :] @ b[:, off_n:+BLOCK_N] over k_tiles K blocks, TMA loads NUM_STAGES deep."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(k_tiles, num_stages=NUM_STAGES):
        a = a_desc.load([off_m, k * BLOCK_K])
        b = b_desc.load([k * BLOCK_K, off_n])
        acc = dot(a, b, acc)
    return acc


# -- kernel ---------------------------------------------------------------------

@triton.jit
def matmul_kernel(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
                  NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr):
    """c = a @ b. Program p computes tiles p, p + NUM_PROGRAMS, ... in grouped order.

    FLATTEN fuses the tile and K loops into one pipelined loop, so the next
    tile's first loads overlap this tile's epilogue. Which pays is measured
    per shape class (gpu_configs).
    """
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = tile_of(tile, num_m, num_n, GROUP_M)
        acc = mma(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


# -- configs --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    flatten: bool = True
    # Persistent programs per SM (matmul and grouped_gemm): 2 lets one program's MMAs run while the other
    # scales or stores, where two fit an SM's registers and shared memory. (Triton 3.6's warp specialisation
    # is not here: on sm_90 it leaves a loop of 8 warps as it is and fails to compile one of 4.)
    programs_per_sm: int = 1

    def label(self) -> str:
        """The config in one line, as the sweeps print it: "128x256x64 g8 s3 w8 flat"."""
        per_sm = f" {self.programs_per_sm}/SM" if self.programs_per_sm > 1 else ""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} s{self.num_stages} w{self.num_warps}"
                + (" flat" if self.flatten else "") + per_sm)

    def constexprs(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=self.group_m,
                    NUM_STAGES=self.num_stages)


# Small blocks for the Triton interpreter (cost grows with the number of tl ops, not their size).
CPU_CONFIG = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4, flatten=False)

# GPU configs by shape class, measured by `weft bench -n 1 matmul --sweep` (weft.tuning: gemm.configs, the
# shapes whose best config differs from their class's in gemm.tuned, and the class bounds gemm.skinny_max_m
# and gemm.small_max_output).


@tuning.memo
def gpu_configs(device: torch.device) -> dict[str, GemmConfig]:
    """The GPU configs by shape class ("large", "small", "medium", "skinny") for `device`'s GPU model."""
    return {name: GemmConfig(**fields) for name, fields in tuning.value("gemm.configs", device).items()}


def shipped_configs() -> list[GemmConfig]:
    """Every distinct GPU config of the shipped tables (for the compile check)."""
    return list(dict.fromkeys(GemmConfig(**fields) for configs in tuning.shipped("gemm.configs")
                              for fields in configs.values()))


def shape_class(m: int, n: int, k: int, device: torch.device) -> str:
    if m <= tuning.value("gemm.skinny_max_m", device):
        return "skinny"
    for tm, tn, tk, name in tuning.value("gemm.tuned", device):
        if (tm, tn, tk) == (m, n, k):
            return name
    return "small" if m * n <= tuning.value("gemm.small_max_output", device) else "large"


@tuning.memo
def config_for(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    if device.type != "cuda":
        return CPU_CONFIG
    return gpu_configs(device)[shape_class(m, n, k, device)]


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


# -- host side ------------------------------------------------------------------

def check_operands(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor, device: torch.device,
                   layout: bool = True) -> None:
    """TypeError/ValueError naming the argument unless a (·, K) @ b (K, N) can run on the TMA path (with
    `layout=False`: unless torch.matmul can take them)."""
    for name, t in ((a_name, a), (b_name, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, but this rank's device is {device}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in DTYPES)}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if not layout:
            continue
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if (t.shape[1] * t.element_size()) % 16:
            raise ValueError(f"{name} has {t.shape[1]} columns: rows must be a multiple of 16 bytes "
                             f"({16 // t.element_size()} elements of {t.dtype}) for TMA")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start 16-byte aligned")
    if a.dtype != b.dtype:
        raise TypeError(f"{a_name} and {b_name} must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{a_name} has {a.shape[1]} columns but {b_name} has {b.shape[0]} rows")


class Descriptor(TensorDescriptor):
    """A TMA descriptor argument whose tensor can change call by call: an op's plan keeps one and swaps its
    `base` (same shape, strides and alignment: the plan's key guarantees it), which costs less host time
    than building a descriptor per call.

    The launch reads the base's address only, so after it the plan lets go of the call's tensor (`off`): a
    plan that kept its caller's tensors would keep them alive between calls, which CUDA-graph trees
    (torch.compile's "reduce-overhead") reject as memory of their pool that no output accounts for."""

    def on(self, t: torch.Tensor) -> "Descriptor":
        self.base = t
        return self

    def off(self) -> None:
        self.base = None


def descriptor(t: torch.Tensor, block) -> Descriptor:
    return Descriptor(t, t.shape, t.stride(), list(block))


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
           config: GemmConfig | None = None) -> torch.Tensor:
    """a @ b on this rank with the persistent TMA kernel (not collective)."""
    device = a.device if isinstance(a, torch.Tensor) else torch.device("cpu")
    check_operands("a", a, "b", b, device)
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype != a.dtype
          or not out.is_contiguous() or out.device != device):
        raise ValueError(f"out must be a contiguous {a.dtype} tensor of shape {(m, n)} on {device}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or config_for(m, n, k, device)
    programs = min(num_sms(device) * cfg.programs_per_sm, triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n))
    matmul_kernel[(programs,)](
        descriptor(a, (cfg.block_m, cfg.block_k)), descriptor(b, (cfg.block_k, cfg.block_n)),
        descriptor(out, (cfg.block_m, cfg.block_n)), m, n, k, NUM_PROGRAMS=programs, FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps, **cfg.constexprs())
    return out



COMPILE_CASES = [
    (matmul_kernel,
     dict(a_desc=f"tensordesc<{t}[{c.block_m}, {c.block_k}]>", b_desc=f"tensordesc<{t}[{c.block_k}, {c.block_n}]>",
          c_desc=f"tensordesc<{t}[{c.block_m}, {c.block_n}]>", M="i32", N="i32", K="i32"),
     dict(NUM_PROGRAMS=132, FLATTEN=c.flatten, **c.constexprs()), dict(num_warps=c.num_warps, min_arch=90))
    for t in ("bf16", "fp16") for c in shipped_configs()
]
