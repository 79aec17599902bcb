"""Block-quantized CPU matmuls (cpu_q4.cpp) and their torch references.

Weights in GGUF blocks of BLOCK inputs: Q4_1 (per block a scale d and a min m in float16,
4-bit codes c, w = c * d + m) for the decoder's projections, Q8_0 (a float16 scale d, int8
codes, w = c * d) for the LM head. Weights dequantized from a GGUF's own Q4_1 / Q8_0 blocks
come back to exactly those blocks (quantize_q4_1, quantize_q8_0), so the kernels compute
with the file's weights. Activations are quantized to int8 per block of BLOCK (scale
amax / 127, codes rounded half to even); the code products are summed exactly in integers,
per int32 lane of a vector holding inputs of one block (the kernels' layout, _Layout), and
scaled in float32 by the block's d * s. A row's result does not depend on the other rows
of the call (the kernels are batch-invariant), so a one-row decode step and a verify of
several rows give a row the same bits.

The kernels live in the CPU extension (kestrel_kernels/cpu_build.py). The Q4_1 and Q8_0
kernels sum their code products with VNNI where the CPU has it (AVX-VNNI, else AVX512-VNNI
on 256-bit vectors), else with AVX2, chosen when the extension loads; all give the same
bits. set_isa("avx2") forces AVX2 (tests and benchmarks compare the two), isa() says which
runs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kestrel_kernels.cpu_build import kernels

__all__ = ["BLOCK", "Q4_1Weights", "Q8_0Weights", "quantize_q4_1", "quantize_q8_0", "q4_1_linear", "q4_1_linear_ref", "q8_0_linear",
           "q8_0_linear_ref", "quantize_activations_ref", "set_isa", "isa"]

BLOCK = 32  # inputs per block: GGUF's Q4_1 and Q8_0
LANES = 8  # int32 lanes of a vector: a piece's blocks (at most 8) share them, one scale slot each


def _piece_sizes(nb: int) -> list[int]:
    """A row of nb blocks as the kernels' pieces: whole groups of 8, then 4, 2, 1."""
    sizes = [LANES] * (nb // LANES)
    sizes += [t for t in (4, 2, 1) if nb % LANES & t]
    return sizes


@dataclass(frozen=True)
class _Layout:
    """Where the kernels keep a row's blocks (cpu_q4.cpp): in a t-block piece, 4-byte word w
    of block j sits in vector w // (8 // t), lane j * (8 // t) + w % (8 // t), so each int32
    lane holds one block's inputs; the scales take 8 slots per piece, d (and s) once per
    lane, m (and s * sum(q)) in the first t."""
    perm: torch.Tensor  # [nb * B] int64: the input at each position of the kernels' order
    lo: torch.Tensor  # [nb * B / 2] int64: the input in each Q4_1 code byte's low nibble
    hi: torch.Tensor  # [nb * B / 2] int64: and in its high nibble
    lane_block: torch.Tensor  # [P * 8] int64: the block whose d each slot holds
    d_slot: torch.Tensor  # [nb] int64: a slot holding the block's d
    m_slot: torch.Tensor  # [nb] int64: the slot holding the block's m
    slots: int  # P * 8


@functools.lru_cache(maxsize=None)
def _layout(nb: int) -> _Layout:
    """The kernels' layout of a row of nb blocks (the same for weights and activations)."""
    perm, lo, hi, lane_block, d_slot, m_slot = [], [], [], [], [0] * nb, [0] * nb
    b0 = 0
    for p, t in enumerate(_piece_sizes(nb)):
        per = LANES // t
        order = []
        for pos in range(t * BLOCK):
            v, lane, e = pos // BLOCK, pos % BLOCK // 4, pos % 4
            order.append((b0 + lane // per) * BLOCK + (v * per + lane % per) * 4 + e)
        perm += order
        # A piece's t * B / 2 code bytes: its first half of positions low, the second high.
        lo += order[:t * BLOCK // 2]
        hi += order[t * BLOCK // 2:]
        lane_block += [b0 + lane // per for lane in range(LANES)]
        for j in range(t):
            d_slot[b0 + j], m_slot[b0 + j] = p * LANES + j * per, p * LANES + j
        b0 += t
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)
    return _Layout(as_t(perm), as_t(lo), as_t(hi), as_t(lane_block), as_t(d_slot), as_t(m_slot),
                   len(lane_block))


@dataclass
class Q4_1Weights:
    codes: torch.Tensor  # [N, K/2] uint8: 4-bit codes in the kernels' order (_Layout)
    dm: torch.Tensor  # [N, P, 2, LANES] float16: per piece the d of each lane, then the m's

    @property
    def layout(self) -> _Layout:
        return _layout(self.codes.shape[1] * 2 // BLOCK)

    @property
    def d(self) -> torch.Tensor:
        return self.dm[:, :, 0].reshape(self.dm.shape[0], -1)[:, self.layout.d_slot]  # [N, K/B]

    @property
    def m(self) -> torch.Tensor:
        return self.dm[:, :, 1].reshape(self.dm.shape[0], -1)[:, self.layout.m_slot]  # [N, K/B]

    def codes4(self) -> torch.Tensor:
        """[N, K/BLOCK, BLOCK] int64 codes 0..15, in input order."""
        N, L = self.codes.shape[0], self.layout
        c = torch.empty(N, self.codes.shape[1] * 2, dtype=torch.int64)  # [N, K]
        c[:, L.lo] = (self.codes & 15).long()
        c[:, L.hi] = (self.codes >> 4).long()
        return c.view(N, -1, BLOCK)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, c * d + m in float32 (as GGUF readers compute it)."""
        w = self.codes4().float() * self.d.float()[..., None] + self.m.float()[..., None]
        return w.reshape(self.codes.shape[0], -1)


@dataclass
class Q8_0Weights:
    codes: torch.Tensor  # [N, K] int8 in the kernels' order (_Layout)
    d_lanes: torch.Tensor  # [N, P * LANES] float16: the d of each lane's block

    @property
    def layout(self) -> _Layout:
        return _layout(self.codes.shape[1] // BLOCK)

    @property
    def d(self) -> torch.Tensor:
        return self.d_lanes[:, self.layout.d_slot]  # [N, K/B]

    def codes8(self) -> torch.Tensor:
        """[N, K/BLOCK, BLOCK] int8 codes in input order."""
        c = torch.empty_like(self.codes)  # [N, K]
        c[:, self.layout.perm] = self.codes
        return c.view(self.codes.shape[0], -1, BLOCK)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, c * d."""
        N, K = self.codes.shape
        return (self.codes8().float() * self.d.float()[..., None]).reshape(N, K)


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
    L, N = _layout(g.shape[1]), w.shape[0]
    c = c.view(N, -1)  # [N, K] input order
    codes = c[:, L.lo] | (c[:, L.hi] << 4)  # [N, K/2]
    m_slots = torch.zeros(N, L.slots, dtype=torch.float16)
    m_slots[:, L.m_slot] = m
    dm = torch.stack([d[:, L.lane_block], m_slots], 1).view(N, 2, -1, LANES).transpose(1, 2)  # [N, P, 2, LANES]
    return Q4_1Weights(codes.contiguous(), dm.contiguous())


def quantize_q8_0(w: torch.Tensor) -> Q8_0Weights:
    """w [N, K] float -> Q8_0 blocks: d = max |w| / 127 in float16, c = round(w / d). Weights
    dequantized from Q8_0 blocks give back those blocks exactly."""
    g = _blocks(w)
    d = (g.abs().amax(-1) / 127).half()  # [N, K/B]
    df = d.float()
    inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))
    c = (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8)  # [N, K/B, B]
    L = _layout(g.shape[1])
    return Q8_0Weights(c.view(w.shape[0], -1)[:, L.perm].contiguous(), d[:, L.lane_block].contiguous())


def set_isa(name: str) -> None:
    """The Q4_1 and Q8_0 kernels' code products, for every later call in this process (the
    decoder stack's too): "auto" (VNNI where the CPU has it, the default) or "avx2"."""
    kernels().set_q4_isa(name)


def isa() -> str:
    """The block kernels' instruction set in use: "avxvnni", "avx512vnni" or "avx2"."""
    return kernels().q4_isa()


def q4_1_linear(x: torch.Tensor, w: Q4_1Weights) -> torch.Tensor:
    """x [M, K] float32 -> x @ W.T [M, N] float32, the kernel (isa())."""
    return kernels().q4_1_linear(x, w.codes, w.dm)


def q8_0_linear(x: torch.Tensor, w: Q8_0Weights, rows: int | None = None) -> torch.Tensor:
    """x [M, K] float32 -> x @ W[:rows].T [M, rows] float32, the AVX2 kernel."""
    n = w.codes.shape[0] if rows is None else min(rows, w.codes.shape[0])
    return kernels().q8_0_linear(x, w.codes, w.d_lanes, n)


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
    c = w.codes8()[:rows].double()  # [N, K/B, B]
    dot = torch.einsum("mbj,nbj->mnb", q.double(), c)
    return (dot * (w.d[:rows].double()[None] * s.double()[:, None])).sum(-1).float()
