"""Triton kernels for `kestrel_kernels.rmsnorm.rmsnorm` and `kestrel_kernels.rmsnorm.fused_add_rmsnorm`,
and for their `*_quant` forms, which write the normed value as an FP8 linear's input.

One program per row: the whole row sits in one power-of-2 block (masked past H), so the
residual add, the fp32 mean of squares and the scaling are one read and one write. Values
are rounded to the storage dtype where the reference rounds them (the sum, the normalised
value), so only the order of the fp32 reduction differs from it. Quantized, the rounded
value is not written: the row's FP8 codes and scale are (triton_fp8_quant's
`quantize_block`), the bits `quantize_rows_triton` would make of the unquantized kernel's
output. For that the quantized kernel sums the squares in the same order: the same warps,
and the same values a thread (see X_VEC). Outputs are new tensors (the model keeps earlier
residuals as captured aux states); no host reads, so the calls can be captured in a CUDA
graph.
"""
from __future__ import annotations

import torch

from kestrel_kernels.fp8_format import FP8, FP8_MAX, MIN_AMAX
from kestrel_kernels.fp8_linear import Fp8Rows
from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "rmsnorm_triton", "fused_add_rmsnorm_triton", "rmsnorm_quant_triton",
           "fused_add_rmsnorm_quant_triton"]


if HAS_TRITON:
    from kestrel_kernels.triton_fp8_quant import quantize_block

    @triton.jit
    def _rmsnorm_kernel(
        X, Residual, W, Out, ResidualOut, Q, S, stride_x, stride_r, H, eps, fp8_max, min_amax,
        HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, X_VEC: tl.constexpr,
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
        y = (w * xn).to(Out.dtype.element_ty)
        if QUANT:  # Out (empty) gives the dtype the value is rounded to before its codes
            # The codes stored X_VEC values a thread at a time (one 16-byte load of x, as the
            # unquantized kernel's layout holds them): the compiler lays the whole row out
            # as this store wants, and with its own 16 bytes, 16 codes a thread, would sum
            # the squares in another order (Triton 3.6's sm_90 TTGIR, checked).
            quantize_block(Q + row * H, S + row, y.to(tl.float32), tl.max_contiguous(offs, X_VEC), ok,
                           fp8_max, min_amax)
        else:
            tl.store(Out + row * H + offs, y, mask=ok)


def _launch(x, residual, weight, eps, quant: bool):
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.rmsnorm")
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    r2 = residual.reshape(-1, H) if residual is not None else x2
    if x2.stride(-1) != 1 or r2.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("rmsnorm needs rows with a contiguous last dim and a contiguous weight")
    norm_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out = torch.empty(0 if quant else x.shape, dtype=torch.promote_types(norm_dtype, weight.dtype),
                      device=x.device)  # [..., H] normed, in the reference's dtype ([0] quantized)
    res_out = (torch.empty(x.shape, dtype=norm_dtype, device=x.device)  # [..., H] x + residual
               if residual is not None else None)
    if quant:
        q = torch.empty(x.shape, dtype=FP8, device=x.device)  # [..., H] E4M3 codes
        scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)  # [..., 1]
        normed = Fp8Rows(q, scale, out.dtype)
    else:
        q = scale = normed = out
    if x2.shape[0] == 0:
        return normed, res_out
    BLOCK = triton.next_power_of_2(H)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, res_out if residual is not None else out, q, scale, x2.stride(0),
        r2.stride(0), H, eps, FP8_MAX, MIN_AMAX, HAS_RESIDUAL=residual is not None, QUANT=quant,
        BLOCK=BLOCK, X_VEC=16 // x.element_size(),
        # Not triton_fp8_quant.default_warps, quantized too: the warps lay out the sum of
        # squares, and another count would sum it in another order.
        num_warps=min(max(BLOCK // 256, 1), 8),
    )
    return normed, res_out


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton `rmsnorm`: x [..., H], weight [H] -> [..., H]."""
    return _launch(x, None, weight, eps, quant=False)[0]


def fused_add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `fused_add_rmsnorm`: x, residual [..., H] -> (normed, x + residual)."""
    return _launch(x, residual, weight, eps, quant=False)


def rmsnorm_quant_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """Triton `rmsnorm_quant`: x [..., H], weight [H] -> the normed rows as FP8."""
    return _launch(x, None, weight, eps, quant=True)[0]


def fused_add_rmsnorm_quant_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                   eps: float) -> tuple[Fp8Rows, torch.Tensor]:
    """Triton `fused_add_rmsnorm_quant`: x, residual [..., H] -> (the normed rows as FP8,
    x + residual)."""
    return _launch(x, residual, weight, eps, quant=True)
