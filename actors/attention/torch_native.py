"""Reference attention: paged gather + SDPA with an explicit mask. CPU path and oracle; with
cpu_kernel, decode and verify forwards run the batch-invariant CPU kernel on the same
metadata (kestrel_kernels/cpu_attention.py; prefill keeps SDPA, blocked for long queries)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from actors.attention.base import AttentionBackend
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from kestrel_kernels.cpu_attention import paged_attention


@dataclass
class _Meta:
    kv_index: torch.Tensor  # [B, L] int64 slots (0 where padded)
    mask: torch.Tensor  # [B, 1, Q, L] bool
    q_batch: torch.Tensor  # [T] int64 request of each query token
    q_slot: torch.Tensor  # [T] int64 row of each query token inside its request
    max_q: int


class PagedInputs(NamedTuple):
    """A decode or verify forward's attention inputs for cpu_decoder.cpp, which stores the
    new K/V and runs the CPU kernel (paged_attention) itself."""
    k_all: torch.Tensor  # [L, slots, Hkv, D] float32
    v_all: torch.Tensor  # [L, slots, Hkv, D] float32
    loc: torch.Tensor  # [T] int64 the new tokens' slots
    kv_index: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, 1, Q, L] bool
    q_batch: torch.Tensor  # [T] int64
    q_slot: torch.Tensor  # [T] int64
    scale: float


class TorchNativeBackend(AttentionBackend):
    def __init__(self, kv_pool, req_to_token, scale: float, cpu_kernel: bool = False):
        super().__init__(kv_pool, req_to_token, scale)
        # The kernel reads float32 caches in place (model.cpu_weights=packed's).
        self.cpu_kernel = cpu_kernel and not kv_pool.quantized and kv_pool.k[0].dtype == torch.float32

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        dev = fb.input_ids.device
        B = fb.batch_size
        prefix = fb.prefix_lens.tolist()
        qlens = fb.extend_lens
        if fb.new_kv_slots is not None:
            new_slots = [fb.new_kv_slots[b] for b in range(B)]
        else:
            new_slots = list(torch.split(fb.out_cache_loc, qlens))
        kv_lens = [p + s.numel() for p, s in zip(prefix, new_slots)]
        L, Q = max(kv_lens), max(qlens)
        kv_index = torch.zeros(B, L, dtype=torch.int64, device=dev)  # [B, L] int64
        mask = torch.zeros(B, Q, L, dtype=torch.bool, device=dev)  # [B, Q, L] bool
        table = self.req_to_token.req_to_token
        rows = fb.req_pool_indices.tolist()
        for b in range(B):
            p, e, q = prefix[b], new_slots[b].numel(), qlens[b]
            kv_index[b, :p] = table[rows[b], :p]
            kv_index[b, p:p + e] = new_slots[b]
            mask[b, :q, :p] = True
            if fb.custom_mask is not None and b < fb.custom_mask.shape[0]:
                mask[b, :q, p:p + e] = fb.custom_mask[b, :q, :e]
            else:
                mask[b, :q, p:p + e] = torch.ones(q, e, dtype=torch.bool, device=dev).tril(e - q)
            mask[b, q:, 0] = True  # padded query rows see one key so softmax stays finite
        lens = torch.tensor(qlens, dtype=torch.int64, device=dev)
        q_batch = torch.repeat_interleave(torch.arange(B, device=dev), lens)  # [T] int64
        starts = torch.cumsum(lens, 0) - lens
        q_slot = torch.arange(int(lens.sum()), device=dev) - starts[q_batch]  # [T] int64
        fb.attn_meta = _Meta(kv_index, mask[:, None], q_batch, q_slot, Q)

    def paged_inputs(self, fb: ForwardBatch) -> PagedInputs | None:
        if not (self.cpu_kernel and fb.mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)):
            return None
        m: _Meta = fb.attn_meta
        return PagedInputs(self.kv_pool.k_all, self.kv_pool.v_all, fb.out_cache_loc, m.kv_index, m.mask,
                           m.q_batch, m.q_slot, self.scale)

    def forward(self, q, k, v, layer, fb):
        m: _Meta = fb.attn_meta
        self.kv_pool.store(layer, fb.out_cache_loc, k, v)
        if self.cpu_kernel and fb.mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            return paged_attention(q, self.kv_pool.k[layer], self.kv_pool.v[layer], m.kv_index, m.mask,
                                   m.q_batch, m.q_slot, self.scale)
        B, H, D = fb.batch_size, q.shape[1], q.shape[2]
        kc, vc = self.kv_pool.read(layer, m.kv_index, q.dtype)  # [B, L, Hkv, D] q.dtype each
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, Hkv, L, D]
        qp = q.new_zeros(B, m.max_q, H, D)  # [B, Q, H, D]
        qp[m.q_batch, m.q_slot] = q
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kc, vc,
                                           attn_mask=m.mask, scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2)[m.q_batch, m.q_slot]  # [T, H, D]
