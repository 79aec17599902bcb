"""A step queued on the device, and its emitted tokens on their way back to the host.

RankWorker.launch returns a LaunchedStep without waiting for the device; the step channel
launches the next plan behind it and calls RankWorker.finish when the tokens are needed
(or `ready()` says they are there).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from actors.worker.host_copy import HostCopy
from actors.sampling.logprobs import logprob_lists
from actors.protocol.step_plan import StepPlan


@dataclass
class Emitted:
    """A step's emitted tokens on their way to the host: `lists` turns what `copy` brings
    back into one token list per request, in plan order; `logprobs`, when the plan asks,
    turns the same copy and those lists into each request's logprobs (actors/sampling/logprobs.py)."""
    copy: HostCopy
    lists: Callable[[list[torch.Tensor]], list[list[int]]]
    logprobs: Callable[[list[torch.Tensor], list[list[int]]], list] | None = None
    # A speculative step's nested shapes' accept lengths per decode row
    # (StepOutput.nested_accepts), from the same copy; None: it reports none.
    nested: Callable[[list[torch.Tensor]], list[list[int]]] | None = None


def one_token_each(plan: StepPlan, tokens: torch.Tensor, emitted: list[bool],
                   logprobs: tuple[torch.Tensor, ...] | None) -> Emitted:
    """A step that samples one token per request, tokens [B] (plain decode, or prefill where
    `emitted` marks the chunks that end their prompt), with its logprobs' device tensors
    (chosen [B], top logprobs [B, k], top ids [B, k]) when the plan asks."""
    lists = lambda host: [[t] if e else [] for t, e in zip(host[0].tolist(), emitted)]
    if logprobs is None:
        return Emitted(HostCopy(tokens), lists)
    asked = plan.logprobs
    return Emitted(HostCopy(tokens, *logprobs), lists,
                   lambda host, toks: logprob_lists(asked, host[1][:, None], host[2][:, None],
                                                    host[3][:, None], [len(t) for t in toks]))


def _nested(nested: int) -> Callable[[list[torch.Tensor]], list[list[int]]] | None:
    """The last `nested` columns of a speculative out's rows (EagleWorker._outputs), read
    from the host copy alone: `lists` converts the token columns."""
    return (lambda host: host[0][:, -nested:].tolist()) if nested else None


def accepted_tokens(plan: StepPlan, out: torch.Tensor, logprobs: tuple[torch.Tensor, ...] | None,
                    nested: int = 0) -> Emitted:
    """A speculative iteration's out [B, S+2+nested] int64 (each request's accept length,
    then the S+1 predicted tokens, of which that many are emitted, then the nested shapes'
    accept lengths), with its logprobs' device tensors (chosen [B, S+1], top logprobs and
    ids [B, S+1, k]) when the plan asks."""
    lists = lambda host: [r[1:1 + r[0]] for r in host[0].tolist()]
    if logprobs is None:
        return Emitted(HostCopy(out), lists, nested=_nested(nested))
    asked = plan.logprobs
    return Emitted(HostCopy(out, *logprobs), lists,
                   lambda host, toks: logprob_lists(asked, *host[1:4], [len(t) for t in toks]),
                   _nested(nested))


def mixed_tokens(out: torch.Tensor, tokens: torch.Tensor, emitted: list[bool], nested: int = 0) -> Emitted:
    """A mixed speculative step (no logprobs): its decode rows' iteration out [Bd,
    S+2+nested] as in accepted_tokens, then its chunks' tokens [Bc] as in one_token_each."""
    lists = lambda host: ([r[1:1 + r[0]] for r in host[0].tolist()]
                          + [[t] if e else [] for t, e in zip(host[1].tolist(), emitted)])
    return Emitted(HostCopy(out, tokens), lists, nested=_nested(nested))


@dataclass
class LaunchedStep:
    plan: StepPlan
    emitted: Emitted | None  # None: nothing ran (an idle plan)
    prompt_logprobs: list | None
    launch_s: float  # host seconds spent queueing it
    start: "torch.cuda.Event | None" = None  # recorded before its first device op
    eager: str = ""  # why it left the captured graphs (actors/worker/eager_steps.py); "" = it did not
    draft_shape: int = 0  # the draft shape a speculative iteration ran at (StepPlan.draft_shape)
    _tokens: list[list[int]] | None = field(default=None, repr=False)

    def ready(self) -> bool:
        """Its tokens are on the host: `finish` will not block."""
        return self.emitted is None or self.tokens_read or self.emitted.copy.ready()

    @property
    def tokens_read(self) -> bool:
        """Its tokens were read on the host already (by the next step's grammar masks)."""
        return self._tokens is not None

    def tokens(self) -> list[list[int]]:
        """Each request's emitted tokens, in plan order (a step that ran), waiting for the
        device the first time: the next step's grammar masks may need them before
        `finish` does."""
        if self._tokens is None:
            self._tokens = self.emitted.lists(self.emitted.copy.wait())
        return self._tokens


def timing_event(device: torch.device) -> "torch.cuda.Event | None":
    """An event recorded now on the device's stream, for the device's own clock."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
