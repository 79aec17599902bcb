"""Random weights for measuring speed without a checkpoint (model.load_format: dummy).

vLLM's convention: every weight uniform in [-1e-3, 1e-3] from a fixed seed. Norm scales
stay 1 (vLLM randomizes them too): activations then keep a normal scale, so low-precision
runs meet no underflow a real model would not. Filled in place on the model's device and
dtype: a 7B model never exists in float32 on the host.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

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
        else:
            p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=g)
