"""Paged-KV CSR for an attention backend: per-request page ids of req_to_token rows.

FlashInfer-style paged KV with `page_size` P: request b's first seq_lens[b] positions
occupy ceil(seq_lens[b] / P) pages; `kv_indices` lists their page ids request after
request (`kv_indptr` [B+1] delimits them) and `kv_last_page_len` says how many slots of
each request's last page are used. A request's row holds page-contiguous slots (pages are
allocated whole, see actors/worker/kv_cache.py), so page j's id is req_to_token[row, j*P] // P.
With P = 1 the page ids are the slots and the CSR equals `kestrel_kernels.cache_loc.kv_indices`.

`paged_kv_indices_ref` is the pure-torch reference (CPU path and test oracle);
`paged_kv_indices_triton` is the kernel: one program per request copies its page ids.
"""
from __future__ import annotations

import torch

from kestrel_kernels.cache_loc import kv_indices

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "indptr_and_last_len", "paged_kv_indices_ref", "paged_kv_indices_triton"]

_BLOCK = 512  # page ids copied per loop iteration


def indptr_and_last_len(seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, ...]:
    """(num_pages [B], kv_indptr [B+1], kv_last_page_len [B]) int64 on seq_lens' device."""
    lens = seq_lens.to(torch.int64)  # [B] int64
    num_pages = torch.div(lens + page_size - 1, page_size, rounding_mode="floor")  # [B] int64
    kv_indptr = torch.zeros((lens.shape[0] + 1,), dtype=torch.int64, device=lens.device)  # [B+1] int64
    kv_indptr[1:] = torch.cumsum(num_pages, dim=0)
    # An empty request has no last page: 0, not page_size.
    last = torch.where(lens > 0, (lens - 1) % page_size + 1, torch.zeros_like(lens))  # [B] int64
    return num_pages, kv_indptr, last


def paged_kv_indices_ref(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Paged-KV CSR in pure torch.

    Args:
        req_to_token: [R, L] int64, page-contiguous slots.
        req_pool_indices: [B] int64, row of each request.
        seq_lens: [B] int64, each <= L.
        page_size: P.

    Returns:
        kv_indptr: [B+1] int64, kv_indptr[b+1] - kv_indptr[b] = ceil(seq_lens[b] / P).
        kv_indices: [kv_indptr[B]] int64 page ids (slot // P of each page's first slot).
        kv_last_page_len: [B] int64 in [1, P], 0 for an empty request.
    """
    num_pages, kv_indptr, last = indptr_and_last_len(seq_lens, page_size)
    # Column j*P of a row is the first slot of the request's page j.
    _, first_slots = kv_indices(req_to_token[:, ::page_size], req_pool_indices, num_pages)
    return kv_indptr, torch.div(first_slots, page_size, rounding_mode="floor"), last


if HAS_TRITON:

    @triton.jit
    def _paged_kv_indices_kernel(
        ReqToToken, ReqIdx, SeqLens, KvIndptr, Out, stride_rt,
        PAGE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        row = tl.load(ReqIdx + b).to(tl.int64)
        n_pages = (tl.load(SeqLens + b).to(tl.int64) + PAGE - 1) // PAGE
        dst = tl.load(KvIndptr + b)
        src = ReqToToken + row * stride_rt
        for i in range(tl.cdiv(n_pages, BLOCK)):  # loop over BLOCK-page chunks
            pages = i * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            ok = pages < n_pages
            slot = tl.load(src + pages * PAGE, mask=ok, other=0).to(tl.int64)
            tl.store(Out + dst + pages, slot // PAGE, mask=ok)


def paged_kv_indices_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int = 1,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `paged_kv_indices_ref`; same arguments and results.

    `out` ([>= kv_indptr[B]], int64 or int32) receives the page ids; without it the total page count
    is read back to the host (one sync), so pass it when capturing a CUDA graph. The
    returned kv_indices is `out` cut to the total when it was allocated here, `out` itself
    otherwise.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use paged_kv_indices_ref")
    if req_to_token.stride(-1) != 1:
        raise ValueError("req_to_token needs a contiguous last dim")
    _, kv_indptr, last = indptr_and_last_len(seq_lens, page_size)
    if out is None:
        out = torch.empty(int(kv_indptr[-1]), dtype=torch.int64, device=req_to_token.device)  # [total] int64
    B = req_pool_indices.numel()
    if B == 0:
        return kv_indptr, out, last
    _paged_kv_indices_kernel[(B,)](
        req_to_token, req_pool_indices.contiguous(), seq_lens.contiguous(), kv_indptr, out,
        req_to_token.stride(0), PAGE=page_size, BLOCK=_BLOCK, num_warps=4,
    )
    return kv_indptr, out, last
