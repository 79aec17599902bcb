"""Triton kernels for `kestrel_kernels.rmsnorm.rmsnorm` and `kestrel_kernels.rmsnorm.fused_add_rmsnorm`.

One program per row: the whole row sits in one power-of-2 block (masked past H), so the
residual add, the fp32 mean of squares and the scaling are one read and one write. Values
are rounded to the storage dtype where the reference rounds them (the sum, the normalised
value), so only the order of the fp32 reduction differs from it. Outputs are new tensors
(the model keeps earlier residuals as captured aux states); no host reads, so the calls can
be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "rmsnorm_triton", "fused_add_rmsnorm_triton"]


if HAS_TRITON:

    @triton.jit
    def _rmsnorm_kernel(
        X, Residual, W, Out, ResidualOut, stride_x, stride_r, H, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < H
        x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s = x + tl.load(Residual + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
            s = s.to(ResidualOut.dtype.element_ty)
            tl.store(ResidualOut + row * H + offs, s, mask=ok)
            x = s.to(tl.float32)
            norm_ty = ResidualOut.dtype.element_ty
        else:
            norm_ty = X.dtype.element_ty
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        xn = (x * rstd).to(norm_ty).to(tl.float32)  # the reference rounds before the weight
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + row * H + offs, (w * xn).to(Out.dtype.element_ty), mask=ok)


def _launch(x, residual, weight, eps):
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.rmsnorm")
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    r2 = residual.reshape(-1, H) if residual is not None else x2
    if x2.stride(-1) != 1 or r2.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("rmsnorm needs rows with a contiguous last dim and a contiguous weight")
    norm_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(norm_dtype, weight.dtype),
                      device=x.device)  # [..., H] normed, in the reference's dtype
    res_out = (torch.empty(x.shape, dtype=norm_dtype, device=x.device)  # [..., H] x + residual
               if residual is not None else None)
    if x2.shape[0] == 0:
        return out, res_out
    BLOCK = triton.next_power_of_2(H)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, res_out if residual is not None else out, x2.stride(0), r2.stride(0),
        H, eps, HAS_RESIDUAL=residual is not None, BLOCK=BLOCK,
        num_warps=min(max(BLOCK // 256, 1), 8),
    )
    return out, res_out


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton `rmsnorm`: x [..., H], weight [H] -> [..., H]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `fused_add_rmsnorm`: x, residual [..., H] -> (normed, x + residual)."""
    return _launch(x, residual, weight, eps)
