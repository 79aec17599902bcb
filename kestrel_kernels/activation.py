"""SwiGLU's gating, silu(gate) * up: the torch reference of kestrel_kernels/triton_activation.py,
and the product as an FP8 linear's input (`silu_and_mul_quant`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel_kernels.fp8_linear import Fp8Rows, fp8_rows

__all__ = ["silu_and_mul", "silu_and_mul_quant"]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I]."""
    return F.silu(gate) * up


def silu_and_mul_quant(gate: torch.Tensor, up: torch.Tensor) -> Fp8Rows:
    """silu_and_mul(gate, up) as FP8 rows."""
    return fp8_rows(silu_and_mul(gate, up))
