"""The plan stream: attention-metadata preparation beside the compute stream (docs/design.md, "The plan stream").

With the plan stream on, one preparation is ordered as (C17)

    compute: event.record          (after the inputs the preparation reads were written)
    plan:    wait_event(event)
    plan:    the preparation       (metadata, new input tensors)
    compute: wait_stream(plan)     (before any compute kernel uses what it made)

and the caching allocator is kept honest with ``record_stream`` (C16): before the
preparation rebinds batch tensors, every CUDA tensor a queued compute kernel may still
read is recorded on the compute stream (else dropping the batch's last reference would
let the plan stream reuse its memory under that kernel), and tensors the preparation
allocates on the plan stream are recorded on the compute stream that uses them.
With it off the preparation runs inline on the compute stream and no stream call is made.

Streams and events come from injectable factories, so CPU tests run the same code over
recording fakes; on CUDA they default to ``torch.cuda`` streams and events.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from actors.dp.sync import stream_ctx

__all__ = [
    "PlanStream",
    "VerifyInputs",
    "verify_reads",
    "draft_extend_reads",
    "prepare_verify_inputs",
    "prepare_draft_extend_inputs",
]


def _tensors(obj: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Tensors inside a preparation result: tensors, sequences, mappings, dataclasses."""
    seen = set() if seen is None else seen
    if obj is None or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o, seen)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), seen)


def _on_device(t: Any) -> bool:
    # Only CUDA memory goes through the caching allocator's per-stream reuse.
    return isinstance(t, torch.Tensor) and t.is_cuda


class PlanStream:
    """Runs preparations on a side stream (enabled) or inline (disabled)."""

    def __init__(self, enabled: bool, device: torch.device | str | None = None, *,
                 compute_stream: Any = None,
                 stream_factory: Callable[[torch.device], Any] | None = None,
                 event_factory: Callable[[], Any] | None = None):
        self.enabled = bool(enabled)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self._compute = compute_stream
        self.stream: Any = None
        self._event: Any = None
        if not self.enabled:
            return
        fakes = stream_factory is not None and event_factory is not None
        if not fakes and self.device.type != "cuda":
            raise ValueError("the plan stream needs a CUDA device (or injected stream/event factories)")
        make_stream = stream_factory or (lambda d: torch.cuda.Stream(d))
        self.stream = make_stream(self.device)
        # One event, re-recorded each time: a wait uses the latest record at the time it is queued.
        self._event = (event_factory or torch.cuda.Event)()

    def compute_stream(self) -> Any:
        """The stream forwards run on: the injected one, else CUDA's current stream."""
        if self._compute is not None:
            return self._compute
        return torch.cuda.current_stream(self.device)

    def protect(self, tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
        """C16: record CUDA tensors a queued compute kernel may still read on the compute
        stream, before a preparation drops references to them. CPU tensors and None are
        skipped; disabled: nothing to protect (one stream orders everything)."""
        if not self.enabled:
            return []
        compute = self.compute_stream()
        done, seen = [], set()
        for t in tensors:
            if not _on_device(t) or id(t) in seen:
                continue
            seen.add(id(t))
            t.record_stream(compute)
            done.append(t)
        return done

    def prepare(self, fn: Callable[[], Any], *, inputs_written_on: Any = None) -> Any:
        """Run ``fn`` (a preparation) ordered against the compute stream; returns its result.

        ``inputs_written_on``: the stream that wrote what ``fn`` reads (default: compute).
        CUDA tensors in the result were made on the plan stream for the compute stream,
        so they are recorded on it.
        """
        if not self.enabled:
            return fn()
        compute = self.compute_stream()
        writer = compute if inputs_written_on is None else inputs_written_on
        self._event.record(writer)
        self.stream.wait_event(self._event)
        try:
            with stream_ctx(self.stream):
                out = fn()
        finally:
            compute.wait_stream(self.stream)  # also on failure: no plan work left unordered
        for t in _tensors(out):
            if _on_device(t):
                t.record_stream(compute)
        return out


# ----------------------------------------------------------------------------- steps
@dataclass
class VerifyInputs:
    """What draft decode and tree building left on the compute stream for verify."""

    draft_tokens: torch.Tensor  # [B*N] int64, node tokens (root = last verified token)
    tree_mask: torch.Tensor  # [B, N, N] bool
    positions: torch.Tensor  # [B*N] int64, seq_len + depth
    retrieve_index: torch.Tensor  # [B, N] int64
    retrieve_next_token: torch.Tensor  # [B, N] int64, first child
    retrieve_next_sibling: torch.Tensor  # [B, N] int64


def verify_reads(batch: Any, verify: VerifyInputs) -> list[torch.Tensor | None]:
    """C16: what queued forward kernels may still read when verify preparation starts."""
    return [batch.seq_lens, batch.req_pool_indices, batch.input_ids, batch.out_cache_loc,
            verify.draft_tokens, verify.tree_mask, verify.positions, verify.retrieve_index,
            verify.retrieve_next_token, verify.retrieve_next_sibling]


def draft_extend_reads(batch: Any) -> list[torch.Tensor | None]:
    """What queued forward kernels may still read when draft-extend preparation starts."""
    return [batch.seq_lens, batch.req_pool_indices, batch.input_ids, batch.out_cache_loc,
            batch.positions, getattr(batch, "accept_lens", None), getattr(batch, "hidden", None)]


def _prepare_and_rebind(plan: PlanStream, batch: Any, reads: list, build: Callable[[], dict],
                        inputs_written_on: Any) -> dict:
    plan.protect(reads)  # before any reference to them is dropped
    new = plan.prepare(build, inputs_written_on=inputs_written_on)
    for name, value in new.items():  # rebinding only after the compute stream waits
        setattr(batch, name, value)
    return new


def prepare_verify_inputs(plan: PlanStream, batch: Any, verify: VerifyInputs,
                          build: Callable[[], dict], *, inputs_written_on: Any = None) -> dict:
    """Verify preparation (C16/C17): ``build()`` runs on the plan stream and returns the
    batch fields it made (e.g. ``input_ids``, ``out_cache_loc``); they replace the batch's."""
    return _prepare_and_rebind(plan, batch, verify_reads(batch, verify), build, inputs_written_on)


def prepare_draft_extend_inputs(plan: PlanStream, batch: Any, build: Callable[[], dict], *,
                                inputs_written_on: Any = None) -> dict:
    """Draft-extend preparation, the same order as verify (C17). The ids it reads must
    already be int64 from the compute stream (C01, ``actors.dp.sync.draft_extend_ids``)."""
    return _prepare_and_rebind(plan, batch, draft_extend_reads(batch), build, inputs_written_on)
