"""The Engine deployment: one replica = one engine = one DP group of RankActors.

The replica owns a Scheduler per DP rank (requests, lengths, KV allocators) and drives
the rank's RankActor, created in bundle 1+rank of the replica's placement group, with an
asyncio step loop: schedule -> execute on the actor -> process_output -> push each
request's RequestOutputs into its asyncio queue. `generate` is a streaming method: the
ingress calls it through `handle.options(stream=True)` and receives small merged
batches of outputs.

Errors cross to the ingress as EngineError subclasses (Serve re-raises them there,
wrapped in a RayTaskError that is also an instance of the original class).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, AsyncIterator

import ray
from ray import serve
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.rank_actor import RankActor
from configs.schema import KestrelConfig
from serve_app.detokenizer import detokenizer_factory
from serve_app.metrics import EngineGauges
from serve_app.request import Request, RequestOutput, SamplingParams
from serve_app.scheduler import Scheduler
from serve_app.tokenizer import stop_token_ids

log = logging.getLogger("kestrel.engine")

# Plans in flight per rank. Two hide the Ray round trip behind the step before it (the
# spec-v2 overlap); more would only add latency, as the worker runs them one by one.
MAX_IN_FLIGHT = 2
DRAIN_TIMEOUT_S = 30.0  # how long shutdown waits for running requests before aborting them
PING_TIMEOUT_S = 20.0  # below Serve's health_check_timeout_s (30 s by default)
GAUGE_PERIOD_S = 2.0


class EngineError(Exception):
    """A request the engine will not run; `status` is the HTTP status the ingress answers."""

    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class RequestRejected(EngineError):
    status = 400  # bad sampling params, prompt too long or empty


class QueueFull(EngineError):
    status = 503  # the ingress answers serve.queue_full_status (503 or 429 + Retry-After)


class EngineUnavailable(EngineError):
    status = 503  # shutting down, or a rank failed (Serve will replace the replica)


class _Stream:
    """Where one request's outputs wait for its `generate` generator."""

    __slots__ = ("queue", "rank", "error")

    def __init__(self, rank: int):
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.rank = rank
        self.error: str | None = None


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Several consecutive outputs of one request as one (the streaming batch)."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    return RequestOutput(
        last.rid, [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
        last.finished, last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
        [a for o in outs for a in o.accept_lengths])


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (direct construction in tests)
        return "local"


@serve.deployment(
    name="EngineDeployment",
    # build_app adds placement_group_bundles (bundle 0 this replica, 1+rank each
    # RankActor) and the STRICT_PACK strategy, both of which depend on the config.
    ray_actor_options={"num_cpus": 1},
    # Streams are long-lived: let a draining replica finish them (see __del__ as well).
    graceful_shutdown_wait_loop_s=1.0,
    graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S + 30.0,
    health_check_period_s=10.0,
    health_check_timeout_s=30.0,
)
class EngineDeployment:
    async def __init__(self, cfg: dict[str, Any]):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.cfg = cfg_obj = KestrelConfig.model_validate(cfg)
        if cfg_obj.parallel.dp_attention:
            raise NotImplementedError("parallel.dp_attention is not supported by the Serve engine yet")
        self._closing = False
        self._shutdown_started = False
        self._failed: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._replica = _replica_id()
        dp = cfg_obj.parallel.dp_size
        gpu = cfg_obj.resolved_device() == "cuda"
        # Bundle 0 holds this replica; bundle 1+rank one RankActor (build_app asks for them).
        pg = ray.util.get_current_placement_group()
        self.actors = []
        for rank in range(dp):
            opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1} if gpu else {"num_cpus": 1}
            if pg is not None and pg.bundle_count > 1 + rank:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=1 + rank)
            self.actors.append(RankActor.options(**opts).remote(cfg, rank))
        # Load the tokenizer while the actors load their models.
        from actors.models.loader import default_model_path
        from serve_app.tokenizer import load_tokenizer
        tok_task = asyncio.to_thread(load_tokenizer, cfg_obj.model.path or default_model_path())
        infos, self.tokenizer = await asyncio.gather(
            asyncio.gather(*[a.info.remote() for a in self.actors]), tok_task)
        eos = sorted(stop_token_ids(self.tokenizer, infos[0]["eos_token_ids"]))
        self.schedulers = [Scheduler(cfg_obj, info, eos, detokenizer_factory(self.tokenizer))
                           for info in infos]
        sc = cfg_obj.scheduler
        # Per rank: requests it runs plus requests it queues; more is a QueueFull.
        self._capacity = sc.max_running_requests + sc.max_queued_requests
        self._interval_s = cfg_obj.serve.stream_interval_ms / 1000.0
        self._wake = [asyncio.Event() for _ in range(dp)]
        self._loops = [asyncio.create_task(self._run_rank(r), name=f"kestrel-rank-{r}")
                       for r in range(dp)]
        self._gauges_task = asyncio.create_task(self._publish_gauges())
        log.info("engine replica %s ready: dp_size=%d, placement group %s, %s", self._replica,
                 dp, pg.id.hex() if pg is not None else None, infos[0])

    # ---- the step loop ---------------------------------------------------------------
    async def _run_rank(self, rank: int) -> None:
        sched, actor, wake = self.schedulers[rank], self.actors[rank], self._wake[rank]
        inflight: deque = deque()  # (plan, ObjectRef of its StepOutput), in dispatch order
        try:
            while True:
                # Dispatch step N+1 before consuming step N: the scheduler records planned
                # prefill chunks and allocates decode KV two windows ahead, and the actor
                # runs plans in order, so an unprocessed step never invalidates the next.
                while len(inflight) < MAX_IN_FLIGHT:
                    plan = sched.schedule()
                    if plan is None:
                        break
                    inflight.append((plan, actor.execute.remote(plan)))
                if not inflight and sched.has_work:
                    # A decode plan that preempted every running request returns None with
                    # the requests back in the queue: planning again prefills them.
                    plan = sched.schedule()
                    if plan is None:
                        raise RuntimeError("the scheduler has requests but could not plan a step")
                    inflight.append((plan, actor.execute.remote(plan)))
                if not inflight:
                    wake.clear()
                    await wake.wait()
                    continue
                plan, ref = inflight.popleft()
                out = await ref
                sched.process_output(plan, out)  # calls each request's on_output
        except asyncio.CancelledError:
            raise
        except Exception as e:  # actor died, scheduler bug: fail this rank's requests loudly
            log.exception("rank %d step loop failed", rank)
            self._failed = f"engine rank {rank} failed: {type(e).__name__}: {e}"
            for rid, stream in list(self._streams.items()):
                if stream.rank == rank:
                    stream.error = self._failed
                    if not sched.abort(rid):
                        stream.queue.put_nowait(RequestOutput(rid, [], "", True, "abort", 0, 0))

    async def _publish_gauges(self) -> None:
        try:
            gauges = EngineGauges(self.cfg.model.name)
        except Exception:  # metrics are best effort
            log.warning("engine gauges unavailable", exc_info=True)
            return
        while True:
            try:
                gauges.update(self._stats())
            except Exception:
                log.debug("gauge update failed", exc_info=True)
            await asyncio.sleep(GAUGE_PERIOD_S)

    # ---- requests ----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                       rid: str) -> AsyncIterator[RequestOutput]:
        """Run one request; yields an empty acknowledgement first (the request was
        admitted: errors are raised before it), then merged output batches, the last one
        with finished=True."""
        if self._closing:
            raise EngineUnavailable("the engine replica is shutting down; retry")
        if self._failed:
            raise EngineUnavailable(self._failed)
        try:
            params = SamplingParams(**sampling_params)
        except (TypeError, ValueError) as e:
            raise RequestRejected(str(e)) from None
        if rid in self._streams:
            raise RequestRejected(f"request id {rid!r} is already running")
        rank = min(range(len(self.schedulers)), key=lambda r: self.schedulers[r].num_requests)
        sched = self.schedulers[rank]
        if sched.num_requests >= self._capacity:
            raise QueueFull(f"the engine queue is full ({sched.num_requests} requests)")
        stream = _Stream(rank)
        req = Request(rid, [int(t) for t in prompt_ids], params, on_output=stream.queue.put_nowait)
        try:
            sched.add_request(req)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        self._streams[rid] = stream
        self._wake[rank].set()
        try:
            yield RequestOutput(rid, [], "", False, None, len(req.prompt_ids), 0)
            last_sent = 0.0
            while True:
                outs = [await stream.queue.get()]
                if self._interval_s > 0 and not outs[-1].finished:
                    # Batch what arrives within the interval (the first batch goes at once).
                    delay = last_sent + self._interval_s - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                while not stream.queue.empty():
                    outs.append(stream.queue.get_nowait())
                if stream.error:
                    raise EngineUnavailable(stream.error)
                out = merge_outputs(outs)
                last_sent = time.monotonic()
                yield out
                if out.finished:
                    return
        finally:
            # Reached with CancelledError/GeneratorExit when the client went away: abort
            # so the request's KV is freed now rather than when it would have finished.
            self._streams.pop(rid, None)
            if not req.finished and sched.abort(rid):
                self._wake[rank].set()

    async def abort(self, rid: str) -> bool:
        stream = self._streams.get(rid)
        return stream is not None and self.schedulers[stream.rank].abort(rid)

    # ---- health, stats, shutdown -------------------------------------------------------
    async def check_health(self) -> None:
        if self._failed:
            raise RuntimeError(self._failed)
        for r, task in enumerate(self._loops):
            if task.done():
                raise RuntimeError(f"the step loop of rank {r} stopped")
        await asyncio.wait_for(asyncio.gather(*[a.ping.remote() for a in self.actors]),
                               timeout=PING_TIMEOUT_S)

    # The read-only calls below are `async` on purpose: Serve runs a deployment's plain
    # `def` methods in a thread pool, and the scheduler state is only safe to read from
    # the event loop that mutates it.
    async def kv_stats(self) -> list[dict[str, int]]:
        return self._kv_stats()

    async def rank_stats(self) -> list[dict[str, Any]]:
        """Per DP rank: requests held now and the scheduler's counters."""
        return [{"rank": r, "requests": s.num_requests, **s.stats} for r, s in enumerate(self.schedulers)]

    async def num_running(self) -> int:
        """Requests this replica holds (queued, prefilling or decoding)."""
        return self._num_requests()

    async def stats(self) -> dict[str, Any]:
        return self._stats()

    def _kv_stats(self) -> list[dict[str, int]]:
        return [{"rank": r, "free": s.kv_free_slots(), "capacity": s.slots.capacity}
                for r, s in enumerate(self.schedulers)]

    def _num_requests(self) -> int:
        return sum(s.num_requests for s in self.schedulers)

    def _stats(self) -> dict[str, Any]:
        return {"replica": self._replica,
                "running": sum(len(s.running) + len(s.prefilling) for s in self.schedulers),
                "waiting": sum(len(s.waiting) for s in self.schedulers),
                "kv": self._kv_stats(),
                "prompt_tokens_cached": sum(s.stats["prompt_tokens_cached"] for s in self.schedulers),
                "prompt_tokens_computed": sum(s.stats["prompt_tokens_computed"] for s in self.schedulers)}

    def __del__(self):
        # Serve calls this on the replica's event loop during graceful shutdown (after it
        # has drained the replica's ongoing calls) and awaits the coroutine returned. Any
        # later call, e.g. from the garbage collector, has nothing left to do.
        if getattr(self, "_shutdown_started", True):
            return None
        self._shutdown_started = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._stop()
            return None
        return self._drain_and_stop()

    async def _drain_and_stop(self) -> None:
        self._closing = True  # new requests get EngineUnavailable (503): retry elsewhere
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self._num_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self._num_requests():
            log.warning("shutdown: aborting %d requests still running after %.0fs",
                        self._num_requests(), DRAIN_TIMEOUT_S)
        self._stop()

    def _stop(self) -> None:
        for s in getattr(self, "schedulers", []):
            for rid in list(s.requests):
                s.abort(rid)
        for task in getattr(self, "_loops", []) + [getattr(self, "_gauges_task", None)]:
            if task is not None:
                task.cancel()
        for a in getattr(self, "actors", []):
            try:
                ray.kill(a)
            except Exception:
                pass
