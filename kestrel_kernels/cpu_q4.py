"""Block-quantized CPU matmuls (cpu_q4.cpp) and their torch references.

Weights in GGUF blocks of BLOCK inputs: Q4_1 (per block a scale d and a min m in float16,
4-bit codes c, w = c * d + m) for the decoder's projections, Q8_0 (a float16 scale d, int8
codes, w = c * d) for the LM head. Weights dequantized from a GGUF's own Q4_1 / Q8_0 blocks
come back to exactly those blocks (quantize_q4_1, quantize_q8_0), so the kernels compute
with the file's weights. Activations are quantized to int8 per block of BLOCK (scale
amax / 127, codes rounded half to even); each block's code products are summed exactly in
integers and scaled in float32. A row's result does not depend on the other rows of the
call (the kernels are batch-invariant), so a one-row decode step and a verify of several
rows give a row the same bits.

The kernels live in the CPU extension (kestrel_kernels/cpu_build.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kestrel_kernels.cpu_build import kernels

__all__ = ["BLOCK", "Q4_1Weights", "Q8_0Weights", "quantize_q4_1", "quantize_q8_0", "q4_1_linear", "q4_1_linear_ref", "q8_0_linear",
           "q8_0_linear_ref", "quantize_activations_ref"]

BLOCK = 32  # inputs per block: GGUF's Q4_1 and Q8_0
GROUP = 8  # blocks whose scales the kernels load at once (a row's scales padded to whole groups)

def _grouped(t: torch.Tensor) -> torch.Tensor:
    """[N, nb] -> [N, G, GROUP], zero-padded to whole groups."""
    pad = -t.shape[1] % GROUP
    return F.pad(t, (0, pad)).view(t.shape[0], -1, GROUP)


@dataclass
class Q4_1Weights:
    codes: torch.Tensor  # [N, K/2] uint8: byte j of a block holds inputs j (low nibble) and j+16
    dm: torch.Tensor  # [N, G, 2, GROUP] float16: per group of blocks their d's, then their m's

    @property
    def d(self) -> torch.Tensor:
        return self.dm[:, :, 0].reshape(self.dm.shape[0], -1)[:, :self.codes.shape[1] * 2 // BLOCK]  # [N, K/B]

    @property
    def m(self) -> torch.Tensor:
        return self.dm[:, :, 1].reshape(self.dm.shape[0], -1)[:, :self.codes.shape[1] * 2 // BLOCK]  # [N, K/B]

    def codes4(self) -> torch.Tensor:
        """[N, K/BLOCK, BLOCK] int64 codes 0..15, in input order."""
        b = self.codes.view(self.codes.shape[0], -1, BLOCK // 2).long()
        return torch.cat([b & 15, b >> 4], -1)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, c * d + m in float32 (as GGUF readers compute it)."""
        w = self.codes4().float() * self.d.float()[..., None] + self.m.float()[..., None]
        return w.reshape(self.codes.shape[0], -1)


@dataclass
class Q8_0Weights:
    codes: torch.Tensor  # [N, K] int8
    d_groups: torch.Tensor  # [N, G * GROUP] float16, zero-padded

    @property
    def d(self) -> torch.Tensor:
        return self.d_groups[:, :self.codes.shape[1] // BLOCK]  # [N, K/B]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, c * d."""
        N, K = self.codes.shape
        return (self.codes.view(N, -1, BLOCK).float() * self.d.float()[..., None]).reshape(N, K)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"block-quantized weights need input sizes divisible by {BLOCK}, not {K}")
    return w.float().reshape(N, K // BLOCK, BLOCK)  # [N, K/B, B] float32


def quantize_q4_1(w: torch.Tensor) -> Q4_1Weights:
    """w [N, K] float -> Q4_1 blocks: d = (max - min) / 15 and m = min, both in float16,
    c = round((w - m) / d). Weights dequantized from Q4_1 blocks (whose smallest input has
    code 0) give back those blocks exactly."""
    g = _blocks(w)
    low, high = g.amin(-1), g.amax(-1)  # [N, K/B] each
    d = ((high - low) / 15).half()  # [N, K/B]
    m = low.half()
    df = d.float()
    inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))
    c = ((g - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)  # [N, K/B, B]
    codes = (c[..., :BLOCK // 2] | (c[..., BLOCK // 2:] << 4)).reshape(w.shape[0], -1)  # [N, K/2]
    return Q4_1Weights(codes.contiguous(), torch.stack([_grouped(d), _grouped(m)], 2).contiguous())


def quantize_q8_0(w: torch.Tensor) -> Q8_0Weights:
    """w [N, K] float -> Q8_0 blocks: d = max |w| / 127 in float16, c = round(w / d). Weights
    dequantized from Q8_0 blocks give back those blocks exactly."""
    g = _blocks(w)
    d = (g.abs().amax(-1) / 127).half()  # [N, K/B]
    df = d.float()
    inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))
    c = (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8)  # [N, K/B, B]
    return Q8_0Weights(c.reshape(w.shape).contiguous(), _grouped(d).reshape(w.shape[0], -1).contiguous())


def q4_1_linear(x: torch.Tensor, w: Q4_1Weights) -> torch.Tensor:
    """x [M, K] float32 -> x @ W.T [M, N] float32, the AVX2 kernel."""
    return kernels().q4_1_linear(x, w.codes, w.dm)


def q8_0_linear(x: torch.Tensor, w: Q8_0Weights, rows: int | None = None) -> torch.Tensor:
    """x [M, K] float32 -> x @ W[:rows].T [M, rows] float32, the AVX2 kernel."""
    n = w.codes.shape[0] if rows is None else min(rows, w.codes.shape[0])
    return kernels().q8_0_linear(x, w.codes, w.d_groups, n)


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, K/B, B] float32 codes, s [M, K/B], s * sum(q) [M, K/B]),
    the kernels' activation quantization (the same float32 operations, so the same bits)."""
    g = x.float().reshape(x.shape[0], -1, BLOCK)
    a = g.abs().amax(-1)  # [M, K/B]
    inv = torch.where(a > 0, 127 / a, torch.zeros_like(a))
    q = (g * inv[..., None]).round()  # half to even
    s = a / 127
    return q, s, s * q.sum(-1)


def q4_1_linear_ref(x: torch.Tensor, w: Q4_1Weights) -> torch.Tensor:
    """q4_1_linear in torch: the same quantized products, summed in float64 -> [M, N] float32."""
    q, s, qs = quantize_activations_ref(x)
    d, m = w.d.double(), w.m.double()  # [N, K/B] each
    dot = torch.einsum("mbj,nbj->mnb", q.double(), w.codes4().double())  # [M, N, K/B] exact integers
    y = (dot * (d[None] * s.double()[:, None]) + m[None] * qs.double()[:, None]).sum(-1)
    return y.float()


def q8_0_linear_ref(x: torch.Tensor, w: Q8_0Weights, rows: int | None = None) -> torch.Tensor:
    """q8_0_linear in torch, summed in float64 -> [M, rows] float32."""
    q, s, _ = quantize_activations_ref(x)
    c = w.codes[:rows].view(-1, q.shape[1], BLOCK).double()  # [N, K/B, B]
    dot = torch.einsum("mbj,nbj->mnb", q.double(), c)
    return (dot * (w.d[:rows].double()[None] * s.double()[:, None])).sum(-1).float()
