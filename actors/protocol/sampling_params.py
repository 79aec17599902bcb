"""A request's sampling settings, as the HTTP front end asks for them and the scheduler
runs them. Built (and checked) once, where the request is admitted; the front channel
carries the built object to the engine core (actors/protocol/messages.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.sampling.logprobs import MAX_TOP
from actors.sampling.output_counts import MAX_BAD_WORD_TOKENS

# OpenAI's bounds, which the HTTP front end's request models declare too.
MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 2.0


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Logit processing (kestrel_kernels/penalties.py): OpenAI's penalties and bias, vLLM's extensions.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_tokens: int = 0
    # vLLM's bad_words, tokenized: a sequence's last id is never emitted right after the
    # ids before it (a one-id sequence never at all). At most MAX_BAD_WORD_TOKENS ids each
    # (actors/sampling/output_counts.py).
    bad_words: list[list[int]] = field(default_factory=list)
    logprobs: int | None = None  # alternatives listed with each token's logprob; None = none
    # The prompt's own tokens' logprobs (vLLM's prompt_logprobs), with this many
    # alternatives each; None = none. Taken from the raw logits (no processing applies
    # to a prompt), so a request asking for them is not served from the prefix cache.
    prompt_logprobs: int | None = None
    # Structured outputs: the compiled grammar, serialized (serve_app/text/grammar.py); every
    # output token is one the grammar allows, on every decoding path.
    grammar: str | None = None

    @property
    def needs_counts(self) -> bool:
        """Whether the worker must count this request's outputs (penalties, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.bad_words)

    @property
    def processes_logits(self) -> bool:
        """Whether the worker processes this request's logits (its processing table row)."""
        return self.needs_counts or bool(self.logit_bias)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be within [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be within (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be within [0, 1], got {self.min_p}")
        # The ranks compute at most MAX_TOP alternatives (actors/sampling/logprobs.py).
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP:
            raise ValueError(f"logprobs must be within [0, {MAX_TOP}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP:
            raise ValueError(f"prompt_logprobs must be within [0, {MAX_TOP}], got {self.prompt_logprobs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not 1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words):
            raise ValueError(f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens")
