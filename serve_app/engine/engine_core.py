"""The engine core: each DP rank's scheduler and step loop, in a process of their own.

When the step loops shared the replica's event loop with the HTTP handlers, every
stream's chunk (detokenization, SSE, a socket write: 120-180 us on the 2-core CPU) ran
between two steps, and at 64 streams that work outgrew a step: the GPU waited ~1.4 ms per
5 ms step on the H200 for its next plan. As in vLLM's engine core, the loops now run in
a Ray actor of their own (EngineCoreActor, in the replica's placement group) that does
nothing but steps; the replica's front end (serve_app/engine/engine_client.py) sends it requests
over the front channel and gets back one frame per step with every request's new tokens.
When the front end falls behind, its streams carry several steps per chunk; the GPU does
not wait for it.

One step loop per rank: schedule -> send the plan down the rank's step channel (the next
plan goes out before this one returns) -> receive the output -> process_output -> one
Outputs frame to the front end; the planning ahead is the StepPipeline the in-process
engine runs too (serve_app/engine/step_pipeline.py). Under parallel.dp_attention the ranks step in lockstep
(their collectives must line up): one loop sends every rank a plan each step, an idle
one where a rank's scheduler has none, and takes the step's outputs together; a new
request goes to the rank with the least load (requests held, then KV in use), and a
rank that fails fails the whole replica, whose ranks cannot step without it.

The front channel's messages (AddRequest, FinishRequest, GrammarVocab, StatsQuery in; one
Outputs per step, StatsReply, Rejected, RanksFailed out) are defined, with the step
channel's, in actors/protocol/messages.py.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import time
from collections import Counter
from typing import Any

import ray

from actors.protocol.messages import (CORE_RECEIVES_FROM_FRONT, AddRequest, FinishRequest,
                                      GrammarVocab, Hello, Outputs, RanksFailed, Ready, Rejected,
                                      RequestOutput, Stats, StatsQuery, StatsReply, encode,
                                      read_message)
from actors.protocol.step_plan import PLAIN_STEP, StepOutput, StepPlan
from actors.worker import gc_pauses
from configs.schema import KestrelConfig
from serve_app.engine.draft_policy import PLAIN_NAME, shape_name
from serve_app.engine.rank_channel import RankChannel
from serve_app.engine.request import Request
from serve_app.engine.scheduler import Scheduler
from serve_app.engine.step_pipeline import StepPipeline

log = logging.getLogger("kestrel.engine")

# dp_attention: once a rank failed, how long its peers get to report their own failure
# (theirs follows from it), so the error names the cause: a rank that is gone.
FAILURE_GRACE_S = 1.0
# A step this long, and this many times the usual step of its mode and size, stalled
# every stream of its rank: it is logged with its parts, to tell the stall's cause (the
# rank's host, the device, a compile, the collector) from the log (_note_slow).
SLOW_STEP_S, SLOW_STEP_TIMES = 0.1, 5.0
STEP_PHASES = ("schedule", "process", "execute", "wait", "recv", "compile", "gc", "gpu_idle")


class EngineCore:
    def __init__(self, cfg: KestrelConfig, infos: list[dict], channels: list[RankChannel],
                 eos_token_ids: list[int]):
        """`infos`: each rank's RankWorker.info(); `channels`: connected, one per rank;
        `eos_token_ids`: the model's and the tokenizer's. Call on the event loop that
        will run the steps."""
        self.cfg = cfg
        # Plans in flight per rank: the running one and the next, queued in its channel, so
        # the worker starts step N+1 the moment step N returns (scheduler.launch_ahead).
        self.max_in_flight = cfg.scheduler.steps_in_flight()
        self.channels = channels
        self.schedulers = [Scheduler(cfg, info, eos_token_ids) for info in infos]
        self.memory = [info.get("memory") for info in infos]  # per rank: its MemoryPlan (GPU)
        self.token = secrets.token_hex(16)
        self.writer: asyncio.StreamWriter | None = None
        self._outbox: list[RequestOutput] = []  # this step's outputs, sent as one frame
        # Per rank: seconds in each phase of a step (schedule and process here; execute,
        # wait, recv and gpu_idle as the actor measured them), and steps by mode. `wait`
        # and `gpu_idle` count only plans sent while another was in flight: the time the
        # channel, and the GPU by its own clock, sat idle waiting on the control plane
        # although the next step could have been queued.
        self.step_seconds = [dict.fromkeys(STEP_PHASES, 0.0) for _ in infos]
        self.gc = gc_pauses.watch()
        # (rank, mode) and (rank, mode, size bucket) -> a step's moving mean, s (_note_slow)
        self._usual_step: dict[tuple, float] = {}
        self.step_counts = [{"extend": 0, "decode": 0, "mixed": 0, "pipelined": 0} for _ in infos]
        self.eager_steps = [Counter() for _ in infos]  # per rank: reason -> steps (eager_steps.py)
        self.shape_steps = [Counter() for _ in infos]  # per rank: draft shape label -> speculative steps
        self.shape_names = [shape_name(s) for s in cfg.draft.shapes()]
        self.failed: str | None = None
        if cfg.parallel.dp_attention:  # one loop for the group: any rank's request wakes it
            wake = asyncio.Event()
            self._wake = [wake] * len(infos)
            group = self._run(list(range(len(infos))), wake, "the engine's rank group")
            self.loops = [asyncio.create_task(group, name="kestrel-ranks")]
        else:
            self._wake = [asyncio.Event() for _ in infos]
            self.loops = [asyncio.create_task(self._run([r], self._wake[r], f"engine rank {r}"),
                                              name=f"kestrel-rank-{r}") for r in range(len(infos))]

    # ---- the front channel -------------------------------------------------------------
    async def listen(self, host: str) -> tuple[str, int]:
        """Serve one front end at a time on a free port of `host`."""
        self.server = await asyncio.start_server(self._front, host, 0)
        return host, self.server.sockets[0].getsockname()[1]

    async def _front(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        expected = encode(Hello(self.token))
        try:  # compared as bytes: nothing from an unknown peer is unpickled
            hello = await reader.readexactly(len(expected))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if not hmac.compare_digest(hello, expected):
            log.warning("front channel: a connection without the core's token was refused")
            writer.close()
            return
        self.writer = writer
        writer.write(encode(Ready()))
        answers = {Stats.KV: self.kv_stats, Stats.RANKS: self.rank_stats, Stats.ENGINE: self.stats}
        try:
            while True:
                message = await read_message(reader, CORE_RECEIVES_FROM_FRONT)
                if isinstance(message, AddRequest):
                    self._add(message)
                elif isinstance(message, FinishRequest):
                    for rank, s in enumerate(self.schedulers):
                        if s.finish(message.rid, message.reason):
                            self._wake[rank].set()
                elif isinstance(message, GrammarVocab):  # before the first request with a grammar
                    for s in self.schedulers:
                        s.set_grammar_vocab(message.vocab_json)
                elif isinstance(message, StatsQuery):
                    writer.write(encode(StatsReply(message.call_id, answers[message.stats]())))
                self._flush()  # aborts answered at once
        except (asyncio.IncompleteReadError, ConnectionError):
            log.warning("front channel closed: aborting every request")
            for s in self.schedulers:
                s.abort_all()
            self._outbox.clear()
            self.writer = None

    def _send(self, message: Any) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(encode(message))

    def _flush(self) -> None:
        if self._outbox:
            self._send(Outputs(self._outbox))  # encoded at once: the list can be reused
            self._outbox.clear()

    def _add(self, add: AddRequest) -> None:
        rank = add.rank
        try:
            req = Request(add.rid, add.prompt_ids, add.params, on_output=self._outbox.append)
            if rank is None:  # dp_attention: the core places it, by the ranks' loads
                rank = min(range(len(self.schedulers)), key=lambda r: self.schedulers[r].load())
            self.schedulers[rank].add_request(req)
        except ValueError as e:  # the front end checked; say so if it missed
            self._send(Rejected(add.rid, str(e)))
            return
        self._wake[rank].set()

    # ---- calls -------------------------------------------------------------------------
    def kv_stats(self) -> list[dict[str, int]]:
        return [{"rank": r, "free": s.kv_free_slots(), "capacity": s.slots.capacity}
                for r, s in enumerate(self.schedulers)]

    def rank_stats(self) -> list[dict[str, Any]]:
        """Per DP rank: requests held now, the scheduler's counters, step phase seconds."""
        return [{"rank": r, "requests": s.num_requests, **s.stats,
                 "step_seconds": dict(self.step_seconds[r]), "steps": dict(self.step_counts[r]),
                 "eager_steps": dict(self.eager_steps[r]), "draft_shape_steps": dict(self.shape_steps[r])}
                for r, s in enumerate(self.schedulers)]

    def stats(self) -> dict[str, Any]:
        scheds = self.schedulers
        return {"running": sum(len(s.running) + len(s.prefilling) for s in scheds),
                "waiting": sum(len(s.waiting) for s in scheds),
                "kv": self.kv_stats(),
                "memory": [{"rank": r, **m} for r, m in enumerate(self.memory) if m],
                "prompt_tokens_cached": sum(s.stats["prompt_tokens_cached"] for s in scheds),
                "prompt_tokens_computed": sum(s.stats["prompt_tokens_computed"] for s in scheds),
                "step_seconds": {p: sum(s[p] for s in self.step_seconds) for p in STEP_PHASES},
                "eager_steps": dict(sum(self.eager_steps, Counter())),
                "draft_shape_steps": dict(sum(self.shape_steps, Counter())),
                "draft_accept": [{"rank": r, "shape": shape, "value": v}
                                 for r, s in enumerate(scheds) if s.draft_policy is not None
                                 for shape, v in s.draft_policy.estimates().items()],
                "draft_period": [{"rank": r, "shape": shape, "batch": batch, "value": v}
                                 for r, s in enumerate(scheds) if s.draft_policy is not None
                                 for shape, batch, v in s.draft_policy.periods_measured()],
                "prefill_period": [{"rank": r, "value": s.extend_period}
                                   for r, s in enumerate(scheds) if s.extend_period],
                "steps": {k: sum(c[k] for c in self.step_counts)
                          for k in ("extend", "decode", "mixed", "pipelined")}}

    def check(self) -> None:
        """Raises if a rank failed or a step loop stopped."""
        if self.failed:
            raise RuntimeError(self.failed)
        for r, task in enumerate(self.loops):
            if task.done():
                which = "of the ranks" if self.cfg.parallel.dp_attention else f"of rank {r}"
                raise RuntimeError(f"the step loop {which} stopped")

    # ---- the step loop ---------------------------------------------------------------
    async def _run(self, ranks: list[int], wake: asyncio.Event, who: str) -> None:
        """The step loop of one rank, or under dp_attention of every rank in lockstep (an
        idle plan where a rank's scheduler has none, so the ranks' collectives line up):
        plans sent ahead through a StepPipeline, outputs committed in send order."""
        channels = [self.channels[r] for r in ranks]
        pipeline = StepPipeline([self.schedulers[r] for r in ranks], [ch.send for ch in channels],
                                self.max_in_flight, [self.step_seconds[r] for r in ranks], "schedule")
        try:
            while True:
                pipeline.fill()
                if not pipeline.in_flight:
                    wake.clear()
                    await wake.wait()
                    continue
                outs = await self._recv_all(channels)
                step = pipeline.oldest()
                for rank, plan, out in zip(ranks, step.plans, outs):
                    if plan.mode != "idle":
                        self._process(rank, plan, out, step.pipelined)
                self._flush()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # actor died, scheduler bug: fail these ranks' requests loudly
            self._fail(e, who, ranks)

    def _process(self, rank: int, plan: StepPlan, out: StepOutput, pipelined: bool) -> None:
        """A step's output on `rank`: lengths committed, outputs into the outbox, timings."""
        seconds, counts = self.step_seconds[rank], self.step_counts[rank]
        t1 = time.perf_counter()
        self.schedulers[rank].process_output(plan, out)  # each request's outputs into the outbox
        seconds["process"] += time.perf_counter() - t1
        timings = out.timings
        seconds["execute"] += timings.get(plan.mode, 0.0)
        self._note_slow(rank, plan, timings)
        seconds["recv"] += timings.get("recv", 0.0)
        seconds["compile"] += timings.get("compile", 0.0)
        # The collector's passes on the rank and in this process (one watch per process:
        # when both run in one, the rank's timings took them already).
        seconds["gc"] += timings.get("gc", 0.0) + self.gc.take_seconds()
        counts[plan.mode] += 1
        if out.eager:
            self.eager_steps[rank][out.eager] += 1
        if plan.mode == "decode" and (plan.use_spec or out.draft_shape == PLAIN_STEP):
            name = PLAIN_NAME if out.draft_shape == PLAIN_STEP else self.shape_names[out.draft_shape]
            self.shape_steps[rank][name] += 1
        if pipelined:
            seconds["wait"] += timings.get("wait", 0.0)
            seconds["gpu_idle"] += timings.get("gpu_idle", 0.0)
            counts["pipelined"] += 1

    def _note_slow(self, rank: int, plan: StepPlan, timings: dict[str, float]) -> None:
        """Log a step far slower than the usual one of its mode and size (rows of a
        decode, prompt tokens of an extend, by powers of two; a size not met before is
        held to its mode's usual), with the parts the rank timed."""
        took = timings.get(plan.mode, 0.0)
        extend = plan.mode != "decode"  # sized by its prompt tokens (a mixed step's too)
        size = sum(plan.extend_lens) if extend else len(plan.rows)
        by_mode, by_size = (rank, plan.mode), (rank, plan.mode, size.bit_length())
        usual = self._usual_step.get(by_size, self._usual_step.get(by_mode, took))
        if took >= max(SLOW_STEP_S, SLOW_STEP_TIMES * usual):
            log.warning("rank %d: a slow %s step (%d rows%s), usually %.1f ms: %s ms", rank, plan.mode,
                        len(plan.rows), f", {size} tokens" if extend else "", 1000 * usual,
                        {k: round(1000 * v, 1) for k, v in timings.items()})
        for key in (by_mode, by_size):
            self._usual_step[key] = 0.9 * self._usual_step.get(key, took) + 0.1 * took

    def _fail(self, e: Exception, who: str, ranks: list[int]) -> None:
        """`ranks` cannot step any more: their requests fail with what went wrong."""
        log.exception("%s step loop failed%s", who,
                      f"; the rank's traceback:\n{e.detail}" if getattr(e, "detail", "") else "")
        # Clients see this message: what failed, without the insides (class, traceback).
        self.failed = f"{who} failed: {str(e) or 'an error without a message'}"
        # One rank's streams, or (None) every stream of the replica.
        self._send(RanksFailed(ranks[0] if len(ranks) == 1 else None, self.failed))
        for r in ranks:
            self.schedulers[r].abort_all()
        self._outbox.clear()  # the front end fails those streams itself

    @staticmethod
    async def _recv_all(channels: list[RankChannel]) -> list[StepOutput]:
        """Each channel's output of the oldest step in flight. Under dp_attention a rank's
        failure fails its peers too (their collectives lose it: at once when it died, after
        parallel.dp_timeout_s when it hangs); what is raised is the failure that explains
        the others: a rank whose channel closed, else the first."""
        if len(channels) == 1:
            return [await channels[0].recv()]
        tasks = [asyncio.ensure_future(ch.recv()) for ch in channels]
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if pending:
                await asyncio.wait(pending, timeout=FAILURE_GRACE_S)
        finally:  # also when the loop is cancelled (stop)
            for task in tasks:
                task.cancel()
        errors = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if errors:
            closed = [e for e in errors if getattr(e, "closed", False)]
            raise (closed or errors)[0]
        return [t.result() for t in tasks]

    def stop(self) -> None:
        for task in self.loops:
            task.cancel()
        for ch in self.channels:
            ch.close()
        if getattr(self, "server", None) is not None:
            self.server.close()


@ray.remote
class EngineCoreActor:
    """EngineCore as a Ray actor, placed by its replica beside itself (bundle 0 of the
    replica's placement group). Async: the step loops and the front channel run on the
    actor's event loop between (and during) its method calls."""

    def __init__(self, cfg: dict[str, Any]):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.cfg = KestrelConfig.model_validate(cfg)
        self.core: EngineCore | None = None

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    async def start(self, infos: list[dict], eos_token_ids: list[int], front_ip: str) -> dict:
        """Connect to every rank's step channel, start the step loops, listen for the
        front end (on loopback when it runs on this node); returns where and the token."""
        channels = [await RankChannel.connect(i["channel"]["host"], i["channel"]["port"],
                                              i["channel"]["token"], r)
                    for r, i in enumerate(infos)]
        self.core = EngineCore(self.cfg, infos, channels, eos_token_ids)
        ip = ray.util.get_node_ip_address()
        host, port = await self.core.listen("127.0.0.1" if front_ip == ip else ip)
        gc_pauses.serving("engine core", self.cfg.serve.gc_freeze)
        return {"host": host, "port": port, "token": self.core.token}

    async def check(self) -> None:
        self.core.check()

    async def gc_stats(self) -> dict[str, int]:
        return gc_pauses.stats()
