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

`quantize_block` is the one-block step as a jitted helper: the RMSNorm and SiLU kernels
(triton_rmsnorm.py, triton_activation.py) call it to write a row they hold as FP8 for the
next linear, with the codes and scale this kernel would give it.
"""
from __future__ import annotations

import torch

from kestrel_kernels.fp8_format import FP8, FP8_MAX, MIN_AMAX
from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "MAX_BLOCK", "default_warps", "quantize_block", "quantize_rows_triton"]

# The longest row one program holds at once (32 values a thread at 32 warps); longer rows
# loop over blocks of _LOOP_BLOCK.
MAX_BLOCK = 32768
_LOOP_BLOCK = 4096
_LATENCY_ROWS = 64  # up to here a call's rows are few enough that each takes many warps


if HAS_TRITON:

    @triton.jit
    def _scale(amax, fp8_max, min_amax):
        """A row's scale from its largest magnitudes (any shape: reduced to one value)."""
        return tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), min_amax), fp8_max)

    @triton.jit
    def _codes(x, scale, fp8_max):
        return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)

    @triton.jit
    def quantize_block(Q, S, x, offs, ok, fp8_max, min_amax):
        """A whole row x (fp32, one block, 0 where not `ok`) -> its scale at S and its codes
        at Q + offs."""
        scale = _scale(tl.abs(x), fp8_max, min_amax)
        tl.store(S, scale)
        tl.store(Q + offs, _codes(x, scale, fp8_max).to(Q.dtype.element_ty), mask=ok)

    @triton.jit
    def _quantize_rows_kernel(X, Q, S, stride_x, K, fp8_max, min_amax, BLOCK: tl.constexpr,
                              ONE_BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        if ONE_BLOCK:  # the whole row at once, held between the two steps
            ok = offs < K
            x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
            quantize_block(Q + row * K, S + row, x, offs, ok, fp8_max, min_amax)
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
    (q [M, K] float8_e4m3fn, scale [M, 1] fp32). `num_warps` overrides the default
    (`default_warps`; the benchmark's sweep: the bits do not change)."""
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
    one = block <= MAX_BLOCK
    block = block if one else _LOOP_BLOCK
    _quantize_rows_kernel[(M,)](x, q, scale, x.stride(0), K, FP8_MAX, MIN_AMAX, BLOCK=block,
                                ONE_BLOCK=one, num_warps=num_warps or default_warps(M, block))
    return q, scale


def default_warps(rows: int, block: int) -> int:
    """A decode step's few rows are a latency: spread each over many warps (one per 128
    values). Prefill's thousands are a bandwidth: fewer warps a row (one per 1024 values)
    leave room for more rows in flight. The H100's sweep (fp8_gemm_bench.py --quant):
    3,584-wide rows 2.3 us with 32 warps against 3.8 with 8 at 1-64 rows, but 38 us with 4
    against 70 with 32 at 8,192 rows."""
    per_warp = 128 if rows <= _LATENCY_ROWS else 1024
    return min(max(block // per_warp, 1), 32)
