"""Per request row: how often each id has been emitted and how many outputs there are, on
the device, for the penalties and min_tokens (kestrel_kernels/penalties.py).

Kept by the worker, not the scheduler: with steps in flight the scheduler learns a step's
tokens one step late, while the next step's penalties need them now. A row's counts are
reset when a request that asks for processing is admitted to it (from its outputs so far:
a preempted request comes back with them), and grow with each step's emitted tokens in
the steps that carry processing, which are all the steps such a request is in. The
tensors are made at the first request that needs them, or when graphs that read them are
captured.
"""
from __future__ import annotations

import numpy as np
import torch

from actors.worker.host_copy import to_device

# Longest bad word, in tokens; matching one needs the TAIL ids emitted before its last.
MAX_BAD_WORD_TOKENS = 16
TAIL = MAX_BAD_WORD_TOKENS - 1  # emitted ids kept per row


class OutputCounts:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.num_rows, self.vocab, self.device = num_rows, vocab_size, device
        self.counts: torch.Tensor | None = None  # [R, V] int32
        self.num_out: torch.Tensor | None = None  # [R] int64
        self.prompt: torch.Tensor | None = None  # [R, V] bool, for the repetition penalty
        self.tail: torch.Tensor | None = None  # [R, TAIL] int64, the last ids emitted (-1: none)

    def ensure(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.num_rows, self.vocab, dtype=torch.int32, device=self.device)
            self.num_out = torch.zeros(self.num_rows, dtype=torch.int64, device=self.device)
            self.tail = torch.full((self.num_rows, TAIL), -1, dtype=torch.int64, device=self.device)
            # A row whose request has no repetition penalty keeps stale bits: they act only
            # through the penalty, which is 1 there.
            self.prompt = torch.zeros(self.num_rows, self.vocab, dtype=torch.bool, device=self.device)

    def reset(self, resets) -> None:
        """Restart rows from (row, prompt ids or None, outputs so far), a few device ops for
        all of them; a row given twice keeps its last."""
        self.ensure()
        last = {row: (prompt, out) for row, prompt, out in resets}
        dev, V = self.device, self.vocab
        outs = [np.asarray(out, dtype=np.int64) for _, out in last.values()]
        rows = to_device(list(last), torch.int64, dev)  # [n] int64
        tails = np.full((len(last), TAIL), -1, dtype=np.int64)  # [n, TAIL]
        for i, out in enumerate(outs):
            if len(out):
                tails[i, TAIL - min(TAIL, len(out)):] = out[-TAIL:]
        self.counts[rows] = 0
        self.prompt[rows] = False
        self.num_out[rows] = to_device([len(o) for o in outs], torch.int64, dev)
        self.tail[rows] = to_device(tails, torch.int64, dev)
        # Flat indices row * V + id: one scatter-add of the outputs, one write of the prompts.
        flat = lambda ids: np.concatenate([np.zeros(0, dtype=np.int64)] + ids)
        at = to_device(flat([r * V + o for r, o in zip(last, outs)]), torch.int64, dev)  # [sum n] int64
        self.counts.view(-1).scatter_add_(0, at, torch.ones_like(at, dtype=torch.int32))
        prompts = [r * V + np.asarray(p, dtype=np.int64) for r, (p, _) in last.items() if p is not None]
        if prompts:
            self.prompt.view(-1)[to_device(flat(prompts), torch.int64, dev)] = True

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor) -> None:
        """Emitted tokens [B, L] int64 of rows [B], the first lens[b] of each."""
        self.ensure()
        B, L = tokens.shape
        keep = torch.arange(L, device=tokens.device)[None, :] < lens[:, None]  # [B, L] bool
        # Every lane adds its keep bit (0 past the emitted ones): no host sync for a mask, and
        # a scatter-add, which a CUDA graph can hold.
        at = rows[:, None] * self.vocab + torch.where(keep, tokens, torch.zeros_like(tokens))  # [B, L] int64
        self.counts.view(-1).scatter_add_(0, at.reshape(-1), keep.reshape(-1).to(torch.int32))
        self.num_out[rows] += lens.to(torch.int64)
        # The tail slides by each row's emitted count: the last TAIL of tail ++ emitted.
        joined = torch.cat([self.tail[rows], tokens], 1)  # [B, TAIL + L]
        at = lens.to(torch.int64)[:, None] + torch.arange(TAIL, device=tokens.device)  # [B, TAIL]
        self.tail[rows] = joined.gather(1, at)
