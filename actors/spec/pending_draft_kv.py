"""The draft's KV for plain decode steps on the CPU, written late and in one call.

After a plain decode step (draft.plain_steps) the draft's KV at each request's new position
must be written before a draft forward reads it (EagleWorker.follow_plain_step). On the
CPU that write is some ten small ops a step, a few percent of a one-row packed step, paid
even while the policy keeps choosing plain steps and no draft forward runs at all. So the
rows wait here and are written together just before the next step that runs the draft
(a speculative decode step, a prefill chunk's draft extend), or once ROWS_MAX rows wait.

A slot may appear twice: a request finished, and a plain step gave its slot to another
request's next token before the write. The later row is the slot's owner, so it is the
one kept. A slot handed to a new prompt goes through a prefill step, which writes what
waits first and then its own KV over it.
"""
from __future__ import annotations

import torch

ROWS_MAX = 256  # a bound on the memory held and on the one write's size


class PendingDraftKV:
    def __init__(self):
        self.parts: list[tuple[torch.Tensor, ...]] = []
        self.rows = 0

    def add(self, tokens: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
            feats: torch.Tensor) -> bool:
        """One plain step's rows (tokens, positions, loc [B] int64; feats [B, F], copied:
        the caller reuses its buffer) -> whether ROWS_MAX rows now wait."""
        self.parts.append((tokens.clone(), positions.clone(), loc.clone(), feats.clone()))
        self.rows += tokens.numel()
        return self.rows >= ROWS_MAX

    def take(self) -> tuple[torch.Tensor, ...] | None:
        """Every waiting row, each slot's last one only, in arrival order -> (tokens,
        positions, loc [R] int64, feats [R, F]); None if none wait."""
        if not self.parts:
            return None
        tokens, positions, loc, feats = (torch.cat(t) for t in zip(*self.parts))
        self.parts, self.rows = [], 0
        last = {slot: i for i, slot in enumerate(loc.tolist())}  # a slot's later row wins
        if len(last) < loc.numel():
            keep = torch.tensor(sorted(last.values()), dtype=torch.int64, device=loc.device)  # [R] int64
            tokens, positions, loc, feats = tokens[keep], positions[keep], loc[keep], feats[keep]
        return tokens, positions, loc, feats
