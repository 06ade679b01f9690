"""Device-side primitives: `import weft.language as wl` inside `@triton.jit` kernels."""
from .core import (CMP_EQ, CMP_GE, CMP_GT, CMP_LE, CMP_LT, CMP_NE, INTERPRET, SCOPE_GPU, SCOPE_SYS, SIGNAL_ADD,
                   SIGNAL_SET, network_pe,
                   num_ranks, rank, remote_ptr, same_node, symm_at)
from .hardware import global_timer, lane_id, prefetch_l2, sm_id, tid
from .interpreter import WaitTimeout
from .shmem import (copy_bytes, getmem_block, putmem_block, putmem_nbi_block, putmem_signal_block,
                    putmem_signal_nbi_block)
from .signals import (barrier_all, check_signed, consume_token, fence, last_epoch, next_epoch, notify, notify_all,
                      pack_ll, program_sync, quiet, sign, signal_op, signal_wait_until, signature_live,
                      signature_words, wait, wait_ll)
from .tile import (ALL_RANKS, ShardMapping, TileMapping, tile_count, tile_flag, tile_notify, tile_offset,
                   tile_offsets, tile_owner, tile_pull, tile_push, tile_rect, tile_wait, tile_wait_tiles)

__all__ = [
    "rank", "num_ranks", "same_node", "network_pe", "symm_at", "remote_ptr", "notify", "notify_all", "wait", "next_epoch", "last_epoch", "pack_ll", "wait_ll",
    "sign", "check_signed", "signature_live", "signature_words", "consume_token", "fence", "program_sync", "quiet",
    "barrier_all", "copy_bytes", "putmem_block", "putmem_nbi_block", "getmem_block", "putmem_signal_block",
    "putmem_signal_nbi_block", "signal_op", "signal_wait_until", "tid", "lane_id", "sm_id", "global_timer",
    "prefetch_l2",
    "CMP_EQ", "CMP_NE", "CMP_GT", "CMP_LE", "CMP_LT", "CMP_GE", "SIGNAL_SET", "SIGNAL_ADD", "SCOPE_SYS", "SCOPE_GPU", "INTERPRET",
    "WaitTimeout", "TileMapping", "ShardMapping", "ALL_RANKS", "tile_count", "tile_owner", "tile_rect",
    "tile_offset", "tile_offsets", "tile_flag", "tile_notify", "tile_wait", "tile_wait_tiles", "tile_push", "tile_pull",
]
