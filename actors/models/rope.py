"""RoPE frequencies with linear / llama3 / llama.cpp-factor scaling; the rotation itself is
kestrel_kernels/layer_ops.rope (HF rotate_half layout)."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 on CPU, one per rotated pair."""
    # Built in fp32 on CPU with explicit device so a surrounding torch.device("meta") context
    # cannot turn it into a shapeless placeholder.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [head_dim/2] fp32
    kind = (rope_scaling or {}).get("rope_type", "default")
    if kind in ("default", "dynamic"):
        # Dynamic NTK only changes frequencies beyond max_position_embeddings; the engine
        # never runs past that length, so inside it the frequencies are the default ones.
        return inv_freq
    if kind == "linear":
        # Positions are compressed by `factor`, i.e. every frequency is divided by it.
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if kind == "freq_factors":
        # llama.cpp stores llama3-style scaling as a per-frequency divisor tensor (rope_freqs).
        factors = torch.tensor(rope_scaling["factors"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} values, expected {inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"rope_type {kind!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
    # and the band in between interpolated smoothly in 1/wavelength.
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)  # 0 at the low edge, 1 at the high edge
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_ctx / high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """Holds inv_freq [head_dim/2] fp32 on the model's device; kestrel_kernels/layer_ops.rope turns
    positions into angles on each call (graph-friendly: no cos/sin tables)."""

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict | None = None):
        super().__init__()
        self._inv_freq_cpu = rope_inv_freq(head_dim, theta, rope_scaling)  # [head_dim/2] fp32
        self.register_buffer("inv_freq", self._inv_freq_cpu.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(bf16) / to_empty() would round or wipe inv_freq and shift every angle;
        # follow the device only and re-materialise the exact fp32 values there.
        device = fn(self.inv_freq).device
        self.inv_freq = self._inv_freq_cpu.to(device)
        return self
