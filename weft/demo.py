"""The main demo: all-gather across every rank, push and pull, checked against torch.distributed."""
import torch

import weft
from weft.testing.reference import all_gather_ref


def main() -> None:
    weft.init()
    w = weft.world()
    n = 1 << 10 if w.device.type == "cpu" else 1 << 20
    x = torch.randn(n, 4, device=w.device) + w.rank
    ref = torch.empty(w.world_size * n, 4, device=w.device)
    all_gather_ref(ref, x, w.group)
    sym_out = weft.empty(ref.shape, ref.dtype)
    results = {
        "pull into a plain tensor": weft.ops.all_gather(x, method="pull"),
        "push into a symmetric tensor": weft.ops.all_gather(x, out=sym_out, method="push"),
        "push, copied out": weft.ops.all_gather(x, method="push"),
    }
    ok = {name: torch.equal(out, ref) for name, out in results.items()}
    weft.ops.device_barrier()
    weft.barrier()
    if w.rank == 0:
        print(f"weft demo: all_gather of {tuple(x.shape)} {x.dtype} per rank on {w.world_size} ranks "
              f"({w.backend} backend)")
        for name, good in ok.items():
            print(f"  {name:32s} {'bit-exact vs torch.distributed' if good else 'MISMATCH'}")
    if not all(ok.values()):
        raise SystemExit(f"rank {w.rank}: all_gather mismatch")
    weft.finalize()


if __name__ == "__main__":
    main()
