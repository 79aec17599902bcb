"""A step queued on the device, and its emitted tokens on their way back to the host.

RankWorker.launch returns a LaunchedStep without waiting for the device; the step channel
launches the next plan behind it and calls RankWorker.finish when the tokens are needed
(or `ready()` says they are there).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from actors.host_copy import HostCopy
from actors.step_plan import StepPlan


@dataclass
class Emitted:
    """A step's emitted tokens on their way to the host: `lists` turns what `copy` brings
    back into one token list per request, in plan order."""
    copy: HostCopy
    lists: Callable[[list[torch.Tensor]], list[list[int]]]


def first_tokens(plan: StepPlan, tokens: torch.Tensor) -> Emitted:
    """A prefill step's tokens [B]: emitted by the chunks that end their prompt."""
    return Emitted(HostCopy(tokens), lambda host: [[t] if last else [] for t, last in
                                                   zip(host[0].tolist(), plan.last_chunk)])


@dataclass
class LaunchedStep:
    plan: StepPlan
    emitted: Emitted | None  # None: nothing ran (an idle plan)
    logprobs: list | None
    prompt_logprobs: list | None
    launch_s: float  # host seconds spent queueing it
    start: "torch.cuda.Event | None" = None  # recorded before its first device op

    def ready(self) -> bool:
        """Its tokens are on the host: `finish` will not block."""
        return self.emitted is None or self.emitted.copy.ready()


def timing_event(device: torch.device) -> "torch.cuda.Event | None":
    """An event recorded now on the device's stream, for the device's own clock."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
