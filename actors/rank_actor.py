"""RankActor: a RankWorker as a Ray actor (one per GPU / DP rank of an Engine replica).

A thin wrapper: the Engine deployment creates one per bundle of its placement group and
sends it step plans. The actor stays single-threaded on purpose: Ray then runs one
caller's calls in submission order, which the Engine's step pipelining relies on (at
most two plans are in flight, so a health-check `ping` waits behind two steps at most).
"""
from __future__ import annotations

import logging
from typing import Any

import ray

from actors.rank_worker import RankWorker
from actors.step_plan import StepOutput, StepPlan
from configs.schema import KestrelConfig


@ray.remote
class RankActor:
    def __init__(self, cfg: dict[str, Any] | KestrelConfig, rank: int):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        if not isinstance(cfg, KestrelConfig):
            cfg = KestrelConfig.model_validate(cfg)
        self.worker = RankWorker(cfg, rank)

    def info(self) -> dict:
        return self.worker.info()

    def eos_token_ids(self) -> list[int]:
        return list(self.worker.arch.eos_token_ids)

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.worker.execute(plan)

    def ping(self) -> int:
        return self.worker.rank
