"""Triton kernel for `kernels.activation.silu_and_mul` (SwiGLU's gating).

Elementwise over the flattened inputs; silu(gate) is rounded to gate's dtype before the
product, as the reference rounds it. No host reads: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "silu_and_mul_triton"]

_BLOCK = 1024


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(Gate, Up, Out, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        g = tl.load(Gate + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(Up + offs, mask=ok, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(Gate.dtype.element_ty).to(tl.float32)
        tl.store(Out + offs, (silu * u).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton `silu_and_mul`: gate, up [..., I] -> [..., I]."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kernels.activation.silu_and_mul")
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype),
                      device=gate.device)  # [..., I]
    N = gate.numel()
    if N:
        _silu_and_mul_kernel[(triton.cdiv(N, _BLOCK),)](gate, up, out, N, BLOCK=_BLOCK,
                                                         num_warps=4)
    return out
