"""Decoder-layer elementwise ops, each dispatched to its Triton kernel or its torch reference.

The Triton kernel runs when the inputs are on CUDA, triton imports and no gradient is
needed (the kernels have no backward: EAGLE training keeps the references); otherwise, or
inside `force_torch()`, the pure-torch reference runs. Both agree to rounding (the fp32
reductions and cos/sin/exp may differ by an ulp), so callers need not care which one ran.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from kestrel_kernels import activation
from kestrel_kernels import rmsnorm as rmsnorm_ref
from kestrel_kernels import rope as rope_ref
from kestrel_kernels.triton_activation import silu_and_mul_triton
from kestrel_kernels.triton_rmsnorm import HAS_TRITON, fused_add_rmsnorm_triton, rmsnorm_triton
from kestrel_kernels.triton_rope import rope_triton

__all__ = ["set_fused", "force_torch", "use_triton", "rmsnorm", "fused_add_rmsnorm", "rope", "silu_and_mul"]

_forced_torch = False


def set_fused(enabled: bool) -> None:
    """Process-wide switch (model.fused_layer_ops): False runs the references on CUDA too."""
    global _forced_torch
    _forced_torch = not enabled


@contextmanager
def force_torch():
    """Run the torch references inside, on CUDA too (to compare a whole model's two paths)."""
    global _forced_torch
    before, _forced_torch = _forced_torch, True
    try:
        yield
    finally:
        _forced_torch = before


def use_triton(*ts: torch.Tensor) -> bool:
    """Whether an op on tensors `ts` runs its Triton kernel."""
    if not HAS_TRITON or _forced_torch or not ts[0].is_cuda:
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`kestrel_kernels.rmsnorm.rmsnorm`."""
    fn = rmsnorm_triton if use_triton(x, weight) else rmsnorm_ref.rmsnorm
    return fn(x, weight, eps)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`kestrel_kernels.rmsnorm.fused_add_rmsnorm`."""
    fn = (fused_add_rmsnorm_triton if use_triton(x, residual, weight)
          else rmsnorm_ref.fused_add_rmsnorm)
    return fn(x, residual, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
         inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kestrel_kernels.rope.rope`."""
    fn = rope_triton if use_triton(q, k) else rope_ref.rope
    return fn(q, k, positions, inv_freq)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`kestrel_kernels.activation.silu_and_mul`."""
    fn = silu_and_mul_triton if use_triton(gate, up) else activation.silu_and_mul
    return fn(gate, up)
