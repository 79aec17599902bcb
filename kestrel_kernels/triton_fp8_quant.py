"""Triton kernel for `kestrel_kernels.fp8_linear.quantize_rows`: a row's FP8 codes and scale
in one launch instead of seven element-wise torch kernels (cast, abs, amax, clamp, divide,
clamp, cast) before every FP8 GEMM.

One program per row. A row of up to 32768 values (every projection input of Qwen2.5-72B's
shape) is read once into registers, spread over up to 32 warps so that all of it is in
flight at once: a decode step's row is a latency, not a bandwidth, matter. A longer row
takes two passes over it in blocks: the largest magnitude, then the codes. The divisions
round to nearest (`div_rn`), as torch's do, and E4M3 conversion rounds to nearest even, so
the codes and scales are bit-equal to the reference's. No host reads: the call can be
captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kestrel_kernels.fp8_format import FP8, FP8_MAX, MIN_AMAX
from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "quantize_rows_triton"]

# The longest row one program holds at once (32 values a thread at 32 warps); longer rows
# loop over blocks of _LOOP_BLOCK.
_MAX_BLOCK = 32768
_LOOP_BLOCK = 4096


if HAS_TRITON:

    @triton.jit
    def _scale(amax, fp8_max, min_amax):
        """A row's scale from its largest magnitudes (any shape: reduced to one value)."""
        return tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), min_amax), fp8_max)

    @triton.jit
    def _codes(x, scale, fp8_max):
        return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, stride_x, K, fp8_max, min_amax, BLOCK: tl.constexpr,
                              ONE_BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        if ONE_BLOCK:  # the whole row at once, held between the two steps
            ok = offs < K
            x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
            scale = _scale(tl.abs(x), fp8_max, min_amax)
            tl.store(S + row, scale)
            tl.store(Q + row * K + offs, _codes(x, scale, fp8_max).to(Q.dtype.element_ty), mask=ok)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                ok = k0 + offs < K
                x = tl.load(X + row * stride_x + k0 + offs, mask=ok, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = _scale(amax, fp8_max, min_amax)
            tl.store(S + row, scale)
            for k0 in range(0, K, BLOCK):
                ok = k0 + offs < K
                x = tl.load(X + row * stride_x + k0 + offs, mask=ok, other=0.0).to(tl.float32)
                tl.store(Q + row * K + k0 + offs, _codes(x, scale, fp8_max).to(Q.dtype.element_ty), mask=ok)


def quantize_rows_triton(x: torch.Tensor, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `quantize_rows`: x [M, K] (rows with a contiguous last dim) ->
    (q [M, K] float8_e4m3fn, scale [M, 1] fp32). `num_warps` overrides the default of one
    warp per 512 values of the row's block (the benchmark's sweep; the bits do not change)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.fp8_linear.quantize_rows")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows_triton needs [M, K] rows with a contiguous last dim, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)  # [M, K] E4M3 codes
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)  # [M, 1] per-row scale
    if M == 0:
        return q, scale
    block = triton.next_power_of_2(K)
    one = block <= _MAX_BLOCK
    block = block if one else _LOOP_BLOCK
    _quantize_rows_kernel[(M,)](x, q, scale, x.stride(0), K, FP8_MAX, MIN_AMAX, BLOCK=block,
                                ONE_BLOCK=one, num_warps=num_warps or min(max(block // 512, 1), 32))
    return q, scale
