"""The attention-backend interface every backend implements (docs/design.md, "Attention backends")."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from actors.worker.forward_batch import ForwardBatch
from actors.worker.kv_cache import ReqToTokenPool, TokenToKVPool


class AttentionBackend(ABC):
    # True when init_forward_metadata runs device ops only, so a CUDA graph can hold the
    # metadata build with the forward (and with the ops around it: the step graph).
    plans_on_device = False

    def __init__(self, kv_pool: TokenToKVPool, req_to_token: ReqToTokenPool, scale: float):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scale = scale

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build whatever the layers need for this batch (once per forward, not per layer)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        """Store k/v ([T, Hkv, D]) at fb.out_cache_loc, attend with q ([T, H, D]) -> [T, H, D]."""

    def paged_inputs(self, fb: ForwardBatch):
        """What a model's one-call forward over the paged cache reads (the CPU backend's
        PagedInputs), or None: the layers call forward() one by one."""
        return None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_lens value of padded graph lanes: 1 keeps every kernel's loop bounds valid."""
        return 1
