"""RMSNorm, alone and with the residual add folded in: the torch references.

The Triton kernels in kestrel_kernels/triton_rmsnorm.py compute the same thing; these are the CPU
path and the test oracle.
"""
from __future__ import annotations

import torch

__all__ = ["rmsnorm", "fused_add_rmsnorm"]


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
