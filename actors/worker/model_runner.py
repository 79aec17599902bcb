"""ModelRunner: one model bound to its attention backend; ForwardBatch in, hidden out."""
from __future__ import annotations

import torch

from actors.attention.base import AttentionBackend
from actors.worker.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend):
        self.model = model
        self.backend = backend

    def forward(self, fb: ForwardBatch, **kwargs):
        """Metadata once per forward, then the model; layers call back into the backend."""
        self.backend.init_forward_metadata(fb)

        def attn(q, k, v, layer):
            return self.backend.forward(q, k, v, layer, fb)

        return self.model.forward(fb.input_ids, fb.positions, attn, **kwargs)
