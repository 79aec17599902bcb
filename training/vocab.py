"""EAGLE-3 draft vocabulary: the target tokens the head may propose.

The draft's LM head covers only the most frequent assistant tokens of the training data:
a smaller head is cheaper per draft step and easier to learn, and the rare tokens it
cannot propose cost little acceptance. Draft ids are the chosen target ids in ascending
order, so `d2t[i] = target_id[i] - i` (the SGLang/EAGLE-3 convention: target id = draft
id + d2t[draft id]) and `t2d` is a bool mask over the target vocabulary.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class DraftVocab:
    token_ids: torch.Tensor  # [Vd] int64 target ids, ascending
    d2t: torch.Tensor  # [Vd] int64 offsets: target id = draft id + d2t[draft id]
    t2d: torch.Tensor  # [V] bool: target id is in the draft vocabulary
    coverage: float  # fraction of the counted assistant tokens inside the vocabulary

    @property
    def size(self) -> int:
        return int(self.token_ids.numel())

    def target_to_draft(self) -> torch.Tensor:
        """[V] int64 draft id of each target id, -1 where it has none."""
        out = torch.full((self.t2d.numel(),), -1, dtype=torch.int64)
        out[self.token_ids] = torch.arange(self.size, dtype=torch.int64)
        return out


def count_assistant_tokens(samples: Iterable[dict]) -> Counter:
    c: Counter = Counter()
    for s in samples:
        c.update(t for t, m in zip(s["input_ids"], s["loss_mask"]) if m)
    return c


def coverage(counts: Counter, t2d: torch.Tensor) -> float:
    total = sum(counts.values())
    if not total:
        return 0.0
    return sum(n for t, n in counts.items() if 0 <= t < t2d.numel() and bool(t2d[t])) / total


def from_token_ids(ids: Iterable[int], target_vocab_size: int, counts: Counter | None = None) -> DraftVocab:
    token_ids = torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.int64)  # [Vd] int64
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)  # [V] bool
    t2d[token_ids] = True
    d2t = token_ids - torch.arange(token_ids.numel(), dtype=torch.int64)  # [Vd] int64
    return DraftVocab(token_ids, d2t, t2d, coverage(counts, t2d) if counts is not None else float("nan"))


def from_d2t(d2t: torch.Tensor, target_vocab_size: int) -> DraftVocab:
    """The vocabulary a loaded head carries (its d2t buffer)."""
    ids = d2t.cpu().long() + torch.arange(d2t.numel(), dtype=torch.int64)
    return from_token_ids(ids.tolist(), target_vocab_size)


def build_draft_vocab(samples: list[dict], target_vocab_size: int, draft_vocab_size: int,
                      always_include: Iterable[int] = ()) -> DraftVocab:
    """The draft_vocab_size most frequent assistant tokens (ties: lower id first).

    `always_include` (e.g. end-of-turn ids) is taken first. If the data has fewer distinct
    assistant tokens than asked, the rest is filled by the most frequent prompt tokens and
    then the lowest unused ids, so the head always has the configured size.
    """
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft vocabulary size {draft_vocab_size} must be within 1..{target_vocab_size}")
    counts = count_assistant_tokens(samples)
    chosen: list[int] = []
    seen: set[int] = set()

    def take(ids: Iterable[int]) -> None:
        for t in ids:
            if len(chosen) >= draft_vocab_size:
                return
            if 0 <= t < target_vocab_size and t not in seen:
                seen.add(t)
                chosen.append(t)

    take(int(t) for t in always_include)
    take(t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    if len(chosen) < draft_vocab_size:
        every: Counter = Counter()
        for s in samples:
            every.update(s["input_ids"])
        take(t for t, _ in sorted(every.items(), key=lambda kv: (-kv[1], kv[0])))
        take(range(target_vocab_size))
    return from_token_ids(chosen, target_vocab_size, counts)
