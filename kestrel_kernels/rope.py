"""Rotary position embedding (HF rotate_half layout): the torch reference of
kestrel_kernels/triton_rope.py. Frequencies come from actors.models.rope.rope_inv_freq."""
from __future__ import annotations

import torch

__all__ = ["rope", "cos_sin", "apply_rotary"]


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64, inv_freq [D/2] fp32 -> (cos, sin) [T, D] fp32 each."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2] fp32
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]: rotate_half pairs i with i + D/2
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n_heads, D], cos/sin [T, D] (any float dtype) -> x rotated, in x's dtype."""
    cos = cos.to(x.dtype)[:, None, :]  # [T, 1, D], broadcast over heads
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + _rotate_half(x) * sin


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
         inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], positions [T] int64, inv_freq [D/2] fp32 -> (q, k)
    rotated (new tensors, in their dtypes)."""
    cos, sin = cos_sin(positions, inv_freq)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
