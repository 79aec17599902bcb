"""Triton kernel for `kestrel_kernels.rope.rope`: q and k of a token rotated in one launch.

One program per token computes the angles position * inv_freq in fp32 (as the reference
does; no cos/sin tables) and rotates all of its q and k heads. Products and sums are
rounded to the storage dtype where the reference rounds them, so in bf16 only cos/sin
themselves may differ from torch's by an ulp. Outputs are new contiguous tensors; no host
reads, so the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "rope_triton"]


if HAS_TRITON:

    @triton.jit
    def _rotate_heads(X, Out, t, stride_t, stride_h, cos, sin,
                      NH: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        h = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK_HALF)[None, :]
        ok = (h < NH) & (i < HALF)
        src = X + t * stride_t + h * stride_h + i
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF] first halves
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)  # second halves
        ty = Out.dtype.element_ty
        c = cos.to(ty).to(tl.float32)[None, :]
        s = sin.to(ty).to(tl.float32)[None, :]
        # rotate_half(x) = [-x2, x1]: out = [x1*c - x2*s, x2*c + x1*s], each product rounded
        o1 = (x1 * c).to(ty).to(tl.float32) - (x2 * s).to(ty).to(tl.float32)
        o2 = (x2 * c).to(ty).to(tl.float32) + (x1 * s).to(ty).to(tl.float32)
        dst = Out + t * (NH * 2 * HALF) + h * (2 * HALF) + i
        tl.store(dst, o1.to(ty), mask=ok)
        tl.store(dst + HALF, o2.to(ty), mask=ok)

    @triton.jit
    def _rope_kernel(
        Q, K, QOut, KOut, Positions, InvFreq, stride_qt, stride_qh, stride_kt, stride_kh,
        HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_HALF)
        inv_freq = tl.load(InvFreq + i, mask=i < HALF, other=0.0)  # [BLOCK_HALF] fp32
        angle = tl.load(Positions + t).to(tl.float32) * inv_freq
        cos, sin = tl.cos(angle), tl.sin(angle)
        _rotate_heads(Q, QOut, t, stride_qt, stride_qh, cos, sin, HQ, HALF, BLOCK_HQ, BLOCK_HALF)
        _rotate_heads(K, KOut, t, stride_kt, stride_kh, cos, sin, HKV, HALF, BLOCK_HKV, BLOCK_HALF)


def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rope`: q [T, Hq, D], k [T, Hkv, D], positions [T] int64, inv_freq [D/2] fp32
    -> (q, k) rotated, new contiguous tensors."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.rope.rope")
    T, HQ, D = q.shape
    HKV = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope needs q and k with a contiguous last dim")
    if inv_freq.dtype != torch.float32 or inv_freq.numel() * 2 != D:
        raise ValueError("rope needs inv_freq [D/2] fp32")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, Hkv, D]
    if T == 0:
        return q_out, k_out
    _rope_kernel[(T,)](
        q, k, q_out, k_out, positions.contiguous(), inv_freq.contiguous(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HQ=HQ, HKV=HKV, HALF=D // 2, BLOCK_HQ=triton.next_power_of_2(HQ),
        BLOCK_HKV=triton.next_power_of_2(HKV), BLOCK_HALF=triton.next_power_of_2(D // 2),
        num_warps=4,
    )
    return q_out, k_out
