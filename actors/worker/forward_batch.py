"""The per-forward batch: what one model forward reads, derived by worker code.

The scheduler's lengths (seq_lens, kv_committed_len, kv_allocated_len) never live here;
a ForwardBatch is built fresh for each forward and may be padded or changed freely.

Attention layout, the same for every mode: request b attends to
  * its first `prefix_lens[b]` tokens through req_to_token (fully visible), then
  * `new_kv_slots[b]` (default: the slots this forward writes, `out_cache_loc`),
    visible through `custom_mask[b]` (default, and past the mask's requests: causal
    among the new tokens).
Extend, decode, target verify (tree mask), draft extend and draft decode (ancestor mask
over the draft scratch slots) are all this one shape.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from actors.worker.host_copy import to_device


class ForwardMode(enum.IntEnum):
    """What a forward computes; the DP sync row carries it as an int64 (C03)."""

    IDLE = 0
    DECODE = 1
    EXTEND = 2
    TARGET_VERIFY = 3
    DRAFT_EXTEND = 4


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, requests concatenated
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token is written to
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    prefix_lens: torch.Tensor  # [B] int64, cached tokens each request attends to in full
    extend_lens: list[int]  # queries per request (sum = T)
    # Keys beyond the prefix: [B, E] int64 slots; None = out_cache_loc reshaped per request.
    new_kv_slots: torch.Tensor | None = None
    # [Bm, q, E] bool visibility of the new keys of the first Bm <= B requests; None, and
    # requests past Bm (a mixed step's prefill chunks after its verify trees) = causal.
    custom_mask: torch.Tensor | None = None
    hidden_in: torch.Tensor | None = None  # [T, H'] target features fed to a draft head
    # Backend metadata (built by init_forward_metadata, never by the model).
    attn_meta: object | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def seq_lens(self) -> torch.Tensor:
        """Keys each request attends to: prefix + new keys. [B] int64."""
        if self.new_kv_slots is not None:
            return self.prefix_lens + self.new_kv_slots.shape[1]
        return self.prefix_lens + to_device(self.extend_lens, torch.int64, self.prefix_lens.device)
