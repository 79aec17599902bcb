"""In-process engine: schedulers and rank workers in one process, no Ray.

`kestrel generate`, `kestrel chat`, the offline benchmark and most tests use it; the Serve
Engine deployment drives the same Scheduler and RankWorker classes across Ray.
Without dp_attention, DP ranks are independent: each has its own scheduler and requests
go to the least-loaded one.

Steps run as the served engine runs them, through the same StepPipeline
(serve_app/engine/step_pipeline.py): with scheduler.launch_ahead (by default on a GPU), step
N+1 is planned and launched on the worker before step N is finished, so the device does
not wait for the host between steps.
"""
from __future__ import annotations

import gc
import itertools
import logging
import time
from collections import Counter

from actors.protocol.messages import RequestOutput
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.step_plan import PLAIN_STEP
from actors.worker.rank_worker import RankWorker
from configs.schema import KestrelConfig
from serve_app.text.detokenizer import detokenizer_factory
from serve_app.engine.model_files import local_model
from serve_app.engine.request import Request
from serve_app.engine.scheduler import Scheduler
from serve_app.engine.step_pipeline import StepPipeline
from serve_app.text.tokenizer import stop_token_ids

log = logging.getLogger("kestrel.engine")


class LLMEngine:
    def __init__(self, cfg: KestrelConfig, tokenizer=None, load_tokenizer: bool = True,
                 workers: list[RankWorker] | None = None, worker_info: dict | None = None):
        """`workers` reuses loaded ranks (tests: schedulers are cheap, weights are not);
        `worker_info` entries override what the workers report (e.g. fewer KV slots)."""
        if workers is None:
            # A URI model.path fetched and the files checked, as a Serve replica does.
            cfg, _ = local_model(cfg)
        self.cfg = cfg
        if cfg.parallel.dp_attention:
            raise NotImplementedError("parallel.dp_attention runs a process per rank: serve it "
                                      "(kestrel serve); the in-process engine runs independent ranks")
        self.workers = workers or [RankWorker(cfg, rank) for rank in range(cfg.parallel.dp_size)]
        arch = self.workers[0].arch
        if tokenizer is None and load_tokenizer:
            from actors.models.loader import default_model_path
            from serve_app.text.tokenizer import load_tokenizer as _load
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
        # Per rank: its steps in flight, at most steps_in_flight of them.
        limit = cfg.scheduler.steps_in_flight(cfg.resolved_device())
        # The worker's launch is looked up at each step: tests wrap it on a built engine.
        self.pipelines = [StepPipeline([s], [lambda plan, w=w: w.launch(plan)], limit, [self.seconds], "execute")
                          for s, w in zip(self.schedulers, self.workers)]
        self.mode_steps = {"extend": 0, "decode": 0}
        self.eager_steps: Counter = Counter()  # reason -> steps that left the graphs (eager_steps.py)
        self.shape_steps: Counter = Counter()  # draft shape index (PLAIN_STEP: plain) -> decode steps at it

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                    on_output=None) -> Request:
        if params.grammar is not None and not self.schedulers[0].grammar_ready:
            from serve_app.text.grammar import compiler_for
            for s in self.schedulers:
                s.set_grammar_vocab(compiler_for(self.tokenizer).vocab_json)
        req = Request(rid or f"req-{next(self._ids)}", list(prompt_ids), params, on_output)
        min(self.schedulers, key=lambda s: s.num_requests).add_request(req)
        return req

    def abort(self, rid: str) -> bool:
        return any(s.abort(rid) for s in self.schedulers)

    def abort_all(self) -> None:
        """Cancel every request, and finish the steps already launched (their outputs for
        the cancelled requests are dropped), so the engine is idle when this returns."""
        for s in self.schedulers:
            s.abort_all()
        for sched, worker, pipeline in zip(self.schedulers, self.workers, self.pipelines):
            while pipeline.in_flight:
                step = pipeline.oldest()
                sched.process_output(step.plans[0], worker.finish(step.launched[0]))

    @property
    def has_work(self) -> bool:
        """Requests to run, or a launched step to finish (its rows may all have ended)."""
        return any(s.has_work for s in self.schedulers) or any(p.in_flight for p in self.pipelines)

    @property
    def launched(self) -> int:
        """Steps launched and not yet finished, over all ranks."""
        return sum(len(p.in_flight) for p in self.pipelines)

    def step(self) -> list[RequestOutput]:
        """One finished step on every rank with work (ranks are independent without
        dp_attention); the rank's next step is launched before this one is finished."""
        events: list[RequestOutput] = []
        for sched, worker, pipeline in zip(self.schedulers, self.workers, self.pipelines):
            pipeline.fill()
            if not pipeline.in_flight:
                continue
            t1 = time.perf_counter()
            step = pipeline.oldest()
            plan = step.plans[0]
            out = worker.finish(step.launched[0])
            t2 = time.perf_counter()
            events += sched.process_output(plan, out)
            self.seconds["execute"] += t2 - t1
            self.seconds["process"] += time.perf_counter() - t2
            self.mode_steps[plan.mode] = self.mode_steps.get(plan.mode, 0) + 1
            if out.eager:
                self.eager_steps[out.eager] += 1
            if plan.mode == "decode" and (plan.use_spec or out.draft_shape == PLAIN_STEP):
                self.shape_steps[out.draft_shape] += 1
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


def release_device_memory() -> None:
    """After the caller dropped its engine: collect it (its workers hold reference cycles)
    and return its cached blocks, so the next engine in this process (its memory profile,
    or its KV cache on a GPU the last one filled) finds the memory free."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
