"""Triton kernel for `kestrel_kernels.fp8_linear.fp8_linear_ref` at a few rows: the rows'
per-token quantization and the FP8 product in one launch, bound by the weight read.

At one to sixteen rows a linear layer reads its whole weight to produce a few outputs, so
it is a matrix-vector product bound by memory bandwidth. cuBLASLt's row-scaled FP8 GEMM
tiles M by 64 or 128 and ran slower at one row than the bf16 GEMM of twice the bytes
(docs/benchmarks.md, "FP8 targets"); before it, the activations' quantization was a
launch of its own. Here each program owns BLOCK_N output channels for all rows:
  pass 1  the rows' largest magnitudes over K (the rows are small and come from L2),
  pass 2  the rows quantized block by block exactly as `quantize_rows` does (`div_rn`,
          clamp, round to nearest even E4M3), times the weight's E4M3 codes, summed in fp32,
  then    scaled by the row's and the channel's scale, plus the bias, cast to x's dtype:
the reference's arithmetic, so the two differ only in the fp32 summation order. E4M3 codes
are exact in TF32 (3 mantissa bits of its 10), and so are their products in fp32, so the dot
runs on TF32 tensor cores with fp32 accumulation. A row's result does not depend on the other rows (its scale is its own).
No host reads: the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kestrel_kernels.fp8_format import FP8, FP8_MAX, MIN_AMAX
from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "MAX_ROWS", "fp8_linear_small_m"]

MAX_ROWS = 16  # rows one launch takes (tl.dot's smallest M); more go to cuBLASLt's GEMM
_WEIGHT_TILE = 8192  # E4M3 bytes of weight one program loads per K step
_PROGRAMS_PER_SM = 2  # output blocks wanted per SM before blocks grow past 16 channels


if HAS_TRITON:

    @triton.jit
    def _fp8_small_m_kernel(X, W, WS, B, Y, M, N, K, stride_x, stride_w, stride_y, fp8_max, min_amax,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = offs_m < M
        col_ok = offs_n < N
        x_rows = X + offs_m.to(tl.int64)[:, None] * stride_x
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = row_ok[:, None] & (k0 + offs_k < K)[None, :]
            x = tl.load(x_rows + k0 + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.math.div_rn(tl.maximum(amax, min_amax), fp8_max)  # [BLOCK_M] fp32
        w_rows = W + offs_n.to(tl.int64)[:, None] * stride_w
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k < K)[None, :]
            x = tl.load(x_rows + k0 + offs_k[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -fp8_max), fp8_max)
            q = q.to(tl.float8e4nv).to(tl.float32)
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
            acc += tl.dot(q, tl.trans(w.to(tl.float32)), input_precision="tf32", out_dtype=tl.float32)
        ws = tl.load(WS + offs_n, mask=col_ok, other=0.0)
        out = acc * scale[:, None] * ws[None, :]
        if HAS_BIAS:
            out = out + tl.load(B + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
        tl.store(ptrs, out.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _block_n(N: int, device: torch.device) -> int:
    """Output channels per program: the widest of 16-64 that still gives every SM a few
    programs (a 3584-channel down projection at 16, a 37888-channel gate/up at 64)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    for block in (64, 32):
        if triton.cdiv(N, block) >= _PROGRAMS_PER_SM * sms:
            return block
    return 16


def fp8_linear_small_m(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear_ref` for x [M, K] with M <= MAX_ROWS rows (a contiguous last dim):
    weight [N, K] float8_e4m3fn, weight_scale [N, 1] fp32, bias [N] -> [M, N] in x's dtype."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.fp8_linear.fp8_linear_ref")
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS or x.stride(-1) != 1 or weight.dtype != FP8 or weight.shape[1] != K \
            or weight.stride(-1) != 1:
        raise ValueError(f"fp8_linear_small_m: x {tuple(x.shape)} (strides {x.stride()}) needs at most "
                         f"{MAX_ROWS} rows with a contiguous last dim and a contiguous float8_e4m3fn "
                         f"weight [N, {K}]; got {weight.dtype} {tuple(weight.shape)}")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)  # [M, N] in x's dtype
    if M == 0:
        return y
    block_n = _block_n(N, x.device)
    block_k = min(_WEIGHT_TILE // block_n, triton.next_power_of_2(K))
    _fp8_small_m_kernel[(triton.cdiv(N, block_n),)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, y, M, N, K,
        x.stride(0), weight.stride(0), y.stride(0), FP8_MAX, MIN_AMAX, HAS_BIAS=bias is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4)
    return y
