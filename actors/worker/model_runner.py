"""ModelRunner: one model bound to its attention backend; ForwardBatch in, hidden out."""
from __future__ import annotations

import torch

from actors.attention.base import AttentionBackend
from actors.worker.forward_batch import ForwardBatch


class BoundAttention:
    """The attention a model's layers call during one forward, attn(q, k, v, layer), bound
    to the backend and the batch; paged(): the backend's paged-cache inputs for a model that
    runs the whole forward as one kernel call, or None where the backend has none for it."""
    __slots__ = ("backend", "fb")

    def __init__(self, backend: AttentionBackend, fb: ForwardBatch):
        self.backend, self.fb = backend, fb

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self.backend.forward(q, k, v, layer, self.fb)

    def paged(self):
        return self.backend.paged_inputs(self.fb)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend):
        self.model = model
        self.backend = backend

    def forward(self, fb: ForwardBatch, **kwargs):
        """Metadata once per forward, then the model; layers call back into the backend."""
        self.backend.init_forward_metadata(fb)
        return self.model.forward(fb.input_ids, fb.positions, BoundAttention(self.backend, fb), **kwargs)
