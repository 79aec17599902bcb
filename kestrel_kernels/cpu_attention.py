"""Attention over the paged KV cache on the CPU (cpu_attention.cpp) and its torch reference.

The kernel is batch-invariant: a query's output does not depend on the other queries of
the batch or on the padding of its request's key list (it attends to exactly the keys its
mask allows, in order, by a fixed sequence of float32 operations), so a verify's rows and
a one-row decode step give a token the same bits. The reference is the SDPA the torch
backend runs (actors/attention/torch_native.py): equal up to float32 rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel_kernels.cpu_build import kernels

__all__ = ["paged_attention", "paged_attention_ref"]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_index: torch.Tensor,
                    mask: torch.Tensor, q_batch: torch.Tensor, q_slot: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [T, H, D] float32; k_cache, v_cache [slots, Hkv, D] float32; kv_index [B, L] int64
    slots of each request's keys; mask [B, 1, Q, L] bool, which keys each of a request's
    query rows sees; q_batch, q_slot [T] int64 each query's request and row -> [T, H, D]."""
    return kernels().paged_attention(q.contiguous(), k_cache, v_cache, kv_index, mask, q_batch, q_slot, scale)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_index: torch.Tensor,
                        mask: torch.Tensor, q_batch: torch.Tensor, q_slot: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """paged_attention by gathering the keys and running SDPA with the mask."""
    B, Q = mask.shape[0], mask.shape[2]
    H, D = q.shape[1], q.shape[2]
    kc, vc = k_cache[kv_index].transpose(1, 2), v_cache[kv_index].transpose(1, 2)  # [B, Hkv, L, D]
    qp = q.new_zeros(B, Q, H, D)  # [B, Q, H, D]
    qp[q_batch, q_slot] = q
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)[q_batch, q_slot]  # [T, H, D]
