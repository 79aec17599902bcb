"""Triton attention backend: one plan-free paged kernel for every forward mode (docs/design.md, "Attention backends").

init_forward_metadata turns the ForwardBatch into a few small device tensors with torch
ops only. Host values come from shapes and fb.extend_lens (a host list), never from device
data (no .tolist()/.item()), so building metadata and running the forward can both be
captured in a CUDA graph; a replay then rebuilds the metadata from the graph's static
inputs. The kernel reads request b's keys as req_to_token[row_b, 0 : prefix_b + E_b]: every
caller writes the new keys' slots (out_cache_loc, draft scratch) at positions
prefix_b.. of the request's row before the forward (see kestrel_kernels/triton_attention.py).

A prefill chunk of at least `library_min_tokens` queries (attention.library_prefill_min_tokens)
is attended by cuDNN's fused attention instead (kestrel_kernels/library_attention.py), the
other requests of its batch by the Triton kernel; such a chunk never runs inside a graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actors.attention.base import AttentionBackend
from actors.worker.forward_batch import ForwardBatch
from actors.worker.host_copy import to_device
from kestrel_kernels.library_attention import chunk_attention, library_attention_supported
from kestrel_kernels.triton_attention import BASE_KV_SPLITS, paged_attention


@dataclass
class TritonMeta:
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    prefix_lens: torch.Tensor  # [B] int64, fully visible keys
    new_kv_lens: torch.Tensor  # [B] int64, E_b keys after the prefix
    qo_indptr: torch.Tensor  # [B+1] int64, query rows of each request
    max_q_len: int  # host: the largest q_b (launch grid)
    custom_mask: torch.Tensor | None  # [sum q_b*E_b] bool, per-request row-major blocks
    mask_indptr: torch.Tensor | None  # [B+1] int64, start of each request's block


@dataclass
class LibraryMeta:
    """A batch with long prefill chunks: those by cuDNN, the other requests by the kernel."""
    chunks: list[tuple[int, int, int, torch.Tensor]]  # (first query row, queries, prefix, slots [P+C] int64)
    rest: TritonMeta | None  # the other requests, or None
    rest_rows: torch.Tensor | None  # [T_rest] int64, their query rows


class TritonBackend(AttentionBackend):
    plans_on_device = True

    def __init__(self, kv_pool, req_to_token, scale: float, num_kv_splits: int | None = None,
                 max_kv_splits: int = BASE_KV_SPLITS, library_min_tokens: int = 0):
        super().__init__(kv_pool, req_to_token, scale)
        self.num_kv_splits = num_kv_splits  # None: pick from the launch shape
        self.max_kv_splits = max_kv_splits  # attention.max_kv_splits
        self.library_min_tokens = library_min_tokens  # attention.library_prefill_min_tokens
        if library_min_tokens:
            k = kv_pool.k[0]
            why = "an FP8 KV cache is read by the Triton kernel alone" if kv_pool.quantized else \
                library_attention_supported(k.dtype, k.shape[1], k.shape[1], k.shape[2], k.device)
            if why:
                raise ValueError(f"attention.library_prefill_min_tokens={library_min_tokens} cannot "
                                 f"run here: {why}; set it to 0")

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        dev = fb.req_pool_indices.device
        B = fb.batch_size
        qlens = list(fb.extend_lens)
        uniform = len(set(qlens)) <= 1  # every graph-captured mode (decode/verify/draft)
        n = qlens[0] if qlens else 0
        if uniform:
            # arange/full are device kernels: no host-to-device copy, capture-safe.
            qo_indptr = torch.arange(B + 1, dtype=torch.int64, device=dev) * n  # [B+1] int64
        else:  # ragged prefill chunks: eager only (host list -> device copy)
            qo_indptr = to_device(np.cumsum([0] + qlens), torch.int64, dev)  # [B+1] int64
        if fb.new_kv_slots is not None:
            E = int(fb.new_kv_slots.shape[1])  # a shape: host int
            new_kv_lens = torch.full((B,), E, dtype=torch.int64, device=dev)  # [B] int64
            elist = [E] * B
        else:  # the new keys are the tokens this forward writes
            new_kv_lens = qo_indptr[1:] - qo_indptr[:-1]  # [B] int64
            elist = qlens
        custom_mask = mask_indptr = None
        if fb.custom_mask is not None:
            cm = fb.custom_mask  # [Bm, Qm, Em] bool, Bm <= B
            Bm = cm.shape[0]
            if uniform and tuple(cm.shape) == (B, n, elist[0] if B else 0):
                custom_mask = cm.reshape(-1)  # [B*n*E] bool, a view when contiguous
                mask_indptr = torch.arange(B + 1, dtype=torch.int64, device=dev) * (n * cm.shape[2])
            elif Bm < B and len(set(qlens[:Bm])) == 1 and tuple(cm.shape[1:]) == (qlens[0], elist[0]):
                # A mixed step: Bm uniform verify trees, then causal chunks (empty blocks).
                block = cm.shape[1] * cm.shape[2]
                custom_mask = cm.reshape(-1)  # [Bm*q*E] bool
                mask_indptr = torch.arange(B + 1, dtype=torch.int64, device=dev).clamp(max=Bm) * block  # [B+1] int64
            else:  # wider mask than the batch needs, or ragged: cut each request's block
                custom_mask = torch.cat([cm[b, :qlens[b], :elist[b]].reshape(-1)
                                         for b in range(Bm)])  # [sum q_b*E_b] bool
                sizes = [q * e for q, e in zip(qlens[:Bm], elist[:Bm])] + [0] * (B - Bm)
                mask_indptr = to_device(np.cumsum([0] + sizes), torch.int64, dev)  # [B+1] int64
        fb.attn_meta = TritonMeta(fb.req_pool_indices, fb.prefix_lens, new_kv_lens, qo_indptr,
                                  max(qlens) if qlens else 0, custom_mask, mask_indptr)
        if (self.library_min_tokens and custom_mask is None and fb.new_kv_slots is None
                and qlens and max(qlens) >= self.library_min_tokens
                and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            fb.attn_meta = self._library_meta(fb, fb.attn_meta, qlens)

    def _library_meta(self, fb: ForwardBatch, full: TritonMeta, qlens: list[int]) -> LibraryMeta:
        """Split the batch: each chunk of library_min_tokens queries or more, by cuDNN; the
        rest as one kernel launch. Reads the prefix lengths to the host (one sync a forward,
        in an eager prefill of thousands of tokens)."""
        dev = fb.req_pool_indices.device
        prefix = fb.prefix_lens.tolist()
        rows = fb.req_pool_indices.tolist()
        starts = np.cumsum([0] + qlens)
        long = [b for b, n in enumerate(qlens) if n >= self.library_min_tokens]
        chunks = [(int(starts[b]), qlens[b], int(prefix[b]),
                   self.req_to_token.req_to_token[rows[b], :prefix[b] + qlens[b]]) for b in long]
        rest = [b for b in range(len(qlens)) if b not in long]
        if not rest:
            return LibraryMeta(chunks, None, None)
        pick = to_device(rest, torch.int64, dev)  # [B_rest] int64
        rest_qlens = [qlens[b] for b in rest]
        rest_rows = to_device(np.concatenate([np.arange(starts[b], starts[b + 1]) for b in rest]),
                              torch.int64, dev)  # [T_rest] int64
        qo_indptr = to_device(np.cumsum([0] + rest_qlens), torch.int64, dev)  # [B_rest+1] int64
        sub = TritonMeta(full.req_pool_indices[pick], full.prefix_lens[pick], full.new_kv_lens[pick],
                         qo_indptr, max(rest_qlens), None, None)
        return LibraryMeta(chunks, sub, rest_rows)

    def forward(self, q, k, v, layer, fb):
        m = fb.attn_meta
        self.kv_pool.store(layer, fb.out_cache_loc, k, v)
        if isinstance(m, LibraryMeta):
            return self._forward_library(q, layer, m)
        return self._kernel(q, layer, m)

    def _kernel(self, q: torch.Tensor, layer: int, m: TritonMeta) -> torch.Tensor:
        return paged_attention(
            q, self.kv_pool.k[layer], self.kv_pool.v[layer], self.req_to_token.req_to_token,
            m.req_pool_indices, m.prefix_lens, m.new_kv_lens, m.qo_indptr, m.max_q_len,
            custom_mask=m.custom_mask, mask_indptr=m.mask_indptr, causal=True,
            scale=self.scale, num_kv_splits=self.num_kv_splits,
            max_kv_splits=self.max_kv_splits, k_scale=self.kv_pool.k_scale[layer],
            v_scale=self.kv_pool.v_scale[layer])  # [T, H, D]

    def _forward_library(self, q: torch.Tensor, layer: int, m: LibraryMeta) -> torch.Tensor:
        out = torch.empty_like(q)  # [T, H, D]
        k_cache, v_cache = self.kv_pool.k[layer], self.kv_pool.v[layer]
        for start, n, prefix, slots in m.chunks:
            out[start:start + n] = chunk_attention(q[start:start + n].contiguous(), k_cache, v_cache,
                                                   slots, prefix, self.scale)
        if m.rest is not None:
            out[m.rest_rows] = self._kernel(q[m.rest_rows], layer, m.rest)
        return out

    # ---- CUDA-graph hooks (actors/cuda_graph_runner.GraphBackend) -------------------------
    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens,
                                                seq_lens_sum, seq_lens_cpu, extend_lens=None,
                                                **kwargs: Any) -> None:
        """Nothing to plan: a captured forward rebuilds its metadata from the static inputs
        on every replay (init_forward_metadata runs inside the graph)."""
