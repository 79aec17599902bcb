"""FlashInfer attention backend: paged wrappers with host-side plan() (docs/design.md, "Attention backends").

One layout for every mode (actors/worker/forward_batch.py): request b attends to its prefix in
full and to its new keys causally or through custom_mask. Decode (one query, the new key
being the written token) runs BatchDecodeWithPagedKVCacheWrapper; everything else (extend,
target verify's tree mask, draft extend, draft decode's ancestor masks over the scratch
slots) runs BatchPrefillWithPagedKVCacheWrapper on FA2, causal or with the full-rectangle
custom mask (actors/attention/flashinfer_metadata.py).

plan() needs the lengths on the host and cannot run inside a CUDA graph, so graphs work
SGLang's way: each captured forward gets graph-mode wrappers over buffers of fixed
addresses, one per attention shape it runs (a draft-decode graph runs S-1 shapes), made
and planned while the runner warms up; the capture binds them; each replay re-plans them
from the padded host lengths (C04/C07/C08) before the graph runs. A mask the graph itself
computes is written into the wrapper's mask buffer by the captured forward
(flashinfer_metadata.set_block_bits). flashinfer is imported lazily: this module loads
without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from actors.attention.base import AttentionBackend
from actors.attention.flashinfer_metadata import full_mask, page_table, set_block_bits
from actors.worker.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k scratch, shared by all wrappers


def import_flashinfer(device: torch.device):
    """The flashinfer module, or an error that names the setting and the alternatives."""
    hint = "set attention.backend=triton or attention.backend=torch_native"
    if device.type != "cuda":
        raise RuntimeError(f"attention.backend=flashinfer needs a CUDA device, got {device}; {hint}")
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError(f"attention.backend=flashinfer needs the flashinfer-python package "
                           f"({e}); install it or {hint}") from e
    return flashinfer


@dataclass
class _Shape:
    """What plan() needs besides lengths: one attention call shape of a forward."""
    q: int | None  # queries per request; None = ragged (eager only)
    new: int | None  # new keys per request (E); None = the ragged q's
    masked: bool

    @property
    def decode(self) -> bool:
        return self.q == 1 and self.new == 1 and not self.masked


@dataclass
class _GraphStep:
    """A graph-mode wrapper for one shape of one captured forward, and its fixed buffers."""
    shape: _Shape
    wrapper: Any
    mask_buf: torch.Tensor | None
    mask_indptr: torch.Tensor | None
    heads: tuple[int, torch.dtype] | None = None  # (num_qo_heads, q dtype), seen at warm-up


@dataclass
class _Meta:
    wrapper: Any
    plan: Any  # pending plan(num_qo_heads, q_dtype) -> None; None once planned
    block: tuple | None = None  # graph step with a mask: (step, prefix_lens, custom_mask)
    fresh: bool = True  # plan (and mask bits) still to do, at the first layer


class FlashInferBackend(AttentionBackend):
    def __init__(self, kv_pool, req_to_token, scale: float, page_size: int = 1):
        super().__init__(kv_pool, req_to_token, scale)
        self.device = req_to_token.req_to_token.device
        self.fi = import_flashinfer(self.device)
        self.page_size = page_size
        _, self.num_kv_heads, self.head_dim = kv_pool.k[0].shape
        self.num_pages = kv_pool.k[0].shape[0] // page_size
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Tensor-core decode runs FA2's kernels: any GQA group size (SmolLM2 has 3), and
        # the module JIT-compiled for extend serves decode as well.
        self._decode = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True)
        self._prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self._pending: tuple | None = None  # (kind, bs, static req_pool_indices) being captured
        self._graphs: dict[tuple, dict[tuple, _GraphStep]] = {}  # (kind, bs) -> shape -> step

    # ---- eager and warm-up ---------------------------------------------------------------
    def _shape(self, fb: ForwardBatch) -> _Shape:
        qlens = list(fb.extend_lens)
        uniform = len(set(qlens)) == 1
        new = int(fb.new_kv_slots.shape[1]) if fb.new_kv_slots is not None else None
        if new is None and uniform:
            new = qlens[0]
        return _Shape(qlens[0] if uniform else None, new, fb.custom_mask is not None)

    def _kv_lens(self, prefix: torch.Tensor, shape: _Shape, qlens: list[int]) -> torch.Tensor:
        new = torch.tensor(qlens, dtype=torch.int64) if shape.new is None else shape.new
        return prefix + new  # [B] int64 host

    def _plan_fn(self, wrapper, shape: _Shape, rows, prefix: torch.Tensor, qlens: list[int],
                 custom_mask: torch.Tensor | None):
        """Build this forward's page table and mask now; plan once the heads are known."""
        kv_indptr, kv_indices, last = page_table(self.req_to_token.req_to_token, rows,
                                                 self._kv_lens(prefix, shape, qlens), self.page_size)
        if shape.decode:
            def plan(heads: int, dtype: torch.dtype) -> None:
                wrapper.plan(kv_indptr, kv_indices, last, heads, self.num_kv_heads, self.head_dim,
                             self.page_size, q_data_type=dtype, kv_data_type=self.kv_pool.k[0].dtype,
                             sm_scale=self.scale)
            return plan
        qo_indptr = torch.zeros(len(qlens) + 1, dtype=torch.int32)  # [B+1] int32 host
        qo_indptr[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
        mask = None
        if shape.masked:
            new = [shape.new] * len(qlens) if shape.new is not None else qlens
            mask = full_mask(prefix, qlens, new, custom_mask, self.device)
            # plan() packs the mask (byte-aligned segments, their offsets into mask_indptr)
            # with flashinfer.segment_packbits, which wants its indptrs on the mask's device.
            qo_indptr, kv_indptr, last = (t.to(self.device) for t in (qo_indptr, kv_indptr, last))

        def plan(heads: int, dtype: torch.dtype) -> None:
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, heads, self.num_kv_heads,
                         self.head_dim, self.page_size, custom_mask=mask, causal=mask is None,
                         sm_scale=self.scale, q_data_type=dtype, kv_data_type=self.kv_pool.k[0].dtype)
        return plan

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        shape, rows, qlens = self._shape(fb), fb.req_pool_indices, list(fb.extend_lens)
        step = self._graph_step(fb, shape)
        if step is None:
            wrapper = self._decode if shape.decode else self._prefill
            prefix = fb.prefix_lens.cpu()  # [B] int64 host: plan() schedules on the host
            fb.attn_meta = _Meta(wrapper, self._plan_fn(wrapper, shape, rows, prefix, qlens,
                                                        fb.custom_mask))
            return
        # A graph's forward. Its mask (if any) is set by the forward itself, after a plan
        # with the block hidden, exactly as in a replay, where it may come from the graph.
        block = (step, fb.prefix_lens, fb.custom_mask) if shape.masked else None
        plan = None
        if not torch.cuda.is_current_stream_capturing():  # warm-up: plan as a replay would
            prefix = fb.prefix_lens.cpu().clamp(min=0)
            plan = partial(self._plan_step, step,
                           self._plan_fn(step.wrapper, shape, rows, prefix, qlens, None))
        fb.attn_meta = _Meta(step.wrapper, plan, block)  # capture: planned already, bind only

    @staticmethod
    def _plan_step(step: _GraphStep, plan, heads: int, dtype: torch.dtype) -> None:
        step.heads = (heads, dtype)  # what replays plan with (no q in a replay hook)
        plan(heads, dtype)

    def forward(self, q, k, v, layer, fb):
        m: _Meta = fb.attn_meta
        self.kv_pool.store(layer, fb.out_cache_loc, k, v)
        if m.fresh:  # once per forward, at its first layer (the heads come with q)
            if m.plan is not None:
                m.plan(q.shape[1], q.dtype)
            if m.block is not None:
                step, prefix, custom = m.block
                set_block_bits(step.mask_buf, step.mask_indptr, prefix, custom)
            m.fresh = False
        P = self.page_size
        kc = self.kv_pool.k[layer][:self.num_pages * P].view(-1, P, self.num_kv_heads, self.head_dim)
        vc = self.kv_pool.v[layer][:self.num_pages * P].view(-1, P, self.num_kv_heads, self.head_dim)
        return m.wrapper.run(q, (kc, vc))  # [T, H, D]

    # ---- CUDA-graph hooks (actors/cuda_graph_runner.GraphBackend) -------------------------
    @staticmethod
    def _kind(kwargs: dict) -> tuple:
        spec = kwargs.get("spec")
        return kwargs.get("forward_mode"), getattr(spec, "topk_p", None) is not None

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, req_pool_indices,
                                                 seq_lens, extend_lens=None, **kwargs: Any) -> None:
        """The runner warms up and captures size `bs` next: forwards over this static
        req_pool_indices get graph-mode wrappers (made at warm-up, bound in capture)."""
        self._pending = (self._kind(kwargs), bs, req_pool_indices)
        self._graphs.setdefault((self._kind(kwargs), bs), {})

    def _graph_step(self, fb: ForwardBatch, shape: _Shape) -> _GraphStep | None:
        capturing = torch.cuda.is_current_stream_capturing()
        p = self._pending
        ours = (p is not None and fb.batch_size == p[1]
                and fb.req_pool_indices.data_ptr() == p[2].data_ptr())
        if not ours:
            if capturing:
                raise RuntimeError("a forward captured as a CUDA graph must read the runner's static "
                                   "req_pool_indices (plan() cannot run inside a capture)")
            return None
        if shape.q is None or shape.new is None:
            raise RuntimeError("graph forwards need the same query count for every request")
        steps = self._graphs[(p[0], p[1])]
        key = (shape.q, shape.new, shape.masked)
        if key not in steps:
            if capturing:
                raise RuntimeError(f"shape {key} ran in capture but not in the warm-up before it")
            # Plain tensors, though warm-up may run under inference_mode: replays re-plan
            # into these buffers from wherever the runner is called.
            with torch.inference_mode(False):
                steps[key] = self._new_step(p[1], shape)
        return steps[key]

    def _new_step(self, bs: int, shape: _Shape) -> _GraphStep:
        dev, i32 = self.device, torch.int32
        max_ctx = self.req_to_token.req_to_token.shape[1]  # no request holds more keys
        indptr = torch.zeros(bs + 1, dtype=i32, device=dev)
        indices = torch.zeros(bs * -(-max_ctx // self.page_size), dtype=i32, device=dev)
        last = torch.zeros(bs, dtype=i32, device=dev)
        if shape.decode:
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last)
            return _GraphStep(shape, w, None, None)
        mask_buf = mask_indptr = None
        if shape.masked:
            mask_buf = torch.zeros(bs * -(-shape.q * max_ctx // 8), dtype=torch.uint8, device=dev)
            mask_indptr = torch.zeros(bs + 1, dtype=i32, device=dev)
        w = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(bs + 1, dtype=i32, device=dev), paged_kv_indptr_buf=indptr,
            paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last,
            custom_mask_buf=mask_buf, mask_indptr_buf=mask_indptr, backend="fa2")
        return _GraphStep(shape, w, mask_buf, mask_indptr)

    @staticmethod
    def _replay_prefix(kind: tuple, seq_lens: torch.Tensor, new: int) -> torch.Tensor:
        """Prefix per lane from the runner's seq_lens, by the kind's convention: target
        decode counts the token being decoded, draft extend counts its N new tokens (C09),
        target verify and draft decode count the committed tokens only. Padded lanes
        (FILL) are clamped to an empty prefix."""
        mode, draft = kind
        counted = 1 if mode == ForwardMode.DECODE and not draft else 0
        if mode == ForwardMode.DRAFT_EXTEND:
            counted = new
        return (seq_lens - counted).clamp(min=0)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens,
                                                seq_lens_sum, seq_lens_cpu, extend_lens=None,
                                                **kwargs: Any) -> None:
        """Re-plan every wrapper of the graph of size `bs` for the padded batch."""
        kind = self._kind(kwargs)
        steps = self._graphs.get((kind, bs))
        if not steps:
            raise RuntimeError(f"no {kind[0]} graph of batch size {bs} was captured")
        seq = (seq_lens_cpu if seq_lens_cpu is not None else seq_lens.cpu()).to(torch.int64)
        if seq.numel() != bs or (seq_lens_sum is not None and int(seq.sum()) != int(seq_lens_sum)):
            raise ValueError(f"replay metadata of size {bs}: seq_lens {seq.tolist()} do not match "
                             f"seq_lens_sum {seq_lens_sum} (C04: the sum must be the padded one)")
        for step in steps.values():
            prefix = self._replay_prefix(kind, seq, step.shape.new)
            plan = self._plan_fn(step.wrapper, step.shape, req_pool_indices, prefix,
                                 [step.shape.q] * bs, None)
            plan(*step.heads)
