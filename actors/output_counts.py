"""Per request row: how often each id has been emitted and how many outputs there are, on
the device, for the penalties and min_tokens (kernels/penalties.py).

Kept by the worker, not the scheduler: with steps in flight the scheduler learns a step's
tokens one step late, while the next step's penalties need them now. A row's counts are
reset when a request that asks for processing is admitted to it (from its outputs so far:
a preempted request comes back with them), and grow with each step's emitted tokens in
the steps that carry processing, which are all the steps such a request is in. The
tensors are made at the first request that needs them.
"""
from __future__ import annotations

import numpy as np
import torch

from actors.step_plan import StepPlan
from kernels.penalties import Processing, apply_processing


class OutputCounts:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.num_rows, self.vocab, self.device = num_rows, vocab_size, device
        self.counts: torch.Tensor | None = None  # [R, V] int32
        self.num_out: torch.Tensor | None = None  # [R] int64
        self.prompt: torch.Tensor | None = None  # [R, V] bool, for the repetition penalty

    def _ensure(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.num_rows, self.vocab, dtype=torch.int32, device=self.device)
            self.num_out = torch.zeros(self.num_rows, dtype=torch.int64, device=self.device)

    def reset(self, resets) -> None:
        self._ensure()
        for row, prompt_ids, output_ids in resets:
            out = torch.as_tensor(np.asarray(output_ids, dtype=np.int64), device=self.device)
            self.counts[row] = torch.bincount(out, minlength=self.vocab).to(torch.int32)
            self.num_out[row] = out.numel()
            if prompt_ids is not None:
                if self.prompt is None:
                    self.prompt = torch.zeros(self.num_rows, self.vocab, dtype=torch.bool, device=self.device)
                self.prompt[row] = False
                self.prompt[row, torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64), device=self.device)] = True
            elif self.prompt is not None:
                self.prompt[row] = False

    def process(self, plan: StepPlan, rows: torch.Tensor, logits: torch.Tensor,
                path_tokens: torch.Tensor | None = None,
                path_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The plan's processing on logits [B, N, V] of request rows [B] -> a new tensor."""
        self._ensure()
        pp, dev = plan.processing, self.device
        t = lambda a, dt: torch.as_tensor(a, dtype=dt, device=dev)
        p = Processing(t(pp.presence, torch.float32), t(pp.frequency, torch.float32),
                       t(pp.repetition, torch.float32), t(pp.min_tokens, torch.int64),
                       t(pp.bias[:, 0], torch.int64), t(pp.bias[:, 1], torch.int64),
                       t(pp.bias_value, torch.float32), t(pp.stops[:, 0], torch.int64),
                       t(pp.stops[:, 1], torch.int64))
        prompt = self.prompt[rows] if self.prompt is not None and bool((pp.repetition != 1).any()) else None
        return apply_processing(logits, p, self.counts[rows], self.num_out[rows], prompt,
                                path_tokens, path_mask)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """Emitted tokens [B, L] int64 of rows [B], the first lens[b] of each."""
        self._ensure()
        L = tokens.shape[1]
        keep = torch.arange(L, device=tokens.device)[None, :] < lens[:, None]  # [B, L] bool
        r = rows[:, None].expand(-1, L)[keep]
        self.counts.index_put_((r, tokens[keep]), torch.ones_like(r, dtype=torch.int32), accumulate=True)
        self.num_out[rows] += lens.to(torch.int64)
