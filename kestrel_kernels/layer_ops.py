"""Decoder-layer elementwise ops, each dispatched to its Triton kernel or its torch reference.

The Triton kernel runs when the inputs are on CUDA, triton imports and no gradient is
needed (the kernels have no backward: EAGLE training keeps the references); otherwise, or
inside `force_torch()`, the pure-torch reference runs. Both agree to rounding (the fp32
reductions and cos/sin/exp may differ by an ulp), so callers need not care which one ran.

The `*_quant` ops hand their result to an FP8 linear as `Fp8Rows`: the kernel writes the
codes and row scales `quantize_rows` would make of the op's own output, so an FP8 linear
gives the same bits after the op and after its `*_quant` form, without a launch of its own.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch

from kestrel_kernels import activation, kv_store
from kestrel_kernels import rmsnorm as rmsnorm_ref
from kestrel_kernels import rope as rope_ref
from kestrel_kernels.fp8_linear import Fp8Rows
from kestrel_kernels.triton_activation import silu_and_mul_quant_triton, silu_and_mul_triton
from kestrel_kernels.triton_rmsnorm import (HAS_TRITON, fused_add_rmsnorm_quant_triton, fused_add_rmsnorm_triton,
                                            rmsnorm_quant_triton, rmsnorm_triton)
from kestrel_kernels.triton_kv_store import store_kv_fits, store_kv_triton
from kestrel_kernels.triton_rope import rope_triton

__all__ = ["set_fused", "force_torch", "use_triton", "rmsnorm", "fused_add_rmsnorm", "rmsnorm_quant",
           "fused_add_rmsnorm_quant", "rope", "Rotary", "rotary", "rope_at", "silu_and_mul",
           "silu_and_mul_quant", "store_kv"]

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


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """`kestrel_kernels.rmsnorm.rmsnorm_quant`."""
    fn = rmsnorm_quant_triton if use_triton(x, weight) else rmsnorm_ref.rmsnorm_quant
    return fn(x, weight, eps)


def fused_add_rmsnorm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[Fp8Rows, torch.Tensor]:
    """`kestrel_kernels.rmsnorm.fused_add_rmsnorm_quant`."""
    fn = (fused_add_rmsnorm_quant_triton if use_triton(x, residual, weight)
          else rmsnorm_ref.fused_add_rmsnorm_quant)
    return fn(x, residual, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
         inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kestrel_kernels.rope.rope`."""
    fn = rope_triton if use_triton(q, k) else rope_ref.rope
    return fn(q, k, positions, inv_freq)


class Rotary(NamedTuple):
    """One forward's rotary angles, shared by its layers: positions [T] int64 and inv_freq
    [D/2] fp32 for the Triton kernel, which computes them itself; for the torch reference
    cos and sin [T, D] fp32, computed once instead of once per layer (each layer casts them
    to its q's dtype as before: a no-op in a float32 model)."""
    positions: torch.Tensor
    inv_freq: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor) -> Rotary:
    """The angles `rope_at` takes for a forward over `positions`."""
    if use_triton(positions):
        return Rotary(positions, inv_freq)
    return Rotary(positions, inv_freq, *rope_ref.cos_sin(positions, inv_freq))  # [T, D] fp32 each


def rope_at(q: torch.Tensor, k: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` with the forward's angles: the same values, the tables made once per forward."""
    if rot.cos is None or use_triton(q, k):
        return rope(q, k, rot.positions, rot.inv_freq)
    return rope_ref.apply_rotary(q, rot.cos, rot.sin), rope_ref.apply_rotary(k, rot.cos, rot.sin)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`kestrel_kernels.activation.silu_and_mul`."""
    fn = silu_and_mul_triton if use_triton(gate, up) else activation.silu_and_mul
    return fn(gate, up)


def silu_and_mul_quant(gate: torch.Tensor, up: torch.Tensor) -> Fp8Rows:
    """`kestrel_kernels.activation.silu_and_mul_quant`."""
    fn = silu_and_mul_quant_triton if use_triton(gate, up) else activation.silu_and_mul_quant
    return fn(gate, up)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """`kestrel_kernels.kv_store.store_kv`; the kernel takes K/V whose tokens are contiguous
    runs (a strided view of a fused GEMM's output is), anything else the reference."""
    fast = use_triton(k, v) and store_kv_fits(k_cache, v_cache, k, v)
    (store_kv_triton if fast else kv_store.store_kv)(k_cache, v_cache, loc, k, v)
