"""Turns last-position logits into tokens: greedy rows by argmax, the rest by seeded coins."""
from __future__ import annotations

import numpy as np
import torch

from kernels.sampling import process_logits, sample_from_probs


def sample_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float],
                  top_k: list[int], coins: np.ndarray | None,
                  min_p: np.ndarray | None = None) -> torch.Tensor:
    """logits [B, V] -> tokens [B] int64. coins[:, 0] drives each sampled row; min_p [B]
    (None = off) filters sampled rows."""
    tokens = logits.argmax(-1)  # [B] int64
    hot = [i for i, t in enumerate(temperature) if t > 0]
    if hot:
        idx = torch.tensor(hot, dtype=torch.int64, device=logits.device)
        probs = process_logits(
            logits[idx].float(),
            torch.tensor([temperature[i] for i in hot], device=logits.device),
            torch.tensor([top_p[i] for i in hot], device=logits.device),
            torch.tensor([top_k[i] for i in hot], dtype=torch.int64, device=logits.device),
            None if min_p is None else torch.tensor(np.asarray(min_p)[hot], device=logits.device))
        tokens[idx] = sample_from_probs(probs, torch.from_numpy(coins).to(logits.device)[idx, 0])
    return tokens
