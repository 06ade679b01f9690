"""torch.distributed references the tests, the demo and the benchmarks compare against."""
import torch.distributed as dist

# torch >= 2.13 renames all_gather_into_tensor; the GPU machines run 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_ref(out, x, group=None):
    """out = concat over ranks of x (dim 0), by the process group's own collective."""
    return _all_gather_single(out, x, group=group)


# torch >= 2.13 renames reduce_scatter_tensor the same way.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_ref(out, x, group=None):
    """out on rank r = rows [r * m, (r + 1) * m) of the sum over ranks of x, by the process group's own collective."""
    return _reduce_scatter_single(out, x, group=group)
