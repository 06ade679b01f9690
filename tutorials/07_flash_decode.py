"""Tutorial 07 — decode attention: split-KV on one GPU, then a KV cache split over GPUs.

    weft run -n 2 tutorials/07_flash_decode.py

At decode time every sequence adds one token, whose query attends to all the keys and values cached so
far: out = softmax(scale * q K^T) V, for each query head, over that sequence's positions. The work is a
read of the whole KV cache with a little arithmetic on it, so the kernel's job is to read the cache at
the memory's full bandwidth. With grouped-query attention (G query heads share one KV head) it scores
all G query heads against a block of keys in one matrix product, so each KV byte is read once.

Split-KV. One (sequence, KV head) is far too little work for one program when the cache is long and the
batch is small: a GPU has over a hundred SMs. So the positions are cut into splits, each program
computes attention over its split only, and a second, tiny kernel merges the splits. The merge is exact
thanks to the log-sum-exp (lse) of each split's scores:

    over split s:  lse_s = log sum_j exp(score_j),   out_s = sum_j exp(score_j - lse_s) v_j
    merged:        lse = log sum_s exp(lse_s),       out = sum_s exp(lse_s - lse) out_s

(the softmax over all positions is the mean of the splits' softmaxes weighted by each split's share
of the normaliser). Part 1 below checks this identity in plain torch; part 2 calls
`weft.ops.flash_decode`, which does it on the GPU: split kernel + merge kernel, paged or contiguous KV.

Across ranks (sequence parallelism). For very long contexts the cache itself is split: rank r holds the
r-th slice of every sequence. The same merge applies with ranks in place of splits, so the ranks only
need to exchange one (out, lse) pair per (sequence, query head) — a few KiB, however long the context.
`weft.ops.sp_flash_decode` costs two launches, as many as flash_decode: the split kernel computes its
slice's partials, then one merge kernel merges each row's splits, pushes the result to every rank as
low-latency (LL) words (4 data bytes and a call counter in one 8-byte store: the receiver sees data and
"it has arrived" at once, with no flag and no fence), and only once all its pushes are out waits for
the other ranks' words and merges the W partials, each in the same lane on every rank, so all ranks get
the same bits. Part 3 checks it against torch over the concatenated cache.
"""
import torch
import torch.distributed as dist

import weft


def attention(q, k, v):
    """Reference for one sequence: q (H, D), k and v (L, KVH, D) with H = G * KVH; (out (H, D), lse (H,))."""
    group = q.shape[0] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * q.shape[-1] ** -0.5
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


def merge(outs, lses):
    """The log-sum-exp merge of partial results: outs (S, H, D), lses (S, H)."""
    lse = torch.logsumexp(lses, dim=0)
    return (torch.exp(lses - lse)[..., None] * outs).sum(0), lse


def part1_split_kv_in_torch():
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 64), torch.randn(100, 2, 64), torch.randn(100, 2, 64)
    splits = [attention(q, k[s:s + 32], v[s:s + 32]) for s in range(0, 100, 32)]  # 4 splits, the last short
    out, lse = merge(torch.stack([o for o, _ in splits]), torch.stack([lse for _, lse in splits]))
    ref_out, ref_lse = attention(q, k, v)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def part2_flash_decode(device):
    """A batch of 3 sequences of different lengths in a paged cache: pages of 16 positions, anywhere."""
    g = torch.Generator().manual_seed(1)
    batch, q_heads, kv_heads, head_dim, page_size = 3, 8, 2, 64, 16
    lens = [45, 1, 20]
    pages_per_seq = 3
    q = torch.randn(batch, q_heads, head_dim, generator=g)
    k_pages = torch.randn(batch * pages_per_seq, page_size, kv_heads, head_dim, generator=g)
    v_pages = torch.randn(batch * pages_per_seq, page_size, kv_heads, head_dim, generator=g)
    block_table = torch.randperm(batch * pages_per_seq, generator=g).view(batch, pages_per_seq).to(torch.int32)
    out, lse = weft.ops.flash_decode(q.to(device), k_pages.to(device), v_pages.to(device),
                                     torch.tensor(lens, dtype=torch.int32, device=device),
                                     block_table=block_table.to(device), return_lse=True)
    for b, n in enumerate(lens):
        k = k_pages[block_table[b].long()].reshape(-1, kv_heads, head_dim)[:n]  # the sequence's positions
        v = v_pages[block_table[b].long()].reshape(-1, kv_heads, head_dim)[:n]
        ref_out, ref_lse = attention(q[b], k, v)
        torch.testing.assert_close(out[b].cpu().double(), ref_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse[b].cpu().double(), ref_lse, rtol=1e-4, atol=1e-4)


def part3_sp_flash_decode(w):
    """Every sequence's cache cut over the ranks (contiguous slices; an empty slice on the last rank for
    sequence 0); every rank knows every slice from the seeds, to check the result."""
    batch, q_heads, kv_heads, head_dim, slice_len = 2, 8, 2, 64, 24
    q = torch.randn(batch, q_heads, head_dim, generator=torch.Generator().manual_seed(2))
    slices = []
    for r in range(w.world_size):
        g = torch.Generator().manual_seed(10 + r)
        k = torch.randn(batch, slice_len, kv_heads, head_dim, generator=g)
        v = torch.randn(batch, slice_len, kv_heads, head_dim, generator=g)
        lens = [0 if r == w.world_size - 1 else 11 + r, slice_len - r]
        slices.append((k, v, lens))
    k, v, lens = slices[w.rank]
    out = weft.ops.sp_flash_decode(q.to(w.device), k.to(w.device), v.to(w.device),
                                   torch.tensor(lens, dtype=torch.int32, device=w.device))
    for b in range(batch):
        full_k = torch.cat([sk[b, :sl[b]] for sk, _, sl in slices])
        full_v = torch.cat([sv[b, :sl[b]] for _, sv, sl in slices])
        torch.testing.assert_close(out[b].cpu().double(), attention(q[b], full_k, full_v)[0], rtol=1e-4, atol=1e-4)
    # The same bits on every rank: each merged the same W partials the same way.
    mine = out.cpu().contiguous().view(torch.uint8)
    every = [torch.empty_like(mine) for _ in range(w.world_size)]
    dist.all_gather_object(every, mine)
    assert all(torch.equal(e, mine) for e in every)


def main():
    weft.init()
    w = weft.world()
    part1_split_kv_in_torch()
    part2_flash_decode(w.device)
    part3_sp_flash_decode(w)
    weft.barrier()
    if w.rank == 0:
        print(f"07_flash_decode: OK on {w.world_size} ranks (split-KV merge in torch, flash_decode on a paged GQA "
              "cache, sp_flash_decode over the ranks' slices, the same bits everywhere)")
    weft.finalize()


if __name__ == "__main__":
    main()
