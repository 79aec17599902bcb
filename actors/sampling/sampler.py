"""Turns last-position logits into tokens: greedy rows by argmax, the rest by seeded coins.

What a step's sampling needs from the host comes from its plan's lists (never from a
device read): which rows sample, and whether any of them truncates its distribution, which
decides whether the sort of top-k/top-p runs (kestrel_kernels/sampling.py) and which sampled graph
variant replays.
"""
from __future__ import annotations

import numpy as np
import torch

from actors.worker.host_copy import to_device
from actors.protocol.step_plan import StepPlan
from kestrel_kernels.sampling import process_logits, sample_from_probs


def truncates(rows: list[int], top_p: list[float], top_k: list[int], min_p: np.ndarray | None) -> bool:
    """Whether one of `rows` (plan positions) asks for top-k, top-p or min-p."""
    return any(top_k[i] > 0 or top_p[i] < 1.0 or (min_p is not None and min_p[i] > 0) for i in rows)


def sampling_flags(plan: StepPlan) -> tuple[bool, bool]:
    """A StepPlan's (some row samples, some sampled row truncates)."""
    hot = [i for i, t in enumerate(plan.temperature) if t > 0]
    return bool(hot), truncates(hot, plan.top_p, plan.top_k, plan.min_p)


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
            None if min_p is None else to_device(np.asarray(min_p)[hot], torch.float32, dev),
            filtered=truncates(hot, top_p, top_k, min_p))
        tokens[idx] = sample_from_probs(probs, to_device(coins[hot, 0], torch.float32, dev))
    return tokens
