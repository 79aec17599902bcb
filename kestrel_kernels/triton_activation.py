"""Triton kernel for `kestrel_kernels.activation.silu_and_mul` (SwiGLU's gating) and for
`silu_and_mul_quant`, which writes the product as an FP8 linear's input.

Row by row (inputs may be column slices of one fused GEMM output); silu(gate) is rounded to gate's dtype before the
product, as the reference rounds it. Unquantized, a row is cut into blocks of 1024, a
program each. Quantized, one program holds the whole row (up to triton_fp8_quant's
MAX_BLOCK values, every intermediate size of Qwen2.5 up to 72B's 29568): the row's largest
magnitude comes before its codes (triton_fp8_quant's `quantize_block`), and holding the row
costs no second read of gate and up. Longer rows take the two kernels, the product then
`quantize_rows_triton`'s two passes. No host reads: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from kestrel_kernels.fp8_format import FP8, FP8_MAX, MIN_AMAX
from kestrel_kernels.fp8_linear import Fp8Rows
from kestrel_kernels.triton_available import HAS_TRITON, tl, triton
from kestrel_kernels.triton_fp8_quant import MAX_BLOCK, default_warps, quantize_rows_triton

__all__ = ["HAS_TRITON", "silu_and_mul_triton", "silu_and_mul_quant_triton"]

_BLOCK = 1024


if HAS_TRITON:
    from kestrel_kernels.triton_fp8_quant import quantize_block

    @triton.jit
    def _silu_and_mul_kernel(Gate, Up, Out, Q, S, I, stride_g, stride_u, fp8_max, min_amax,
                             QUANT: tl.constexpr, BLOCK: tl.constexpr):
        # One program per (row, block of I): gate and up may be column slices of one
        # [T, 2I] GEMM output (row strides 2I), so rows are addressed by their stride.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < I
        g = tl.load(Gate + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(Up + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(Gate.dtype.element_ty).to(tl.float32)
        y = (silu * u).to(Out.dtype.element_ty)
        if QUANT:  # the block is the whole row; Out (empty) gives the dtype y is rounded to
            quantize_block(Q + row * I, S + row, y.to(tl.float32), offs, ok, fp8_max, min_amax)
        else:
            tl.store(Out + row * I + offs, y, mask=ok)


def _rows(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """gate, up [..., I] -> their rows [rows, I] (views where the rows are strided), I."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.activation")
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    I = gate.shape[-1] if gate.dim() else 1
    g2, u2 = (t.reshape(-1, I) if t.dim() and t.stride(-1) == 1 else t.contiguous().reshape(-1, I)
              for t in (gate, up))
    return g2, u2, I


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton `silu_and_mul`: gate, up [..., I] -> [..., I] contiguous. Each may be a
    column slice of a wider tensor (a fused gate/up GEMM's output): no copy is made."""
    g2, u2, I = _rows(gate, up)
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype),
                      device=gate.device)  # [..., I]
    if out.numel():
        grid = (g2.shape[0], triton.cdiv(I, _BLOCK))
        _silu_and_mul_kernel[grid](g2, u2, out, out, out, I, g2.stride(0), u2.stride(0), FP8_MAX,
                                   MIN_AMAX, QUANT=False, BLOCK=_BLOCK, num_warps=4)
    return out


def silu_and_mul_quant_triton(gate: torch.Tensor, up: torch.Tensor) -> Fp8Rows:
    """Triton `silu_and_mul_quant`: gate, up [..., I] (column slices as silu_and_mul_triton
    takes them) -> silu(gate) * up as FP8 rows."""
    g2, u2, I = _rows(gate, up)
    dtype = torch.promote_types(gate.dtype, up.dtype)
    block = triton.next_power_of_2(I)
    if block > MAX_BLOCK:
        q, scale = quantize_rows_triton(silu_and_mul_triton(gate, up).view(-1, I))  # [rows, I], [rows, 1]
        return Fp8Rows(q.view(gate.shape), scale.view(*gate.shape[:-1], 1), dtype)
    q = torch.empty(gate.shape, dtype=FP8, device=gate.device)  # [..., I] E4M3 codes
    scale = torch.empty((*gate.shape[:-1], 1), dtype=torch.float32, device=gate.device)  # [..., 1]
    if q.numel():
        rounding = torch.empty(0, dtype=dtype, device=gate.device)  # [0]: its dtype alone
        # quantize_rows_triton's warps for the same rows held alike (sm_90, 32768 values at
        # 32 warps: 59 registers a thread, no spills).
        _silu_and_mul_kernel[(g2.shape[0], 1)](g2, u2, rounding, q, scale, I, g2.stride(0), u2.stride(0),
                                               FP8_MAX, MIN_AMAX, QUANT=True, BLOCK=block,
                                               num_warps=default_warps(g2.shape[0], block))
    return Fp8Rows(q, scale, dtype)
