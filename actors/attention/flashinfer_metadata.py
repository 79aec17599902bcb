"""FlashInfer metadata from Kestrel's paged layout: page tables and custom-mask bits.

Runs on CPU too, tested there against straightforward references; the page-id gather is
the kestrel_kernels.spec_ops op (Triton on CUDA).

Request b's keys are req_to_token[row_b, 0 : kv_b] (prefix, then the new keys: every
caller writes the new keys' slots at positions prefix_b.. of the row, see
actors/attention/triton_backend.py). Rows are page-aligned (the allocator hands out whole
pages, C12), so position j lives in page req_to_token[row_b, j - j % P] // P at offset
j % P, which is FlashInfer's paged layout: kv_indptr (pages per request, cumulative),
kv_indices (page ids), kv_last_page_len (entries in each request's last page).

FlashInfer's custom mask covers the whole [q_b, kv_b] rectangle of a request: the prefix
columns (all visible) and the new keys' block. Packed, each request is its own
byte-aligned segment with bit `i * kv_b + j` LSB-first (flashinfer.segment_packbits with
bitorder="little"), and mask_indptr holds the segments' byte offsets.
"""
from __future__ import annotations

import torch

from kestrel_kernels import spec_ops
from kestrel_kernels.triton_kv_indices import indptr_and_last_len


def page_table(table: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, page_size: int):
    """kv_indptr [B+1] int32 host, kv_indices [sum pages] int32 on rows' device,
    kv_last_page_len [B] int32 host, for request b holding keys table[rows[b], :kv_lens[b]].

    kv_lens is a host tensor (FlashInfer plans on the host): the CSR sizes are computed
    there, and the page-id gather (kestrel_kernels.spec_ops.paged_kv_indices) writes into a buffer
    of the known size, so nothing waits for the device.
    """
    _, indptr, last = indptr_and_last_len(kv_lens, page_size)  # host int64
    out = torch.empty(int(indptr[-1]), dtype=torch.int32, device=rows.device)  # [total] int32
    _, indices, _ = spec_ops.paged_kv_indices(table, rows, kv_lens.to(rows.device, non_blocking=True),
                                              page_size, out)
    return indptr.to(torch.int32), indices, last.to(torch.int32)


def full_mask(prefix_lens: torch.Tensor, qo_lens: list[int], new_lens: list[int],
              custom_mask: torch.Tensor | None, device) -> torch.Tensor:
    """The flattened [sum q_b * (prefix_b + E_b)] bool mask FlashInfer's plan() takes:
    prefix columns visible, then custom_mask[b, :q_b, :E_b] (None: the block hidden, the
    placeholder a graph replay plans with before the captured forward sets the block).
    prefix_lens is a host tensor."""
    p = prefix_lens.to(torch.int64)  # [B] int64 host
    q = torch.tensor(qo_lens, dtype=torch.int64)  # [B] int64 host
    kv = p + torch.tensor(new_lens, dtype=torch.int64)  # [B] int64 host
    sizes = q * kv  # [B] int64 host
    total = int(sizes.sum())
    B = p.numel()
    b = torch.repeat_interleave(torch.arange(B, device=device), sizes.to(device),
                                output_size=total)  # [total] int64 request of each bit
    start = (torch.cumsum(sizes, 0) - sizes).to(device)
    local = torch.arange(total, device=device) - start[b]  # [total] int64
    kv_b, p_b = kv.to(device)[b], p.to(device)[b]
    i, col = local // kv_b, local % kv_b - p_b  # query row; column among the new keys
    visible = col < 0  # [total] bool: the prefix
    if custom_mask is not None:
        visible |= custom_mask[b, i, col.clamp(min=0)] & (col >= 0)
    return visible


def set_block_bits(packed: torch.Tensor, mask_indptr: torch.Tensor, prefix_lens: torch.Tensor,
                   custom_mask: torch.Tensor) -> None:
    """OR the new keys' block bits custom_mask [B, q, E] into `packed` (uint8), whose
    segments (byte offsets mask_indptr [B+1]) hold a placeholder full_mask with the block
    hidden. Fixed shapes, device tensors only: a CUDA graph captures it, so a mask computed
    inside the graph (draft decode's ancestor masks) reaches the attention kernel."""
    B, q, E = custom_mask.shape
    dev = custom_mask.device
    p = prefix_lens.clamp(min=0)  # [B] int64
    kv = (p + E)[:, None, None]  # [B, 1, 1]
    i = torch.arange(q, device=dev)[None, :, None]
    e = torch.arange(E, device=dev)[None, None, :]
    bit = mask_indptr[:B].to(torch.int64)[:, None, None] * 8 + i * kv + p[:, None, None] + e
    values = custom_mask.to(torch.uint8) << (bit % 8).to(torch.uint8)  # [B, q, E] uint8
    # The placeholder's block bits are 0 and each bit is added once, so add is OR.
    packed.scatter_add_(0, (bit // 8).reshape(-1), values.reshape(-1))
