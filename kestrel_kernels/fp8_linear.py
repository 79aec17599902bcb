"""FP8 (E4M3) linear layer: weights with a scale per output channel, activations quantized
per token at run time, the product accumulated in fp32 and scaled back.

y[t, n] = (sum_k xq[t, k] * wq[n, k]) * x_scale[t] * w_scale[n] + bias[n]

On CUDA (compute capability 8.9 or more) the product is one `torch._scaled_mm` with
row-wise scales; or, where N is narrow and the rows few (TENSORWISE_MAX_N,
TENSORWISE_MAX_PRODUCT: a decode batch's q/k/v, o and down projections), cuBLASLt's
tensor-scaled GEMM on the codes alone into fp32, which splits K where the row-scaled GEMM
leaves most SMs idle, and then `rescale_product` (one Triton kernel) applies the scales and
the bias; or, at few rows, the Triton kernel of `triton_gemv.py` (rows up to
`set_gemv_max_rows`, model.fp8_gemv_max_rows; off by default). Elsewhere, and as the test
oracle, `fp8_linear_ref` dequantizes both operands to fp32 and multiplies. Both quantize the
activations alike: the reference with torch ops (`quantize_rows`), CUDA with one Triton
kernel whose codes and scales are bit-equal to them (`triton_fp8_quant.py`), so the two differ
only by the fp32 summation order and the final rounding. No host reads: the calls can be captured in a CUDA
graph. Each row's scale depends on that row alone, so speculative verify of N tokens and
plain decode of one quantize a token alike; the sums are alike only where both take the
same GEMM (the Triton kernel at any row count up to its limit, or cuBLASLt), which is why
the kernel is refused with a draft (actors/worker/rank_worker.py).

The input is float rows, or `Fp8Rows`: rows the kernel that computed them has quantized
already (layer_ops' RMSNorm and SiLU-and-mul `*_quant` ops, for the decoder's linears that
read them), with the codes and scales quantizing them here would give, so the product is
the same bits and the separate quantization launch is saved.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kestrel_kernels.fp8_format import FP8, FP8_MAX, MIN_AMAX
from kestrel_kernels.triton_available import use_triton
from kestrel_kernels.triton_gemv import MAX_ROWS as GEMV_MAX_ROWS
from kestrel_kernels.triton_gemv import fp8_gemv
from kestrel_kernels.triton_fp8_quant import quantize_rows_triton
from kestrel_kernels.triton_fp8_rescale import rescale_product_triton

__all__ = ["FP8", "FP8_MAX", "Fp8Rows", "fp8_rows", "quantize_rows", "fp8_linear", "fp8_linear_ref",
           "fp8_linear_scaled_mm", "rescale_product", "set_gemv_max_rows", "set_tensorwise",
           "TENSORWISE_MAX_N", "TENSORWISE_MAX_PRODUCT"]

_gemv_max_rows = 0  # rows at or below it take the Triton GEMV on CUDA; 0: never
# Where the tensor-scaled GEMM and the rescale beat the row-scaled GEMM (measured at
# Qwen2.5-7B's and 72B's shapes, docs/benchmarks.md "FP8 at 16 to 256 rows"): outputs up to
# this wide, whose row-scaled GEMM fills few SMs, and products of up to this many values
# (rows x N), past which the fp32 product's extra write and read cost more than the split
# of K gains (7B's q/k/v at 128 rows gains, 72B's at 128 and 7B's at 256 lose).
TENSORWISE_MAX_N = 16384
TENSORWISE_MAX_PRODUCT = 768 * 1024
_UNIT: dict[torch.device, torch.Tensor] = {}  # device -> a [] fp32 one: the tensor-scaled GEMM's scales
_tensorwise = True  # off: every row through the row-scaled GEMM (set_tensorwise)


def set_gemv_max_rows(rows: int) -> None:
    """model.fp8_gemv_max_rows (set by each rank worker at start-up): the CUDA path multiplies
    1..rows rows by the Triton GEMV instead of torch._scaled_mm; 0 turns it off."""
    global _gemv_max_rows
    if not 0 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv_max_rows must be within 0..{GEMV_MAX_ROWS}, got {rows}")
    _gemv_max_rows = rows


def set_tensorwise(on: bool) -> None:
    """Whether narrow products take the tensor-scaled GEMM and the rescale (the default), or
    every row the row-scaled GEMM: set off by each rank worker that runs a draft, where a
    verify's many rows and the plain step's few would otherwise take different GEMMs
    (whose sums differ in the last bit, which moves the next layer's FP8 codes), as
    model.fp8_gemv_max_rows is refused there."""
    global _tensorwise
    _tensorwise = bool(on)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (any float dtype) -> (q [..., K] float8_e4m3fn, scale [..., 1] fp32) with
    x ~= q * scale, each row scaled so its largest magnitude maps to FP8_MAX."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX)  # [..., 1] fp32
    # Divided by a tensor: CUDA torch divides by a Python scalar as a multiply by its
    # reciprocal, which can differ in the last bit from the rounded division the Triton
    # kernel (and the CPU) does.
    scale = amax / torch.full_like(amax, FP8_MAX)  # [..., 1] fp32
    # Clamped: amax / FP8_MAX is rounded, and E4M3 has no infinity to saturate to.
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [..., K] fp8
    return q, scale


class Fp8Rows(NamedTuple):
    """Float rows x [..., K] as `quantize_rows` quantizes them, with x's dtype (the linear's
    output dtype): what `fp8_linear` takes in place of x. `shape`, `dtype` and `is_cuda`
    read as x's would."""
    q: torch.Tensor  # [..., K] float8_e4m3fn
    scale: torch.Tensor  # [..., 1] fp32
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda


def fp8_rows(x: torch.Tensor) -> Fp8Rows:
    """x [..., K] quantized by `quantize_rows` (the fused kernels' references)."""
    return Fp8Rows(*quantize_rows(x), x.dtype)


def _flat_rows(x: torch.Tensor | Fp8Rows, quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes [M, K] fp8, scales [M, 1] fp32): `quantize`'s of float rows, an
    Fp8Rows' own."""
    if isinstance(x, Fp8Rows):
        return x.q.reshape(-1, x.q.shape[-1]), x.scale.reshape(-1, 1)
    return quantize(x.reshape(-1, x.shape[-1]))


def _quantize_on_device(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` by its Triton kernel where it runs (rows with a contiguous last dim)."""
    if not use_triton(rows):
        return quantize_rows(rows)
    return quantize_rows_triton(rows if rows.stride(-1) == 1 else rows.contiguous())


def _check(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    N, K = weight.shape
    if weight.dtype != FP8 or x.shape[-1] != K or weight_scale.shape != (N, 1) \
            or weight_scale.dtype != torch.float32:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} needs a float8_e4m3fn weight [N, {x.shape[-1]}] "
                         f"and an fp32 weight_scale [N, 1]; got {weight.dtype} {tuple(weight.shape)}, "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")


def fp8_linear_ref(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] in the model dtype (or those rows quantized), weight [N, K] fp8,
    weight_scale [N, 1] fp32, bias [N] -> [..., N] in x's dtype: the pure-torch reference
    (the CPU path)."""
    _check(x, weight, weight_scale)
    xq, xs = _flat_rows(x, quantize_rows)  # [M, K] fp8, [M, 1] fp32
    # E4M3 values are exact in fp32 and so are their products: only the sums round.
    acc = xq.float() @ weight.float().t()  # [M, N] fp32
    return rescale_product(acc, xs, weight_scale, bias, x.dtype).view(*x.shape[:-1], weight.shape[0])


def rescale_product(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The codes' product acc [M, N] fp32 times x_scale [M, 1] and w_scale [N, 1] (fp32),
    plus bias [N], in out_dtype: the reference for `rescale_product_triton`."""
    out = acc * x_scale * w_scale.view(1, -1)  # [M, N] fp32
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _unit(device: torch.device) -> torch.Tensor:
    """A [] fp32 one on `device`, made by the first call: one made inside a CUDA graph
    capture would hold no value until the graph's first replay, so that call is refused."""
    if device not in _UNIT:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8_linear: run one call eagerly before capturing a CUDA graph")
        _UNIT[device] = torch.ones((), dtype=torch.float32, device=device)  # [] fp32
    return _UNIT[device]


def fp8_linear_scaled_mm(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear_ref` on CUDA (bf16 x; K and N multiples of 16): the Triton GEMV at
    1..set_gemv_max_rows rows, the tensor-scaled GEMM and `rescale_product_triton` where N
    and the product are within TENSORWISE_MAX_N and TENSORWISE_MAX_PRODUCT, else one
    `torch._scaled_mm` with row-wise scales."""
    _check(x, weight, weight_scale)
    xq, xs = _flat_rows(x, _quantize_on_device)  # [M, K] fp8, [M, 1] fp32
    if 0 < xq.shape[0] <= _gemv_max_rows and use_triton(xq):
        out = fp8_gemv(xq, xs, weight, weight_scale, bias, x.dtype)  # [M, N]
        return out.view(*x.shape[:-1], weight.shape[0])
    M, N = xq.shape[0], weight.shape[0]
    # weight [N, K] row-major is the column-major [K, N] the second operand must be.
    if _tensorwise and N <= TENSORWISE_MAX_N and M * N <= TENSORWISE_MAX_PRODUCT:
        one = _unit(xq.device)
        acc = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one,
                               out_dtype=torch.float32)  # [M, N] fp32: the codes' product
        rescale = rescale_product_triton if use_triton(acc) else rescale_product
        out = rescale(acc, xs, weight_scale, bias, x.dtype)  # [M, N]
    else:
        out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1),
                               bias=bias, out_dtype=x.dtype)  # [M, N]
    return out.view(*x.shape[:-1], N)


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear_scaled_mm` on CUDA, `fp8_linear_ref` elsewhere."""
    fn = fp8_linear_scaled_mm if x.is_cuda else fp8_linear_ref
    return fn(x, weight, weight_scale, bias)
