"""Triton kernel for grammar bitmasks on logits (kestrel_kernels/token_bitmask.py `mask_logits_`;
its torch path is the reference).

In torch the mask is unpacked before it is applied: at batch 64 of 8-node trees over
SmolLM2's 49152 ids, a [512, 1536, 32] int32 shift and AND (100 MB each), a bool copy, its
negation and a masked fill that reads and writes 100 MB of fp32 logits; on the H200 this
was most of the 0.26 ms of device time the grammar added to a tree step. Here each
program reads the packed words (3 MB for the whole batch) and writes -inf over the
disallowed ids only, in place: an allowed logit is neither read nor written.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "mask_logits_triton_"]

BLOCK_V = 1024  # ids per program


if HAS_TRITON:

    @triton.jit
    def _mask_logits_kernel(X, M, V, W, sx, sm, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        word = offs // 32
        bits = tl.load(M + row * sm + word, mask=ok & (word < W), other=0)  # past W: none allowed
        allowed = ((bits >> (offs % 32)) & 1) != 0
        tl.store(X + row * sx + offs, float("-inf"), mask=ok & ~allowed)


def mask_logits_triton_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits [R, V] float (rows at any stride, ids contiguous) get -inf at the
    ids bitmask [R, W] int32 does not allow (bit j of word w: id 32*w + j; ids past 32*W
    are disallowed) -> logits."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.token_bitmask")
    R, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the bitmask kernel needs contiguous ids")
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    if R == 0:
        return logits
    block = min(BLOCK_V, triton.next_power_of_2(V))
    _mask_logits_kernel[(R, triton.cdiv(V, block))](
        logits, bitmask, V, bitmask.shape[1], logits.stride(0), bitmask.stride(0),
        BLOCK=block, num_warps=4)
    return logits
