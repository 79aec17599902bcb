"""Triton, where it is installed: the kernels' one import of it.

Triton is optional (CPU machines run the torch references, which are also the kernels'
test oracles). Without it `HAS_TRITON` is False and `triton`/`tl` are None, and the
`kernels/triton_*.py` modules define no kernels.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton", "use_triton"]


def use_triton(t, force_torch: bool = False) -> bool:
    """Whether an op on tensor `t` runs its Triton kernel: triton is there and `t` is on CUDA."""
    return HAS_TRITON and t.is_cuda and not force_torch
