"""RMSNorm, alone and with the residual add folded in: the torch references.

The Triton kernels in kestrel_kernels/triton_rmsnorm.py compute the same thing; these are the CPU
path and the test oracle. The `*_quant` forms give the normed value as an FP8 linear's
input (`quantize_rows` of it), which the kernels write in place of the value.
"""
from __future__ import annotations

import torch

from kestrel_kernels.fp8_linear import Fp8Rows, fp8_rows

__all__ = ["rmsnorm", "fused_add_rmsnorm", "rmsnorm_quant", "fused_add_rmsnorm_quant"]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> weight * (x / rms(x)), the normalised value in x's dtype."""
    # Mean of squares in fp32: in bf16 it loses enough to change greedy tokens.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] -> (rmsnorm(x + residual), x + residual)."""
    r = x + residual
    return rmsnorm(r, weight, eps), r


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """rmsnorm(x) as FP8 rows."""
    return fp8_rows(rmsnorm(x, weight, eps))


def fused_add_rmsnorm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[Fp8Rows, torch.Tensor]:
    """x, residual [..., H] -> (rmsnorm(x + residual) as FP8 rows, x + residual)."""
    normed, r = fused_add_rmsnorm(x, residual, weight, eps)
    return fp8_rows(normed), r
