"""Grammar token masks on logits: the packed bitmasks a grammar matcher fills (xgrammar's
layout: bit j of int32 word w allows token 32*w + j) applied as -inf on disallowed ids.

`mask_logits_` runs the Triton kernel on CUDA (kestrel_kernels/triton_token_bitmask.py) and torch
elsewhere; the torch path is the reference, held to xgrammar's own CPU kernel by
tests/unit/test_token_bitmask.py."""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import use_triton
from kestrel_kernels.triton_token_bitmask import mask_logits_triton_

_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def disallowed_ids(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., W] int32 -> [..., vocab_size] bool (True: disallowed). Ids past 32*W (padding rows
    of the model's vocabulary, which no tokenizer produces) are disallowed.

    Read as bytes (little-endian: byte k of word w holds ids 32w+8k .. 32w+8k+7), each byte
    looked up in a [256, 8] table of its clear bits: one gather, where shifting every word by
    0..31 made four passes over an [..., W, 32] int32 tensor (a batch-64 tree's 512 rows:
    104 ms against 25 ms on the 2-core development CPU, for JSON-like masks; docs/benchmarks.md)."""
    table = _BYTE_BITS.get(bitmask.device)
    if table is None:
        bits = torch.arange(8, dtype=torch.int32, device=bitmask.device)
        byte = torch.arange(256, dtype=torch.int32, device=bitmask.device)
        table = _BYTE_BITS[bitmask.device] = ((byte.unsqueeze(1) >> bits) & 1) == 0  # [256, 8] bool
    by = bitmask.contiguous().view(torch.uint8)  # [..., 4W] uint8
    off = table.index_select(0, by.flatten().int()).view(*by.shape[:-1], -1)  # [..., 32W] bool
    width = off.shape[-1]
    if width >= vocab_size:
        return off[..., :vocab_size]
    pad = off.new_ones(*off.shape[:-1], vocab_size - width)
    return torch.cat([off, pad], -1)


def mask_logits_torch_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The reference: `mask_logits_` in torch ops."""
    return logits.masked_fill_(disallowed_ids(bitmask.to(logits.device), logits.shape[-1]), float("-inf"))


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
