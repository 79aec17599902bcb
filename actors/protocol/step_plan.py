"""What the scheduler sends a rank worker for one step, and what comes back.

Plain data (lists and numpy arrays) so it crosses the step channel cheaply: pickling a
plan holding torch tensors took 0.85 ms each way on the 2-core CPU, the same plan with
numpy arrays 0.05 ms. Lengths the worker needs for decode come from its own future map,
not from the plan: with overlap the scheduler learns them one step late.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# StepPlan/StepOutput.draft_shape of a plain decode step that a speculative engine's draft
# policy chose (draft.plain_steps): no draft ran, so no draft shape did.
PLAIN_STEP = -1


def deepest_accept(steps: int, nodes: int) -> int:
    """The most tokens a speculative step of `steps` draft steps into a tree of `nodes` nodes
    (root included) emits per request: its deepest acceptable path, plus the bonus token."""
    return min(steps, nodes - 1) + 1


def nested_shapes(shapes: list[tuple[int, int, int]], i: int) -> list[int]:
    """Indices of the (topk, steps, nodes) shapes whose tree is the first nodes, by score, of
    shape i's tree from the same draft: the same top-k and steps, fewer nodes but more than
    the root. A step at shape i also reports the accept length each of them would have
    given (StepOutput.nested_accepts, in this order)."""
    k, s, n = shapes[i]
    return [j for j, (k2, s2, n2) in enumerate(shapes) if (k2, s2) == (k, s) and 1 < n2 < n]


def coins_per_request(cfg) -> int:
    """Uniforms a sampled request draws per step (a KestrelConfig): one per tree node and a
    final one under speculation, else one."""
    return (cfg.draft.num_draft_tokens + 1) if cfg.draft.enabled else 1


@dataclass
class RowProcessing:
    """One request's logit processing (kestrel_kernels/penalties.py) and sampling parameters
    (kestrel_kernels/sampling.py), sent once when it is admitted to a row; the rank keeps them in
    its processing table (actors/sampling/processing_table.py)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0  # 1 = off
    min_tokens: int = 0
    bias_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [M] int64
    bias_values: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))  # [M] float32
    stop_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [S] int64, under min_tokens
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences, each at most MAX_BAD_WORD_TOKENS long
    temperature: float = 0.0  # <= 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0: no limit
    min_p: float = 0.0


@dataclass
class StepPlan:
    step_id: int
    # "extend" | "decode" | "idle" | "mixed": the first num_decode rows decode (plain or
    # speculative, per use_spec) in the same target forward as the rest's prefill chunks.
    mode: str
    rows: list[int]  # req_to_token rows, one per request
    # New KV slots to record: (row, first position, slots [n] int64), in order.
    kv_writes: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    coins: np.ndarray | None = None  # [B, C] float32 uniforms from each request's seeded generator
    num_decode: int = 0  # mixed only
    # extend (and a mixed plan's chunk rows, after its decode rows)
    input_ids: list[int] = field(default_factory=list)  # chunk tokens, requests concatenated
    prefix_lens: list[int] = field(default_factory=list)  # tokens already in KV before the chunk
    extend_lens: list[int] = field(default_factory=list)
    last_chunk: list[bool] = field(default_factory=list)  # sample the first output token
    next_ids: list[int] = field(default_factory=list)  # prompt token after the chunk (-1 on the last)
    use_spec: bool = False  # decode only: draft and verify (EAGLE) rather than plain decode
    # decode with use_spec: which of DraftConfig.shapes() the iteration drafts with (0: the
    # configured one; serve_app/engine/draft_policy.py chooses). PLAIN_STEP without use_spec:
    # the policy chose a plain decode step in a speculative engine (draft.plain_steps).
    draft_shape: int = 0
    # Some request's logits are processed (penalties, bias, min_tokens, bad words): the rank
    # applies its processing table's rows of the plan.
    processing: bool = False
    min_p: np.ndarray | None = None  # [B] float32 per request (0 = off); None: nobody
    # Per request, how many alternatives its logprobs list (-1: none asked); None: nobody.
    logprobs: list[int] | None = None
    # extend only: per request, the alternatives its prompt tokens' logprobs list (-1:
    # none); None: nobody. A plan with any runs eagerly (the graphs keep the last logits).
    prompt_logprobs: list[int] | None = None
    # Rows whose output counts restart (a request admitted, or readmitted after preemption):
    # (row, prompt ids or None when no repetition penalty needs them, outputs so far).
    count_resets: list[tuple[int, np.ndarray | None, np.ndarray]] = field(default_factory=list)
    # Rows whose processing table entry changes: a request admitted that asks for processing
    # or samples, or one admitted after such a request, which clears it (None).
    processing_resets: list[tuple[int, RowProcessing | None]] = field(default_factory=list)
    # Rows that start a request with a grammar, or after one (actors/sampling/grammar_rows.py):
    # (row, serialized compiled grammar or None, outputs so far [n] int64).
    grammar_resets: list[tuple[int, str | None, np.ndarray]] = field(default_factory=list)
    # xgrammar's TokenizerInfo, serialized: on the first plan with a grammar only.
    grammar_vocab: str | None = None

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def parts(self) -> tuple[StepPlan, StepPlan]:
        """A mixed plan as (its decode plan, its extend plan): each with its own rows'
        sampling fields, and none of the row updates, which the worker applied already."""
        d = self.num_decode

        def cut(lo: int, hi: int | None, mode: str) -> StepPlan:
            pick = lambda x: None if x is None else x[lo:hi]
            part = StepPlan(self.step_id, mode, self.rows[lo:hi], temperature=self.temperature[lo:hi],
                            top_p=self.top_p[lo:hi], top_k=self.top_k[lo:hi], coins=pick(self.coins),
                            processing=self.processing, min_p=pick(self.min_p),
                            logprobs=pick(self.logprobs))
            if mode == "extend":
                part.input_ids, part.prefix_lens, part.extend_lens = \
                    self.input_ids, self.prefix_lens, self.extend_lens
                part.last_chunk, part.next_ids = self.last_chunk, self.next_ids
            else:
                part.use_spec, part.draft_shape = self.use_spec, self.draft_shape
            return part

        return cut(0, d, "decode"), cut(d, None, "extend")


@dataclass
class StepOutput:
    step_id: int
    # Per request in plan order: the tokens emitted this step (empty for a non-final chunk).
    # For speculative decode its length is the accept length (accepted drafts + bonus).
    tokens: list[list[int]]
    timings: dict[str, float] = field(default_factory=dict)
    # Per request, None or one (logprob, top ids, top logprobs) per emitted token
    # (actors/sampling/logprobs.py); None when the plan asked for none.
    logprobs: list | None = None
    # extend only: per request in plan order, None or one (logprob, top ids, top
    # logprobs, rank) per prompt token this chunk predicts (the next one's, from each position).
    prompt_logprobs: list | None = None
    # Why the step left the captured graphs (actors/worker/eager_steps.py); "" = it did not.
    eager: str = ""
    # The draft shape a speculative iteration ran at: the plan's, or 0 where that shape's
    # step graph could not hold the step; PLAIN_STEP for a plain step the policy chose.
    draft_shape: int = 0
    # Speculative decode rows, in plan order: the accept length each shape nested in
    # draft_shape (nested_shapes) would have given on this step; None when none is.
    nested_accepts: list[list[int]] | None = None
