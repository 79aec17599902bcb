"""Grammar token masks on logits: the packed bitmasks a grammar matcher fills (xgrammar's
layout: bit j of int32 word w allows token 32*w + j) applied as -inf on disallowed ids.

Pure torch, so one code path serves the CPU and the GPU; tests/unit/test_token_bitmask.py
holds it to xgrammar's own CPU kernel."""
from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., W] int32 -> [..., vocab_size] bool (True: allowed). Ids past 32*W (padding rows
    of the model's vocabulary, which no tokenizer produces) are disallowed."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool()  # [..., W, 32] bool
    allowed = bits.flatten(-2)  # [..., 32W] bool
    width = allowed.shape[-1]
    if width >= vocab_size:
        return allowed[..., :vocab_size]
    pad = allowed.new_zeros(*allowed.shape[:-1], vocab_size - width)
    return torch.cat([allowed, pad], -1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V] float with bitmask [..., W] int32 (same leading shape) -> logits with
    every disallowed id at -inf (a new tensor)."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))
