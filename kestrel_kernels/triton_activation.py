"""Triton kernel for `kestrel_kernels.activation.silu_and_mul` (SwiGLU's gating).

Row by row (inputs may be column slices of one fused GEMM output); silu(gate) is rounded to gate's dtype before the
product, as the reference rounds it. No host reads: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "silu_and_mul_triton"]

_BLOCK = 1024


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(Gate, Up, Out, I, stride_g, stride_u, BLOCK: tl.constexpr):
        # One program per (row, block of I): gate and up may be column slices of one
        # [T, 2I] GEMM output (row strides 2I), so rows are addressed by their stride.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < I
        g = tl.load(Gate + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(Up + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(Gate.dtype.element_ty).to(tl.float32)
        tl.store(Out + row * I + offs, (silu * u).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton `silu_and_mul`: gate, up [..., I] -> [..., I] contiguous. Each may be a
    column slice of a wider tensor (a fused gate/up GEMM's output): no copy is made."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.activation.silu_and_mul")
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    I = gate.shape[-1] if gate.dim() else 1
    g2, u2 = (t.reshape(-1, I) if t.dim() and t.stride(-1) == 1 else t.contiguous().reshape(-1, I)
              for t in (gate, up))  # [rows, I], views where the rows are strided
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype),
                      device=gate.device)  # [..., I]
    if out.numel():
        grid = (g2.shape[0], triton.cdiv(I, _BLOCK))
        _silu_and_mul_kernel[grid](g2, u2, out, I, g2.stride(0), u2.stride(0), BLOCK=_BLOCK,
                                   num_warps=4)
    return out
