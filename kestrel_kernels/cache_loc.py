"""KV-slot lookups over the request-to-token table.

Pure-torch references (the CPU path and the test oracle for later Triton kernels).
`req_to_token [R, L] int64` maps (request row, position) -> KV slot. Index tensors are
int64.
"""
from __future__ import annotations

import torch

__all__ = ["assign_cache_locs", "kv_indices"]


def assign_cache_locs(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    starts: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Slots of `width` consecutive positions per request (e.g. the N verify-tree nodes).

    Args:
        req_to_token: [R, L] int64.
        req_pool_indices: [B] int64, row of each request.
        starts: [B] int64, first position of each request; start + width <= L.
        width: positions per request.

    Returns:
        out_cache_loc: [B * width] int64, request-major:
            req_to_token[req_pool_indices[b], starts[b] + w] at b * width + w.
    """
    device = req_to_token.device
    offs = torch.arange(width, dtype=torch.int64, device=device)  # [width] int64
    cols = starts.to(torch.int64)[:, None] + offs[None, :]  # [B, width] int64
    rows = req_pool_indices.to(torch.int64)[:, None].expand_as(cols)  # [B, width] int64
    return req_to_token[rows, cols].to(torch.int64).reshape(-1)


def kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of each request's KV slots (FlashInfer paged-KV style, page size 1).

    Args:
        req_to_token: [R, L] int64.
        req_pool_indices: [B] int64.
        seq_lens: [B] int64, each <= L.

    Returns:
        kv_indptr: [B+1] int64, kv_indptr[0] = 0, kv_indptr[b+1] - kv_indptr[b] = seq_lens[b].
        kv_indices: [sum(seq_lens)] int64, slots of positions 0..seq_len_b-1 of request b,
            request after request.
    """
    device = req_to_token.device
    lens = seq_lens.to(torch.int64)  # [B] int64
    kv_indptr = torch.zeros((lens.shape[0] + 1,), dtype=torch.int64, device=device)  # [B+1] int64
    kv_indptr[1:] = torch.cumsum(lens, dim=0)
    L = req_to_token.shape[1]
    pos = torch.arange(L, dtype=torch.int64, device=device)  # [L] int64
    valid = pos[None, :] < lens[:, None]  # [B, L] bool
    rows = req_to_token[req_pool_indices.to(torch.int64)]  # [B, L] int64
    return kv_indptr, rows[valid].to(torch.int64)  # boolean mask keeps row-major order
