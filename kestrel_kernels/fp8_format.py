"""The FP8 format Kestrel's FP8 layers use: E4M3 (no infinities, saturating at 448), the one
definition the torch reference and the Triton kernel share."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value
# An all-zero row gets this amax instead of 0 (its scale must not be 0: x / scale).
MIN_AMAX = 1e-12
