"""The step loop's planning half, shared by the in-process engine and the engine core.

A step loop keeps up to `SchedulerConfig.steps_in_flight()` steps launched and unanswered:
it plans a step and launches it (on a RankWorker in process, down a step channel in the
engine core) before the one ahead of it has finished, then takes the oldest step's
outputs and commits them. `StepPipeline` is everything of that loop but the waiting for
outputs, which is the caller's (a blocking `RankWorker.finish`, an awaited channel read):
`LLMEngine.step` and `EngineCore._run` differ only in that and in what they count.

One pipeline drives one scheduler, or under dp_attention the whole group's (the ranks
step in lockstep: each step is one plan per rank, an idle plan where a rank's scheduler
has none).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from actors.protocol.step_plan import StepPlan
from serve_app.engine.scheduler import Scheduler


@dataclass
class Step:
    """One step in flight: a plan per scheduler, and what launching each returned."""
    plans: list[StepPlan]
    launched: list[Any]
    pipelined: bool  # launched while another step was in flight


class StepPipeline:
    def __init__(self, schedulers: list[Scheduler], launchers: list[Callable[[StepPlan], Any]],
                 limit: int, seconds: list[dict[str, float]], launch_phase: str):
        """`launchers[i](plan)` starts scheduler i's plan without waiting for it; `limit`:
        steps in flight at most; `seconds[i]` gains scheduler i's planning time under
        "schedule" and its launching time under `launch_phase`."""
        self.schedulers = schedulers
        self.launchers = launchers
        self.limit = limit
        self.seconds = seconds
        self.launch_phase = launch_phase
        self.in_flight: deque[Step] = deque()

    def fill(self) -> None:
        """Plan and launch steps, each before the next is planned, until `limit` are in
        flight or no scheduler has one to plan."""
        scheds, seconds = self.schedulers, self.seconds
        while len(self.in_flight) < self.limit:
            plans = []
            for sched, secs in zip(scheds, seconds):
                t0 = time.perf_counter()
                plans.append(sched.schedule())
                secs["schedule"] += time.perf_counter() - t0
            if all(p is None for p in plans):
                break
            launched = []
            for i, (plan, sched, launch, secs) in enumerate(zip(plans, scheds, self.launchers, seconds)):
                if plan is None:
                    plans[i] = plan = StepPlan(sched.step_id, "idle", [])
                t0 = time.perf_counter()
                launched.append(launch(plan))
                secs[self.launch_phase] += time.perf_counter() - t0
            self.in_flight.append(Step(plans, launched, bool(self.in_flight)))
        if not self.in_flight and any(s.has_work for s in scheds):
            # Scheduler.schedule() plans again itself after a decode preempted everyone.
            raise RuntimeError("the scheduler has requests but could not plan a step")

    def oldest(self) -> Step:
        """The step launched first, no longer in flight: its outputs are the next to come."""
        return self.in_flight.popleft()
