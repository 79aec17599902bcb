"""Grammar token masks on logits: the packed bitmasks a grammar matcher fills (xgrammar's
layout: bit j of int32 word w allows token 32*w + j) applied as -inf on disallowed ids.

`mask_logits_` runs the Triton kernel on CUDA (kernels/triton_token_bitmask.py) and torch
elsewhere; the torch path is the reference, held to xgrammar's own CPU kernel by
tests/unit/test_token_bitmask.py."""
from __future__ import annotations

import torch

from kernels.triton_available import use_triton
from kernels.triton_token_bitmask import mask_logits_triton_

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


def mask_logits_torch_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The reference: `mask_logits_` in torch ops."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill_(~allowed, float("-inf"))


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits [..., V] float with bitmask [..., W] int32 (same leading shape) get
    -inf at every disallowed id -> logits. The callers own their logits (a graph's output,
    rewritten by its next replay, or a fresh tensor), and logprobs are taken after the mask."""
    V, W = logits.shape[-1], bitmask.shape[-1]
    if use_triton(logits) and logits.stride(-1) == 1:
        try:
            rows = logits.view(-1, V)  # [R, V]: the same memory, or an error when it cannot be
        except RuntimeError:
            rows = None
        if rows is not None:
            mask_logits_triton_(rows, bitmask.to(logits.device).reshape(-1, W))
            return logits
    return mask_logits_torch_(logits, bitmask)
