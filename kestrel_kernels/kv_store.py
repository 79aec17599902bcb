"""Writing new tokens' K and V into a layer's paged cache: the torch reference of
kestrel_kernels/triton_kv_store.py."""
from __future__ import annotations

import torch

__all__ = ["store_kv"]


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache, v_cache [slots, Hkv, D]; loc [T] int64; k, v [T, Hkv, D]:
    cache[loc] = k and v, cast to the cache's dtype."""
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)
