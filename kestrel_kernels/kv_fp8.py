"""The FP8 KV cache's stored form (kv_cache.dtype=fp8_e4m3): a value x of a layer's K (or V)
is kept as round(x / scale) in E4M3, clamped to its finite range, with one fp32 scale per
layer for K and one for V. Scales are device tensors that every reader loads (the Triton
kernel too), so calibrated scales can replace the default 1.0 without a recompile.

FP8 tensors are allocated and indexed through byte views: torch (>= 2.4 here) gained
float8 fill and index kernels late and not on every device; bytes index everywhere, and a
slot's bytes are its value (one scale per layer)."""
from __future__ import annotations

import torch

from kestrel_kernels.fp8_format import FP8, FP8_MAX


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x ([..., D] any float dtype) / scale ([1] fp32), rounded to nearest E4M3; values past
    the range saturate at +-448 (a plain cast may give NaN there)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [..., D] float8_e4m3fn


def dequantize_kv(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize_kv` stored: x8 ([..., D] float8_e4m3fn) * scale, in `dtype`."""
    return (x8.float() * scale).to(dtype)  # [..., D] dtype


def gather_fp8(cache: torch.Tensor, index) -> torch.Tensor:
    """cache[index] of a float8_e4m3fn tensor (any index torch takes)."""
    return cache.view(torch.uint8)[index].view(FP8)


def scatter_fp8(cache: torch.Tensor, index, values: torch.Tensor) -> None:
    """cache[index] = values, both float8_e4m3fn."""
    cache.view(torch.uint8)[index] = values.view(torch.uint8)
