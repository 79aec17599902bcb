"""A decoder layer's elementwise ops on the CPU (cpu_layer_ops.cpp), one call each where the
torch references (kestrel_kernels/rmsnorm.py, rope.py, activation.py) run several ops.
float32 only; rows are computed independently (batch-invariant). RoPE is bit for bit the
reference's; RMSNorm and SiLU round differently (their own sum order and exp)."""
from __future__ import annotations

import torch

from kestrel_kernels.cpu_build import kernels

__all__ = ["add_rmsnorm", "rope", "silu_and_mul"]


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] float32 (residual may be None) -> (rmsnorm(x + residual) * weight,
    x + residual), as rmsnorm.fused_add_rmsnorm (rmsnorm.rmsnorm without a residual)."""
    return tuple(kernels().add_rmsnorm(x, residual, weight, eps))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] float32, cos and sin [T, D] -> x rotated [T, heads, D], as
    rope.apply_rotary."""
    return kernels().rope(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I], as activation.silu_and_mul."""
    return kernels().silu_and_mul(gate_up)
