"""The Serve engine's core, without Serve: schedulers, step channels, step loops, streams.

One asyncio task per DP rank runs that rank's steps: schedule -> send the plan down the
rank's step channel -> (the next plan goes out before this one returns) -> receive the
output -> process_output, which pushes each request's new token ids into its
RequestStream. Detokenization, stop strings and SSE formatting happen in the consumers,
after the next plan is already on its way.

The EngineDeployment (serve_app/engine_deployment.py) creates the RankActors and wraps
this class; the HTTP front end (serve_app/openai_server.py) calls `add_request` directly,
in the same process and event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Awaitable, Callable

from configs.schema import KestrelConfig
from serve_app.detokenizer import TextStream
from serve_app.rank_channel import RankChannel
from serve_app.request import Request, RequestOutput, SamplingParams
from serve_app.request_stream import RequestStream
from serve_app.scheduler import Scheduler
from serve_app.tokenizer import stop_token_ids

log = logging.getLogger("kestrel.engine")

# Plans in flight per rank: the running one and the next, queued in its channel, so the
# worker starts step N+1 the moment step N returns. The scheduler plans KV two windows
# ahead for exactly this; a third would only add latency.
MAX_IN_FLIGHT = 2


class EngineError(Exception):
    """A request the engine will not run; `status` is the HTTP status to answer."""

    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class RequestRejected(EngineError):
    status = 400  # bad sampling params, prompt too long or empty


class QueueFull(EngineError):
    status = 503  # answered as serve.queue_full_status (503 or 429 + Retry-After)


class EngineUnavailable(EngineError):
    status = 503  # shutting down, or a rank failed (Serve will replace the replica)


STEP_PHASES = ("schedule", "process", "execute", "wait", "recv")


class AsyncEngine:
    def __init__(self, cfg: KestrelConfig, infos: list[dict], channels: list[RankChannel],
                 tokenizer: Any, ping: Callable[[], Awaitable[None]] | None = None,
                 replica: str = "local"):
        """`infos`: each rank's RankWorker.info(); `ping`: checks that the rank actors
        answer (the health check); `replica`: this replica's name in stats."""
        self.cfg = cfg
        self.ping = ping
        self.replica = replica
        self.tokenizer = tokenizer
        self.channels = channels
        eos = sorted(stop_token_ids(tokenizer, infos[0]["eos_token_ids"]))
        # The schedulers make no text: the request streams do, off the step loop.
        self.schedulers = [Scheduler(cfg, info, eos) for info in infos]
        sc = cfg.scheduler
        self.capacity = sc.max_running_requests + sc.max_queued_requests  # per rank
        self.interval_s = cfg.serve.stream_interval_ms / 1000.0
        self.streams: dict[str, RequestStream] = {}
        self.closing = False
        self.failed: str | None = None
        # Per rank: seconds in each phase of a step (schedule and process on this loop;
        # execute, wait and recv as the actor measured them), and steps by mode. `wait`
        # counts only plans sent while another was in flight: the time the GPU sat idle
        # waiting on the control plane although the next step could have been queued.
        self.step_seconds = [dict.fromkeys(STEP_PHASES, 0.0) for _ in infos]
        self.step_counts = [{"extend": 0, "decode": 0, "pipelined": 0} for _ in infos]
        self._wake = [asyncio.Event() for _ in infos]
        self.loops = [asyncio.create_task(self._run_rank(r), name=f"kestrel-rank-{r}")
                      for r in range(len(infos))]

    # ---- the step loop ---------------------------------------------------------------
    async def _run_rank(self, rank: int) -> None:
        sched, channel, wake = self.schedulers[rank], self.channels[rank], self._wake[rank]
        seconds, counts = self.step_seconds[rank], self.step_counts[rank]
        inflight: deque = deque()  # (plan, sent while another was in flight), in send order
        try:
            while True:
                t0 = time.perf_counter()
                while len(inflight) < MAX_IN_FLIGHT:
                    plan = sched.schedule()
                    if plan is None:
                        break
                    channel.send(plan)
                    inflight.append((plan, bool(inflight)))
                if not inflight and sched.has_work:
                    # A decode plan that preempted every running request returns None with
                    # the requests back in the queue: planning again prefills them.
                    plan = sched.schedule()
                    if plan is None:
                        raise RuntimeError("the scheduler has requests but could not plan a step")
                    channel.send(plan)
                    inflight.append((plan, False))
                seconds["schedule"] += time.perf_counter() - t0
                if not inflight:
                    wake.clear()
                    await wake.wait()
                    continue
                out = await channel.recv()
                plan, pipelined = inflight.popleft()
                t1 = time.perf_counter()
                sched.process_output(plan, out)  # pushes into each request's stream
                seconds["process"] += time.perf_counter() - t1
                timings = out.timings
                seconds["execute"] += timings.get(plan.mode, 0.0)
                seconds["recv"] += timings.get("recv", 0.0)
                counts[plan.mode] = counts.get(plan.mode, 0) + 1
                if pipelined:
                    seconds["wait"] += timings.get("wait", 0.0)
                    counts["pipelined"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # actor died, scheduler bug: fail this rank's requests loudly
            log.exception("rank %d step loop failed", rank)
            self.failed = f"engine rank {rank} failed: {type(e).__name__}: {e}"
            for stream in list(self.streams.values()):
                if stream.rank == rank:
                    stream.fail(self.failed)
            sched.abort_all()

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                    rid: str) -> RequestStream:
        """Admit one request (raising an EngineError if it cannot run) and return the
        stream its outputs arrive on; the last output has finished=True."""
        if self.closing:
            raise EngineUnavailable("the engine replica is shutting down; retry")
        if self.failed:
            raise EngineUnavailable(self.failed)
        try:
            params = SamplingParams(**sampling_params)
        except (TypeError, ValueError) as e:
            raise RequestRejected(str(e)) from None
        if rid in self.streams:
            raise RequestRejected(f"request id {rid!r} is already running")
        rank = min(range(len(self.schedulers)), key=lambda r: self.schedulers[r].num_requests)
        sched = self.schedulers[rank]
        if sched.num_requests >= self.capacity:
            raise QueueFull(f"the engine queue is full ({sched.num_requests} requests)")
        prompt = [int(t) for t in prompt_ids]
        text = TextStream(self.tokenizer, prompt, params.stop) if self.tokenizer is not None else None
        stream = RequestStream(rid, rank, len(prompt), text, self._end, self.interval_s)
        req = Request(rid, prompt, params, on_output=stream.push)
        try:
            sched.add_request(req)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        self.streams[rid] = stream
        self._wake[rank].set()
        return stream

    def _end(self, rid: str, reason: str | None) -> None:
        """A stream ended (RequestStream calls this once); "stop"/"abort" end the request."""
        stream = self.streams.pop(rid, None)
        if stream is not None and reason is not None and self.schedulers[stream.rank].finish(rid, reason):
            self._wake[stream.rank].set()

    def abort(self, rid: str) -> bool:
        stream = self.streams.get(rid)
        return stream is not None and self.schedulers[stream.rank].abort(rid)

    # ---- state ---------------------------------------------------------------------------
    def num_requests(self) -> int:
        return sum(s.num_requests for s in self.schedulers)

    def kv_stats(self) -> list[dict[str, int]]:
        return [{"rank": r, "free": s.kv_free_slots(), "capacity": s.slots.capacity}
                for r, s in enumerate(self.schedulers)]

    def rank_stats(self) -> list[dict[str, Any]]:
        """Per DP rank: requests held now, the scheduler's counters, step phase seconds."""
        return [{"rank": r, "requests": s.num_requests, **s.stats,
                 "step_seconds": dict(self.step_seconds[r]), "steps": dict(self.step_counts[r])}
                for r, s in enumerate(self.schedulers)]

    def stats(self) -> dict[str, Any]:
        scheds = self.schedulers
        return {"replica": self.replica,
                "running": sum(len(s.running) + len(s.prefilling) for s in scheds),
                "waiting": sum(len(s.waiting) for s in scheds),
                "kv": self.kv_stats(),
                "prompt_tokens_cached": sum(s.stats["prompt_tokens_cached"] for s in scheds),
                "prompt_tokens_computed": sum(s.stats["prompt_tokens_computed"] for s in scheds),
                "step_seconds": {p: sum(s[p] for s in self.step_seconds) for p in STEP_PHASES},
                "steps": {k: sum(c.get(k, 0) for c in self.step_counts)
                          for k in ("extend", "decode", "pipelined")}}

    async def check_health(self) -> None:
        """Raises if a rank failed, a step loop stopped, or an actor does not answer."""
        if self.failed:
            raise RuntimeError(self.failed)
        for r, task in enumerate(self.loops):
            if task.done():
                raise RuntimeError(f"the step loop of rank {r} stopped")
        if self.ping is not None:
            await self.ping()

    # ---- shutdown ------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests and wait up to `timeout_s` for the running ones."""
        self.closing = True
        deadline = time.monotonic() + timeout_s
        while self.num_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.num_requests():
            log.warning("shutdown: aborting %d requests still running after %.0fs",
                        self.num_requests(), timeout_s)

    def stop(self) -> None:
        for s in self.schedulers:
            s.abort_all()
        for task in self.loops:
            task.cancel()
        for ch in self.channels:
            ch.close()
