"""Paged KV cache: slot allocator, request-row allocator, and the per-rank tensors.

A *slot* holds the K and V of one token in every layer. Slots come in pages of
`page_size` consecutive slots; page 0 is reserved, so slot 0 is a safe padding target
for padded CUDA-graph lanes. The scheduler (CPU) owns the allocators; the rank worker owns
the tensors (`ReqToTokenPool` maps request row -> slot per position, `TokenToKVPool`
holds per-layer K/V buffers, in the model's dtype or FP8: kv_cache.dtype). Draft and
target have separate KV pools that share slot indices.
"""
from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from actors.worker.host_copy import to_device
from configs.schema import MAX_STEPS_IN_FLIGHT
from kestrel_kernels import layer_ops
from kestrel_kernels.fp8_format import FP8
from kestrel_kernels.kv_fp8 import dequantize_kv, gather_fp8, quantize_kv, scatter_fp8


def kv_ahead(window: int) -> int:
    """KV slots the scheduler reserves beyond a request's committed length: a window (the
    most one step writes) for each step in flight, since it learns lengths a step late."""
    return MAX_STEPS_IN_FLIGHT * window


def max_request_slots(max_model_len: int, window: int, page_size: int) -> int:
    """The most KV one request can hold, its req_to_token row's length: fewer than
    max_model_len committed tokens, `kv_ahead` more, rounded up to a page."""
    return max_model_len + kv_ahead(window) + page_size


class SlotAllocator:
    """Free list of KV pages. All counts are in slots (tokens), multiples of page_size."""

    def __init__(self, num_slots: int, page_size: int = 1):
        if num_slots < 2 * page_size:
            raise ValueError(f"num_slots={num_slots} too small for page_size={page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        # page 0 is reserved (padding target); a stack keeps reuse cache-friendly.
        self._free_pages: list[int] = list(range(self.num_pages - 1, 0, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def capacity(self) -> int:
        """Slots that can ever be handed out (all but the reserved page)."""
        return (self.num_pages - 1) * self.page_size

    def round_up(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def alloc(self, num_slots: int) -> torch.Tensor | None:
        """`num_slots` (a multiple of page_size) slots, page-contiguous; None if not enough."""
        pages = self.take_pages(num_slots)
        return None if pages is None else self.slots_of([pages])[0]

    def take_pages(self, num_slots: int) -> list[int] | None:
        """The pages of `alloc(num_slots)`, off the free list; None if not enough. With
        `slots_of`, a decode step that grows hundreds of rows builds one tensor, not one
        per row."""
        if num_slots % self.page_size:
            raise ValueError(f"alloc({num_slots}) is not a multiple of page_size={self.page_size}")
        n_pages = num_slots // self.page_size
        if n_pages > len(self._free_pages):
            return None
        if n_pages == 0:
            return []
        pages = self._free_pages[:-n_pages - 1:-1]  # what n_pages pop()s would give
        del self._free_pages[-n_pages:]
        return pages

    def slots_of(self, page_lists: list[list[int]]) -> list[torch.Tensor]:
        """The slots of each list of pages: [len(pages) * page_size] int64 each."""
        ps = self.page_size
        page_t = torch.tensor([p for pages in page_lists for p in pages], dtype=torch.int64)
        if ps > 1:
            offs = torch.arange(ps, dtype=torch.int64)
            page_t = (page_t[:, None] * ps + offs[None, :]).reshape(-1)
        if len(page_lists) == 1:
            return [page_t]
        return list(torch.split(page_t, [len(pages) * ps for pages in page_lists]))

    def free(self, slots: torch.Tensor) -> None:
        """Free whole pages given by their slots (every slot of each page must be passed)."""
        if slots.numel() == 0:
            return
        if slots.numel() % self.page_size:
            raise ValueError("free() takes whole pages")
        pages = (slots.reshape(-1, self.page_size)[:, 0] // self.page_size).tolist()
        if 0 in pages:
            raise ValueError("page 0 is reserved and never freed")
        self._free_pages.extend(pages)


class RowAllocator:
    """Rows of the req_to_token table. Row 0 is reserved for padded graph lanes."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, 0, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if row == 0:
            raise ValueError("row 0 is reserved")
        self._free.append(row)


class ReqToTokenPool:
    """req_to_token[row, pos] = KV slot of token `pos` of the request in `row`."""

    def __init__(self, num_rows: int, max_context_len: int, device: str | torch.device):
        self.req_to_token = torch.zeros(num_rows, max_context_len, dtype=torch.int64,
                                        device=device)  # [rows, max_len] int64

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start:start + slots.numel()] = to_device(slots, torch.int64,
                                                                        self.req_to_token.device)

    def write_many(self, writes: list[tuple[int, int, np.ndarray]]) -> None:
        """Several (row, first position, slots) writes, in order, as one host-to-device
        copy and one scatter: at batch 64 a step grows about a dozen rows, and one small
        copy and store each cost more than the whole batch at once."""
        if len(writes) == 1:
            row, start, slots = writes[0]
            self.write(row, start, torch.from_numpy(np.ascontiguousarray(slots)))
            return
        rows = np.concatenate([np.full(len(s), r, dtype=np.int64) for r, _, s in writes])
        pos = np.concatenate([np.arange(p, p + len(s), dtype=np.int64) for _, p, s in writes])
        flat = rows * self.req_to_token.shape[1] + pos
        if len(np.unique(flat)) != len(flat):  # a later write must win: keep the order
            for row, start, slots in writes:
                self.write(row, start, torch.from_numpy(np.ascontiguousarray(slots)))
            return
        vals = np.concatenate([s for _, _, s in writes]).astype(np.int64, copy=False)
        packed = to_device(np.stack([flat, vals]), torch.int64, self.req_to_token.device)  # [2, n] int64
        self.req_to_token.view(-1)[packed[0]] = packed[1]


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pools' dtype for kv_cache.dtype: the model's (auto), or E4M3 (fp8_e4m3)."""
    return FP8 if setting == "fp8_e4m3" else model_dtype


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """An all-zero buffer. On the CPU, anonymous memory that the OS zeroes a page at a time
    on first touch: start-up writes none of the pool (1.5 GB at the CPU preset's float32
    cache), and resident memory grows with the slots serving uses."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    buf = mmap.mmap(-1, max(1, n * dtype.itemsize))
    return torch.frombuffer(buf, dtype=dtype, count=n).view(shape)


class TokenToKVPool:
    """Per-layer K and V buffers: k[layer] is [num_slots, num_kv_heads, head_dim].

    Each is a view of one [num_layers, num_slots, ...] tensor, so moving accepted tokens
    touches every layer in one gather and one scatter rather than two per layer (a
    30-layer target: 4 kernels instead of 120 per speculative iteration).

    With dtype float8_e4m3fn the buffers hold K and V quantized (kestrel_kernels/kv_fp8.py)
    and k_scale[layer] / v_scale[layer] are each layer's [1] fp32 scales, which readers
    multiply back; otherwise values are stored as given and the scales are None.
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.quantized = dtype == FP8
        store = torch.uint8 if self.quantized else dtype  # zero bytes are FP8's +0.0
        self.k_all = zeroed_pool(shape, store, device).view(dtype)  # [L, slots, Hkv, D] dtype
        self.v_all = zeroed_pool(shape, store, device).view(dtype)  # [L, slots, Hkv, D] dtype
        # Views, one per layer (indexing, not unbind: unbind's views refuse in-place writes
        # outside no_grad/inference mode).
        self.k = [self.k_all[i] for i in range(num_layers)]  # k[layer]: [slots, Hkv, D]
        self.v = [self.v_all[i] for i in range(num_layers)]
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * num_layers
        if self.quantized:
            # 1.0 until calibrated; tensors, not floats, so kernels and captured graphs read
            # whatever they hold at run time.
            self.k_scale_all = torch.ones(num_layers, dtype=torch.float32, device=device)  # [L] fp32
            self.v_scale_all = torch.ones(num_layers, dtype=torch.float32, device=device)  # [L] fp32
            self.k_scale = [self.k_scale_all[i:i + 1] for i in range(num_layers)]  # [1] fp32 each
            self.v_scale = [self.v_scale_all[i:i + 1] for i in range(num_layers)]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([T, Hkv, D]) at slots `loc` ([T] int64)."""
        if self.quantized:
            scatter_fp8(self.k[layer], loc, quantize_kv(k, self.k_scale[layer]))
            scatter_fp8(self.v[layer], loc, quantize_kv(v, self.v_scale[layer]))
            return
        layer_ops.store_kv(self.k[layer], self.v[layer], loc, k, v)  # one launch on CUDA

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (integer, any shape S) in `dtype`, dequantized: [*S, Hkv, D] each."""
        if self.quantized:
            return (dequantize_kv(gather_fp8(self.k[layer], slots), self.k_scale[layer], dtype),
                    dequantize_kv(gather_fp8(self.v[layer], slots), self.v_scale[layer], dtype))
        return self.k[layer][slots].to(dtype), self.v[layer][slots].to(dtype)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots `src` to slots `dst` (accepted tree nodes);
        every source is read before any destination is written. Slots move as bytes, in
        any dtype (FP8 has no index kernels everywhere; a layer's scale is every slot's)."""
        for buf in (self.k_all.view(torch.uint8), self.v_all.view(torch.uint8)):  # [L, slots, Hkv, D * itemsize]
            buf[:, dst] = buf[:, src]
