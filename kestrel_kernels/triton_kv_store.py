"""Triton kernel for `kestrel_kernels.kv_store.store_kv`: a token's K and V rows written to
their cache slot in one launch, instead of one indexed copy for K and one for V (at one
stream a decode step's KV writes are a tenth of its GPU time, two small kernels a layer).

One program per token copies its [Hkv * D] K and V rows to slot loc[t], cast to the cache
dtype as the reference casts them, so the caches end up bit for bit the same. No host
reads: CUDA-graph capturable. v may be a column slice of a fused q/k/v GEMM's output.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "store_kv_fits", "store_kv_triton"]


if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(K, V, KCache, VCache, Loc, stride_kt, stride_vt,
                         ROW: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(Loc + t).to(tl.int64)
        i = tl.arange(0, BLOCK)
        ok = i < ROW
        k = tl.load(K + t * stride_kt + i, mask=ok)
        v = tl.load(V + t * stride_vt + i, mask=ok)
        tl.store(KCache + slot * ROW + i, k.to(KCache.dtype.element_ty), mask=ok)
        tl.store(VCache + slot * ROW + i, v.to(VCache.dtype.element_ty), mask=ok)


def store_kv_fits(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Contiguous caches, and each token's [Hkv, D] of K and of V one contiguous run (the
    token stride may be anything): the layouts the kernel addresses."""
    return (k_cache.is_contiguous() and v_cache.is_contiguous()
            and all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (k, v)))


def store_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
    """Triton `store_kv`: k_cache, v_cache [slots, Hkv, D] contiguous, loc [T] int64,
    k, v [T, Hkv, D] with contiguous tokens (any token stride)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.kv_store.store_kv")
    if not store_kv_fits(k_cache, v_cache, k, v):
        raise ValueError("store_kv_triton needs contiguous caches and K/V rows")
    T, H, D = k.shape
    if T == 0:
        return
    row = H * D
    _store_kv_kernel[(T,)](k, v, k_cache, v_cache, loc.contiguous(), k.stride(0), v.stride(0),
                           ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4 if row > 512 else 2)
