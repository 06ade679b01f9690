"""PTX forms of the primitives (GPU only; see interpreter.py for the CPU forms).

Each helper is one instruction with the memory-model qualifier it needs.
Stores and reductions that publish a flag are issued by thread 0 alone,
after the caller's CTA barrier, so one release covers the whole program's
prior stores (barrier + cumulative release).
"""
import triton
import triton.language as tl

from .core import SCOPE_SYS


@triton.jit
def ld_acquire(ptr, scope: tl.constexpr = SCOPE_SYS):
    if ptr.dtype.element_ty.primitive_bitwidth == 64:
        return tl.inline_asm_elementwise(f"ld.acquire.{scope}.global.b64 $0, [$1];", "=l,l", [ptr],
                                         dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise(f"ld.acquire.{scope}.global.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def signal_thread0(ptr, value, add: tl.constexpr, scope: tl.constexpr = SCOPE_SYS):
    """Thread 0 publishes `value` at `ptr`: release store, or release add if `add`."""
    if ptr.dtype.element_ty.primitive_bitwidth == 64:
        _publish_thread0(ptr, value.to(tl.int64), add, scope, "u64", "b64", "l")
    else:
        _publish_thread0(ptr, value.to(tl.int32), add, scope, "s32", "b32", "r")


@triton.jit
def _publish_thread0(ptr, value, add: tl.constexpr, scope: tl.constexpr, ADD_TYPE: tl.constexpr,
                     STORE_TYPE: tl.constexpr, REG: tl.constexpr):
    if add:
        op: tl.constexpr = f"red.release.{scope}.global.add.{ADD_TYPE} [$1], $2;"
    else:
        op: tl.constexpr = f"st.release.{scope}.global.{STORE_TYPE} [$1], $2;"
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; @p " + op + " mov.u32 $0, 0; }",
        "=r,l," + REG, [ptr, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_sys():
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_proxy_async():
    tl.inline_asm_elementwise("fence.proxy.async; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def trap():
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def depend(token):
    """0, computed from `token` behind an opaque instruction: adding it creates a data dependency."""
    return tl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [token.to(tl.int32)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def special_reg(name: tl.constexpr):
    return tl.inline_asm_elementwise(f"mov.u32 $0, %{name};", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def global_timer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def nanosleep(ns: tl.constexpr):
    """Suspend the thread for about `ns` nanoseconds (0 to 2 x ns, as the hardware picks): a spinning wait's
    backoff, which leaves the SM's issue slots to the other programs on it."""
    tl.inline_asm_elementwise(f"nanosleep.u32 {ns}; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def prefetch_l2(ptr, mask):
    """Each thread's lines of `ptr` where `mask` holds, fetched into L2 (a hint: nothing is loaded into registers)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptr, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
