"""A step's coins on the device, where the sampled graphs read them.

The scheduler draws each sampled request's uniforms from its seeded generator (plan.coins,
[B, C]: one per tree node and a final one under speculation, else one), so seeded output
is reproducible whichever path a step takes. A graph reads fixed addresses, so they go
into one static buffer, lane by lane as the graph's rows: one host-to-device copy per
step, without waiting for the device (actors/worker/host_copy.py). Padded lanes get zeros (their
row 0 is greedy, so no coin of theirs is used; nothing of an earlier step stays there).
"""
from __future__ import annotations

import numpy as np
import torch

from actors.worker.host_copy import copy_to_device


class StepCoins:
    def __init__(self, lanes: int, width: int, device: torch.device):
        self.width = width
        self.buffer = torch.zeros(lanes, width, dtype=torch.float32, device=device)  # [M, C] float32

    def load(self, coins: np.ndarray, bs: int) -> None:
        """Put a plan's coins [B, C] into lanes [0, B) and zeros into lanes [B, bs)."""
        host = np.zeros((bs, self.width), dtype=np.float32)  # [bs, C] float32
        host[:len(coins)] = coins
        copy_to_device(self.buffer[:bs], host)
