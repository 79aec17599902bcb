"""Per-request values carried from one iteration to the next, keyed by req_to_token row.

The scheduler commits lengths one step late; the worker never waits for it. Whatever an
iteration produces for the next one (new length, bonus token, the draft's top-k and
hidden state) is stored here and resolved by row at the next step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Carried:
    seq_lens: torch.Tensor  # [B] int64, tokens with valid KV
    bonus: torch.Tensor  # [B] int64, last emitted token (no KV yet)
    topk_p: torch.Tensor | None  # [B, K] float32
    topk_index: torch.Tensor | None  # [B, K] int64
    hidden: torch.Tensor | None  # [B, H] draft hidden state


class FutureMap:
    def __init__(self, num_rows: int, topk: int, hidden_size: int, dtype: torch.dtype,
                 device: str | torch.device, spec: bool):
        self.seq_lens = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [R] int64
        self.bonus = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [R] int64
        self.spec = spec
        if spec:
            self.topk_p = torch.zeros(num_rows, topk, dtype=torch.float32, device=device)  # [R, K]
            self.topk_index = torch.zeros(num_rows, topk, dtype=torch.int64, device=device)
            self.hidden = torch.zeros(num_rows, hidden_size, dtype=dtype, device=device)  # [R, H]

    def store(self, rows: torch.Tensor, seq_lens: torch.Tensor, bonus: torch.Tensor,
              topk_p: torch.Tensor | None = None, topk_index: torch.Tensor | None = None,
              hidden: torch.Tensor | None = None) -> None:
        if rows.numel() == 0:
            return
        self.seq_lens[rows] = seq_lens.to(torch.int64)
        self.bonus[rows] = bonus.to(torch.int64)
        if self.spec and topk_p is not None:
            self.topk_p[rows] = topk_p.float()
            self.topk_index[rows] = topk_index.to(torch.int64)
            self.hidden[rows] = hidden.to(self.hidden.dtype)

    def resolve(self, rows: torch.Tensor) -> Carried:
        """An empty `rows` (an idle rank) resolves to empty tensors and changes nothing."""
        if not self.spec:
            return Carried(self.seq_lens[rows], self.bonus[rows], None, None, None)
        return Carried(self.seq_lens[rows], self.bonus[rows], self.topk_p[rows],
                       self.topk_index[rows], self.hidden[rows])
