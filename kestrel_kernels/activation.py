"""SwiGLU's gating, silu(gate) * up: the torch reference of kestrel_kernels/triton_activation.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["silu_and_mul"]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I]."""
    return F.silu(gate) * up
