"""Triton kernel for `kestrel_kernels.spec_tree.topk_probs`: softmax top-k of vocabulary rows.

The draft takes the top k (k = 1..16) of a 49k-wide softmax once per draft step. torch's
softmax then topk costs about 75 us a row group on the H200, one block radix-selecting a
whole row: 17% of a batch-1 tree iteration. Here the row is cut into chunks:

- `_chunk_topk_kernel`, one program per (row, chunk): the chunk's max, its sum of
  exp(x - max), and its k best logits with their token ids;
- `_merge_topk_kernel`, one program per row: the row's max and softmax denominator from
  the chunk partials, and the k best of the k * chunks candidates, as probabilities.

Ties go to the lower token id, as in the reference's stable sort. Sums run in another
order than torch's softmax, so probabilities agree to fp32 rounding. Rows need at least k
finite logits. No host reads: the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "topk_probs_triton"]

CHUNK = 2048  # logits per program of the first kernel: 24 programs a row at V = 49152

if HAS_TRITON:

    @triton.jit
    def _chunk_topk_kernel(X, stride_x, V, PartMax, PartSum, PartVal, PartIdx, C,
                           K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        part = row * C + c
        tl.store(PartMax + part, m)
        tl.store(PartSum + part, tl.sum(tl.exp(x - m), 0))
        for j in tl.static_range(K):
            best = tl.max(x, 0)
            at = tl.min(tl.where(x == best, offs, V + BLOCK), 0)  # lowest id among ties
            tl.store(PartVal + part * K + j, best)
            tl.store(PartIdx + part * K + j, at)
            x = tl.where(offs == at, float("-inf"), x)

    @triton.jit
    def _merge_topk_kernel(PartMax, PartSum, PartVal, PartIdx, OutP, OutIdx, C, NO_ID,
                           K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CK: tl.constexpr):
        row = tl.program_id(0)
        cc = tl.arange(0, BLOCK_C)
        m = tl.load(PartMax + row * C + cc, mask=cc < C, other=float("-inf"))
        s = tl.load(PartSum + row * C + cc, mask=cc < C, other=0.0)
        top = tl.max(m, 0)
        denom = tl.sum(tl.where(cc < C, s * tl.exp(m - top), 0.0), 0)
        j = tl.arange(0, BLOCK_CK)
        ok = j < C * K
        v = tl.load(PartVal + row * C * K + j, mask=ok, other=float("-inf"))
        ids = tl.load(PartIdx + row * C * K + j, mask=ok, other=NO_ID)
        for t in tl.static_range(K):
            best = tl.max(v, 0)
            at = tl.min(tl.where(v == best, ids, NO_ID), 0)
            tl.store(OutP + row * K + t, tl.exp(best - top) / denom)
            tl.store(OutIdx + row * K + t, at.to(tl.int64))
            v = tl.where(ids == at, float("-inf"), v)


def topk_probs_triton(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`kestrel_kernels.spec_tree.topk_probs` in two launches; logits [T, V] of any float dtype."""
    T, V = logits.shape
    if not 1 <= k <= V:
        raise ValueError(f"top-k needs 1 <= k <= V, got k={k}, V={V}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    C = triton.cdiv(V, CHUNK)
    dev = logits.device
    part_max = torch.empty(T, C, dtype=torch.float32, device=dev)  # [T, C] fp32 chunk max
    part_sum = torch.empty(T, C, dtype=torch.float32, device=dev)  # [T, C] fp32 sum exp(x - max)
    part_val = torch.empty(T, C, k, dtype=torch.float32, device=dev)  # [T, C, k] fp32 best logits
    part_idx = torch.empty(T, C, k, dtype=torch.int32, device=dev)  # [T, C, k] int32 their ids
    out_p = torch.empty(T, k, dtype=torch.float32, device=dev)  # [T, k] fp32
    out_idx = torch.empty(T, k, dtype=torch.int64, device=dev)  # [T, k] int64
    if T == 0:
        return out_p, out_idx
    _chunk_topk_kernel[(T, C)](logits, logits.stride(0), V, part_max, part_sum, part_val,
                               part_idx, C, K=k, BLOCK=CHUNK)
    _merge_topk_kernel[(T,)](part_max, part_sum, part_val, part_idx, out_p, out_idx, C,
                             V + CHUNK, K=k, BLOCK_C=triton.next_power_of_2(C),
                             BLOCK_CK=triton.next_power_of_2(C * k))
    return out_p, out_idx
