"""Turns last-position logits into tokens: greedy rows by argmax, the rest by seeded coins."""
from __future__ import annotations

import numpy as np
import torch

from actors.host_copy import to_device
from kernels.sampling import process_logits, sample_from_probs


def sample_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float],
                  top_k: list[int], coins: np.ndarray | None,
                  min_p: np.ndarray | None = None) -> torch.Tensor:
    """logits [B, V] -> tokens [B] int64. coins[:, 0] drives each sampled row; min_p [B]
    (None = off) filters sampled rows."""
    tokens = logits.argmax(-1)  # [B] int64
    hot = [i for i, t in enumerate(temperature) if t > 0]
    if hot:
        dev = logits.device
        idx = to_device(hot, torch.int64, dev)
        probs = process_logits(
            logits[idx].float(),
            to_device([temperature[i] for i in hot], torch.float32, dev),
            to_device([top_p[i] for i in hot], torch.float32, dev),
            to_device([top_k[i] for i in hot], torch.int64, dev),
            None if min_p is None else to_device(np.asarray(min_p)[hot], torch.float32, dev))
        tokens[idx] = sample_from_probs(probs, to_device(coins[hot, 0], torch.float32, dev))
    return tokens
