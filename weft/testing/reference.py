"""torch.distributed references the tests, the demo and the benchmarks compare against."""
import torch.distributed as dist

# torch >= 2.13 renames all_gather_into_tensor; the GPU machines run 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_ref(out, x, group=None):
    """out = concat over ranks of x (dim 0), by the process group's own collective."""
    return _all_gather_single(out, x, group=group)
