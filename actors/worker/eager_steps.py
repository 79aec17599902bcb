"""Steps that left the captured graphs while graphs are on: a slow path, never a silent one.

A decode step that finds no graph for its batch (or for what its requests ask) runs its
forwards eagerly, several times slower at small models. Each such step is counted by the
first reason it met (the engine core sums them per rank; /metrics exports
`kestrel_engine_eager_steps_total{reason}`), and the first of each reason on a rank is logged.
"""
from __future__ import annotations

import logging

log = logging.getLogger("kestrel.worker")

# Why a step ran eagerly. The metric's label values; one table so the docs and tests agree.
REASONS = {
    "batch_size": "more requests than the largest captured graph",
    "processing": "logit processing the graphs' tables cannot hold (too many entries)",
    "logprobs": "more top logprobs than the graphs compute",
    "grammar": "grammar masks wider than the graphs' buffer",
    "variant": "a sampling/processing/logprobs combination with no graph (feature_graphs off)",
    "dp_attention": "a dp_attention group step with no graph of the group's size",
}


class EagerSteps:
    """The eager reason of the step being launched on one rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.reason = ""  # of the step being launched; "" = it replayed graphs only
        self._logged: set[str] = set()

    def note(self, reason: str, detail: str = "") -> None:
        """The step being launched runs (part of) its work eagerly because of `reason`."""
        if reason not in REASONS:
            raise ValueError(f"unknown eager-step reason {reason!r} (known: {sorted(REASONS)})")
        if self.reason:
            return  # the first reason names the step
        self.reason = reason
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("rank %d: a step runs eagerly: %s%s (logged once per reason; counted in "
                        "kestrel_engine_eager_steps_total{reason=%r})", self.rank, REASONS[reason],
                        f" ({detail})" if detail else "", reason)

    def take(self) -> str:
        """The launched step's reason, cleared for the next step."""
        reason, self.reason = self.reason, ""
        return reason
