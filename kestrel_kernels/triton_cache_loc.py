"""Triton kernel for `kestrel_kernels.cache_loc.assign_cache_locs` (KV slots of the verify-tree nodes).

The torch reference is `kestrel_kernels.cache_loc.assign_cache_locs`; this produces the same
int64 output. One program per request copies `width` consecutive entries of its
req_to_token row; nothing is read on the host, so the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "assign_cache_locs_triton"]


if HAS_TRITON:

    @triton.jit
    def _assign_cache_locs_kernel(
        ReqToToken, ReqIdx, Starts, Out, stride_rt,
        WIDTH: tl.constexpr, BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        row = tl.load(ReqIdx + b).to(tl.int64)
        start = tl.load(Starts + b).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < WIDTH
        slots = tl.load(ReqToToken + row * stride_rt + start + offs, mask=ok, other=0)
        tl.store(Out + b.to(tl.int64) * WIDTH + offs, slots.to(tl.int64), mask=ok)


def assign_cache_locs_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    starts: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Triton `assign_cache_locs`; same arguments and [B * width] int64 result."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.cache_loc.assign_cache_locs")
    if req_to_token.stride(-1) != 1:
        raise ValueError("req_to_token needs a contiguous last dim")
    B = req_pool_indices.numel()
    out = torch.empty(B * width, dtype=torch.int64, device=req_to_token.device)  # [B*width] int64
    if B == 0 or width == 0:
        return out
    _assign_cache_locs_kernel[(B,)](
        req_to_token, req_pool_indices.contiguous(), starts.contiguous(), out,
        req_to_token.stride(0), WIDTH=width, BLOCK=triton.next_power_of_2(width), num_warps=1,
    )
    return out
