"""Weight-only low-bit matmuls on the CPU (torch's own kernels) and their torch references.

int4: weights in groups of GROUP inputs, each group a scale s and an offset z, weight =
(code - 8) * s + z for codes 0..15: a Q4_1 GGUF block (d, m) is exactly s = d, z = m + 8d.
int8: one scale per output row, weight = code * s.

torch's CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) take bfloat16
activations on AVX2 machines without native bf16 (their float32 paths are 5-15x slower,
docs/benchmarks.md), accumulate in float32 and round the result to bfloat16. The references
compute that same function with a float32 GEMM on the dequantized weights: equal up to the
order of the float32 sums, so either may run for a forward and the model stays one model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["GROUP", "Int4Weights", "Int8Weights", "quantize_int4", "quantize_int8",
           "int4_linear", "int4_linear_ref", "int8_linear", "int8_linear_ref"]

GROUP = 32  # inputs per int4 group: a GGUF Q4_0/Q4_1 block
ACT = torch.bfloat16  # the kernels' activation (and scale, output) dtype


@dataclass
class Int4Weights:
    packed: torch.Tensor  # [N, K/2] uint8, torch's CPU int4 layout
    scales_zeros: torch.Tensor  # [K/GROUP, N, 2] bfloat16: (s, z) per group
    dequantized: torch.Tensor  # [N, K] float32, (code - 8) * s + z


@dataclass
class Int8Weights:
    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] bfloat16
    dequantized: torch.Tensor | None  # [N, K] float32, code * s (None: not kept)


def quantize_int4(w: torch.Tensor) -> Int4Weights:
    """w [N, K] float (K a multiple of GROUP) -> its int4 groups: per group s = (max - min)/15
    and codes round((w - min)/s). For weights dequantized from Q4_1 blocks (whose smallest
    value has code 0 and largest code 15) the codes are the block's own and s, z its d and
    m + 8d, up to their bfloat16 rounding."""
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"int4 weights need input sizes divisible by {GROUP}, not {K}")
    g = w.float().reshape(N, K // GROUP, GROUP)  # [N, K/G, G] float32
    low, high = g.amin(-1), g.amax(-1)  # [N, K/G] each
    s = ((high - low) / 15).to(ACT)  # [N, K/G] bfloat16
    sf = s.float()
    inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
    codes = ((g - low[..., None]) * inv[..., None]).round().clamp(0, 15)  # [N, K/G, G] float32
    z = (low + 8 * sf).to(ACT)  # [N, K/G] bfloat16
    deq = ((codes - 8) * sf[..., None] + z.float()[..., None]).reshape(N, K)  # [N, K] float32
    codes = codes.reshape(N, K).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # [N, K/2] uint8
    scales_zeros = torch.stack([s, z], -1).transpose(0, 1).contiguous()  # [K/G, N, 2] bfloat16
    return Int4Weights(packed, scales_zeros, deq)


def quantize_int8(w: torch.Tensor) -> Int8Weights:
    """w [N, K] float -> int8 codes with one scale per row, max |w| / 127."""
    wf = w.float()
    s = (wf.abs().amax(-1) / 127).to(ACT)  # [N] bfloat16
    sf = s.float()
    inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
    codes = (wf * inv[:, None]).round().clamp(-127, 127)  # [N, K] float32
    return Int8Weights(codes.to(torch.int8), s, codes * sf[:, None])


def int4_linear(x: torch.Tensor, w: Int4Weights) -> torch.Tensor:
    """x [M, K] -> x @ W.T [M, N] bfloat16, torch's int4 CPU kernel."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACT), w.packed, GROUP, w.scales_zeros)


def int4_linear_ref(x: torch.Tensor, w: Int4Weights) -> torch.Tensor:
    """int4_linear as a float32 GEMM on the dequantized weights."""
    return F.linear(x.to(ACT).float(), w.dequantized).to(ACT)


def int8_linear(x: torch.Tensor, w: Int8Weights, rows: int | None = None) -> torch.Tensor:
    """x [M, K] -> x @ W[:rows].T [M, rows] bfloat16, torch's int8 weight-only kernel."""
    return torch.ops.aten._weight_int8pack_mm(x.to(ACT), w.codes[:rows], w.scales[:rows])


def int8_linear_ref(x: torch.Tensor, w: Int8Weights, rows: int | None = None) -> torch.Tensor:
    """int8_linear as a float32 GEMM on the dequantized weights."""
    return F.linear(x.to(ACT).float(), w.dequantized[:rows]).to(ACT)
