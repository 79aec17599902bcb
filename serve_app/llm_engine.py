"""In-process engine: schedulers and rank workers in one process, no Ray.

`kestrel generate`, `kestrel chat`, the offline benchmark and most tests use it; the Serve
Engine deployment drives the same Scheduler and RankWorker classes across Ray.
Without dp_attention, DP ranks are independent: each has its own scheduler and requests
go to the least-loaded one.
"""
from __future__ import annotations

import itertools
import logging
import time

from actors.rank_worker import RankWorker
from configs.schema import KestrelConfig
from serve_app.detokenizer import detokenizer_factory
from serve_app.request import Request, RequestOutput, SamplingParams
from serve_app.scheduler import Scheduler
from serve_app.tokenizer import stop_token_ids

log = logging.getLogger("kestrel.engine")


class LLMEngine:
    def __init__(self, cfg: KestrelConfig, tokenizer=None, load_tokenizer: bool = True,
                 workers: list[RankWorker] | None = None, worker_info: dict | None = None):
        """`workers` reuses loaded ranks (tests: schedulers are cheap, weights are not);
        `worker_info` entries override what the workers report (e.g. fewer KV slots)."""
        self.cfg = cfg
        if cfg.parallel.dp_attention:
            raise NotImplementedError("parallel.dp_attention runs a process per rank: serve it "
                                      "(kestrel serve); the in-process engine runs independent ranks")
        self.workers = workers or [RankWorker(cfg, rank) for rank in range(cfg.parallel.dp_size)]
        arch = self.workers[0].arch
        if tokenizer is None and load_tokenizer:
            from actors.models.loader import default_model_path
            from serve_app.tokenizer import load_tokenizer as _load
            tokenizer = _load(cfg.model.path or default_model_path())
        self.tokenizer = tokenizer
        eos = sorted(stop_token_ids(tokenizer, arch))
        factory = detokenizer_factory(tokenizer) if tokenizer is not None else None
        self.schedulers = [Scheduler(cfg, {**w.info(), **(worker_info or {})}, eos, factory)
                           for w in self.workers]
        self._ids = itertools.count()
        self.steps = 0
        # Where step time goes (seconds, summed over ranks): host scheduling, the worker
        # (model and sampling), committing outputs; and steps per mode. For progress lines.
        self.seconds = {"schedule": 0.0, "execute": 0.0, "process": 0.0}
        self.mode_steps = {"extend": 0, "decode": 0}

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                    on_output=None) -> Request:
        if params.grammar is not None and self.schedulers[0].grammar_vocab is None:
            from serve_app.grammar import compiler_for
            for s in self.schedulers:
                s.set_grammar_vocab(compiler_for(self.tokenizer).vocab_json)
        req = Request(rid or f"req-{next(self._ids)}", list(prompt_ids), params, on_output)
        min(self.schedulers, key=lambda s: s.num_requests).add_request(req)
        return req

    def abort(self, rid: str) -> bool:
        return any(s.abort(rid) for s in self.schedulers)

    def abort_all(self) -> None:
        for s in self.schedulers:
            s.abort_all()

    @property
    def has_work(self) -> bool:
        return any(s.has_work for s in self.schedulers)

    def step(self) -> list[RequestOutput]:
        """One step on every rank with work (ranks are independent without dp_attention)."""
        events: list[RequestOutput] = []
        for sched, worker in zip(self.schedulers, self.workers):
            t0 = time.perf_counter()
            plan = sched.schedule()
            if plan is None:
                if sched.has_work:
                    raise RuntimeError("scheduler has requests but could not plan a step")
                continue
            t1 = time.perf_counter()
            out = worker.execute(plan)
            t2 = time.perf_counter()
            events += sched.process_output(plan, out)
            self.seconds["schedule"] += t1 - t0
            self.seconds["execute"] += t2 - t1
            self.seconds["process"] += time.perf_counter() - t2
            self.mode_steps[plan.mode] = self.mode_steps.get(plan.mode, 0) + 1
        self.steps += 1
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress=None) -> list[Request]:
        """Run prompts to completion; returns the finished requests in input order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            for ev in self.step():
                if ev.finished and progress is not None:
                    progress.update(1)
        return reqs

    def kv_free_slots(self) -> list[int]:
        return [s.kv_free_slots() for s in self.schedulers]

    def kv_capacity(self) -> list[int]:
        return [s.slots.capacity for s in self.schedulers]


def timed_generate(engine: LLMEngine, prompts, params, progress=None) -> tuple[list[Request], float]:
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params, progress)
    return reqs, time.perf_counter() - t0
