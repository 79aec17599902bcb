"""Random weights for measuring speed without a checkpoint (model.load_format: dummy).

vLLM's convention: every weight uniform in [-1e-3, 1e-3] from a fixed seed. Norm scales
stay 1 (vLLM randomizes them too): activations then keep a normal scale, so low-precision
runs meet no underflow a real model would not. Filled in place on the model's device and
dtype: a 7B model never exists in float32 on the host. FP8 weights are built as such: their
codes uniform over E4M3's range and every channel's scale DUMMY_RANGE / FP8_MAX, so their
values are uniform in the same range.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kestrel_kernels.fp8_linear import FP8, FP8_MAX

log = logging.getLogger("kestrel.loader")

DUMMY_RANGE = 1e-3


@torch.no_grad()
def fill_dummy(model: nn.Module, seed: int) -> None:
    """Fill every floating parameter of ``model`` (already on its device) in place."""
    params = list(model.named_parameters())
    if not params:
        return
    g = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dtype == FP8:  # uniform_ has no float8 kernel: drawn in bf16, rounded to E4M3
            codes = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)  # [N, K]
            p.copy_(codes.uniform_(-FP8_MAX, FP8_MAX, generator=g))
        elif name.endswith("weight_scale"):
            p.fill_(DUMMY_RANGE / FP8_MAX)
        else:
            p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=g)
