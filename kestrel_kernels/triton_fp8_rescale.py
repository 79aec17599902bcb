"""Triton kernel for `kestrel_kernels.fp8_linear.rescale_product`: an FP8 linear's product
computed on the codes alone ([M, N] fp32, from cuBLASLt's tensor-scaled GEMM with unit
scales) times each row's and each channel's scale, plus the bias, cast to the output dtype.

cuBLASLt's tensor-scaled FP8 GEMM splits K where N is small, which the row-scaled GEMM
does not, so at the decode batches' row counts it runs a 7B q/k/v, o or down projection in
about half the time (docs/benchmarks.md, "FP8 at 16 to 256 rows"); the scales then come
here. One program per (row, block of N); the products are formed in the reference's order,
(acc * x_scale) * w_scale + bias, with no fused multiply-add, so a given product gives the
reference's bits. No host reads: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "rescale_product_triton"]

_BLOCK = 1024

if HAS_TRITON:

    @triton.jit
    def _rescale_kernel(Acc, XS, WS, Bias, Out, N, stride_am, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        acc = tl.load(Acc + row * stride_am + offs, mask=ok, other=0.0)
        y = acc * tl.load(XS + row)
        y = y * tl.load(WS + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            y = y + tl.load(Bias + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_om + offs, y.to(Out.dtype.element_ty), mask=ok)


def rescale_product_triton(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                           bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] fp32 (unit stride along N), x_scale [M, 1] fp32, w_scale [N, 1] fp32,
    bias [N] or None -> [M, N] out_dtype, as `rescale_product` computes it."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.fp8_linear.rescale_product")
    M, N = acc.shape
    if acc.dtype != torch.float32 or acc.stride(1) != 1 or x_scale.shape != (M, 1) \
            or w_scale.shape != (N, 1) or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"rescale_product_triton: acc [M, N] fp32, x_scale [M, 1], w_scale [N, 1], "
                         f"bias [N]; got {acc.dtype} {tuple(acc.shape)}, {tuple(x_scale.shape)}, "
                         f"{tuple(w_scale.shape)}, {None if bias is None else tuple(bias.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=acc.device)  # [M, N]
    if out.numel():
        xs = x_scale.reshape(M).contiguous()  # [M] fp32
        ws = w_scale.reshape(N).contiguous()  # [N] fp32
        b = bias.contiguous() if bias is not None else ws  # not read without a bias
        _rescale_kernel[(M, triton.cdiv(N, _BLOCK))](
            acc, xs, ws, b, out, N, acc.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)
    return out
