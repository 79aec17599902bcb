"""A request as the scheduler sees it: sampling settings, tokens, KV bookkeeping, output."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from actors.protocol.messages import RequestOutput
from actors.protocol.sampling_params import SamplingParams

COIN_BLOCK = 32  # steps of coins drawn per generator call


def text_ids(ids: list[int], ended_by_stop_token: bool) -> list[int]:
    """The ids of an output that become text: a stop token that ended the request is not
    part of the text (nor of the logprobs listed beside it)."""
    return ids[:-1] if ended_by_stop_token else ids


class CoinStream:
    """A sampled request's uniforms: `width` per step from its seeded generator, drawn a
    block of steps at a time. One torch.rand per block yields the same numbers as one per
    step (the CPU generator fills tensors in order), at a 32nd of the calls."""

    def __init__(self, seed: int, width: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.width = width
        self.block = np.zeros((0, width), dtype=np.float32)  # [COIN_BLOCK, width] float32
        self.pos = 0

    def next(self) -> np.ndarray:
        if self.pos == len(self.block):
            self.block = torch.rand(COIN_BLOCK, self.width, generator=self.generator).numpy()
            self.pos = 0
        self.pos += 1
        return self.block[self.pos - 1]


@dataclass(eq=False)  # a request is itself: queue lookups compare identity, not fields
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping (written only by the scheduler: see C10)
    row: int | None = None
    # The row's slots as allocated, piece by piece (see `slots`).
    slot_pieces: list[torch.Tensor] = field(default_factory=list, repr=False)
    kv_committed_len: int = 0  # tokens whose KV is valid
    kv_allocated_len: int = 0  # slots reserved in this request's row (monotonic while it lives)
    prefilled: int = 0  # tokens of `fill_ids` whose KV the current prefill has computed
    scheduled: int = 0  # tokens of `fill_ids` already put in a plan (ahead of `prefilled`
    # when steps are pipelined)
    fill_ids: list[int] = field(default_factory=list)  # what the current prefill covers
    cache_node: object | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (all prefills)
    # A plain decode step (draft.plain_steps) left the draft's top-k behind: the next
    # speculative step drafts from it, and its accept length does not teach the draft policy.
    draft_stale: bool = False
    prompt_cached: int = 0  # of the prompt, at its first admission (usage reports it)
    token_logprobs: list = field(default_factory=list)  # per output token, when asked
    prompt_logprobs: list = field(default_factory=list)  # per prompt token after the first, when asked
    prompt_logprobs_sent: bool = False
    computed_prompt_tokens: int = 0  # prompt tokens the model actually ran
    num_preemptions: int = 0
    # Times the scheduler admitted it (given a row): an output of a step planned under an
    # earlier admission is stale, even when the row it had then is its row again.
    admissions: int = 0
    # outcome
    finished: bool = False
    finish_reason: str | None = None
    text: str = ""
    accept_lengths: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.time)
    first_token_time: float | None = None
    coin_stream: CoinStream | None = None  # sampled requests only
    text_stream: object | None = None  # serve_app.text.detokenizer.TextStream, where the scheduler makes text
    # Set by the scheduler when it takes the request: the token ids that end it, the
    # output length at which it ends (max_tokens, or the model's context), and whether it
    # reports only at its end (no stream, no stop strings).
    stop_ids: frozenset[int] = frozenset()
    max_output: int = 0
    quiet: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def slots(self) -> torch.Tensor:
        """[kv_allocated_len] int64: the KV slot of each position of the row. A running
        request grows by a page every few steps and the row is read only when it ends:
        the pieces are joined on reading, not copied at every growth."""
        if len(self.slot_pieces) != 1:
            self.slot_pieces = [torch.cat(self.slot_pieces) if self.slot_pieces
                                else torch.zeros(0, dtype=torch.int64)]
        return self.slot_pieces[0]

    @slots.setter
    def slots(self, value: torch.Tensor) -> None:
        self.slot_pieces = [value]
