"""Triton kernel for `kestrel_kernels.sampling._top_k_top_p`: top-k then top-p without a sort.

The reference sorts every row: at 512 tree nodes x 49152 ids that sort was half of a
sampled tree step on the H200 (7.35 against 3.63 ms). A nucleus needs only two numbers
per row, the smallest kept probability of the top-k and of the top-p, so one program per
row bisects for each over the bit patterns of its probabilities (non-negative floats
order as their int32 bits), a pass over the row (held in L2) per halving, at most 31:

- top-k: the largest value t_k with count(p >= t_k) >= k: exactly the k-th largest;
- top-p: the smallest value t_p >= t_k with mass(p > t_p) < top_p x mass(top-k set),
  i.e. the last token whose mass before it (in sorted order) is still under top_p.

Tokens above a threshold are kept; tokens equal to it are ranked by id (the reference's
stable sort) in the last pass. Masses are summed in another order than the reference's
cumsum, so a token whose mass before it is within fp32 rounding of top_p may fall the
other way; elsewhere the kept set is the reference's. No host reads: the call can be
captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "top_k_top_p_triton"]

BLOCK = 4096  # probabilities per chunk of a row pass: 12 chunks at V = 49152

if HAS_TRITON:

    @triton.jit
    def _count_at_least(P, V, b, BLOCK: tl.constexpr):
        """How many of the row's probabilities have bits >= b."""
        n = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(P + offs, mask=offs < V, other=-1.0)
            n += tl.sum((x.to(tl.int32, bitcast=True) >= b).to(tl.int32), 0)
        return n

    @triton.jit
    def _mass_above(P, V, b, BLOCK: tl.constexpr):
        """The sum of the row's probabilities with bits > b."""
        s = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(P + offs, mask=offs < V, other=0.0)
            s += tl.sum(tl.where(x.to(tl.int32, bitcast=True) > b, x, 0.0), 0)
        return s

    @triton.jit
    def _top_k_top_p_kernel(Probs, stride_p, Out, stride_o, TopP, TopK, V,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0)
        P = Probs + row * stride_p
        O = Out + row * stride_o
        k = tl.load(TopK + row).to(tl.int32)
        top_p = tl.load(TopP + row).to(tl.float32)

        top = -1.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(P + offs, mask=offs < V, other=0.0)
            top = tl.maximum(top, tl.max(x, 0))
        top_bits = top.to(tl.int32, bitcast=True)

        # top-k: bisect for the largest b with count(bits >= b) >= k (true at 0).
        k_on = (k > 0) & (k < V)
        lo = 0
        hi = top_bits + 1
        if k_on:
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                if _count_at_least(P, V, mid, BLOCK) >= k:
                    lo = mid
                else:
                    hi = mid
        tk_bits = lo  # 0 when top-k is off: every probability is >= 0.0
        tk = tk_bits.to(tl.float32, bitcast=True)
        # The top-k set: everything above t_k, and the lowest ids of those equal to it.
        above_k = _mass_above(P, V, tk_bits, BLOCK)
        ties_k = k - _count_at_least(P, V, tk_bits + 1, BLOCK)  # how many tied ids stay
        kept_mass = above_k + ties_k.to(tl.float32) * tk  # all of it when off (t_k = 0)

        # top-p: bisect for the smallest b >= bits(t_k) with mass(bits > b) < top_p x
        # the top-k mass (true at the row's max, where that mass is 0).
        p_on = top_p < 1.0
        limit = tl.maximum(top_p * kept_mass, 1e-30)
        lo = tk_bits - 1
        hi = top_bits
        if p_on:
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                if _mass_above(P, V, mid, BLOCK) < limit:
                    hi = mid
                else:
                    lo = mid
        tp_bits = hi
        tp = tp_bits.to(tl.float32, bitcast=True)
        before_tp = _mass_above(P, V, tp_bits, BLOCK)

        # Keep, renormalise. Ties at a threshold go in id order (a running count). A filter
        # that is off cuts at bits -1, below every probability.
        k_cut = tl.where(k_on, tk_bits, -1)
        p_cut = tl.where(p_on, tp_bits, -1)
        kept_sum = 0.0
        seen_k = 0
        seen_p = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            x = tl.load(P + offs, mask=valid, other=0.0)
            bits = x.to(tl.int32, bitcast=True)
            tie_k = valid & (bits == k_cut)
            rank_k = seen_k + tl.cumsum(tie_k.to(tl.int32), 0) - 1
            seen_k += tl.sum(tie_k.to(tl.int32), 0)
            in_k = (bits > k_cut) | (tie_k & (rank_k < ties_k))
            tie_p = valid & (bits == p_cut)
            rank_p = seen_p + tl.cumsum(tie_p.to(tl.int32), 0) - 1
            seen_p += tl.sum(tie_p.to(tl.int32), 0)
            in_p = (bits > p_cut) | (tie_p & (before_tp + rank_p.to(tl.float32) * tp < limit))
            keep = valid & in_k & in_p
            y = tl.where(keep, x, 0.0)
            kept_sum += tl.sum(y, 0)
            tl.store(O + offs, y, mask=valid)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            y = tl.load(O + offs, mask=valid, other=0.0)
            tl.store(O + offs, y / kept_sum, mask=valid)


def top_k_top_p_triton(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """probs [T, V] float32 (non-negative, need not sum to 1), top_p [T] float, top_k [T]
    int -> the renormalised top-k, then top-p, distribution [T, V] float32."""
    T, V = probs.shape
    probs = probs.float().contiguous()
    out = torch.empty_like(probs)  # [T, V] float32
    if T:
        _top_k_top_p_kernel[(T,)](probs, probs.stride(0), out, out.stride(0),
                                  top_p.float().contiguous(), top_k.to(torch.int64).contiguous(),
                                  V, BLOCK=min(BLOCK, triton.next_power_of_2(V)), num_warps=8)
    return out
