"""The front end's engine: admits requests and streams their outputs, in the replica.

It runs on the event loop of the HTTP front end and talks to the engine core (the
schedulers and step loops, serve_app/engine/engine_core.py, in their own process) over the
front channel: a request goes out as one frame, and each step's outputs come back as one
frame, which `_read` spreads over the requests' RequestStreams. Detokenization, stop
strings and SSE formatting happen in the streams' consumers, here, off the steps' path.
Admission (queue limits, the prompt's length, sampling parameters) is decided here, on
counts this side keeps, so a full queue is answered without a round trip.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Awaitable, Callable

from actors.protocol.messages import (FRONT_RECEIVES, AddRequest, FinishRequest, GrammarVocab,
                                      Outputs, RanksFailed, Rejected, Stats, StatsQuery, StatsReply,
                                      WireError, encode, open_channel, read_message)
from actors.protocol.sampling_params import SamplingParams
from configs.schema import KestrelConfig
from serve_app.text.detokenizer import TextStream
from serve_app.text.grammar import compiler_for
from serve_app.engine.request_stream import RequestStream
from serve_app.engine.scheduler import check_prompt

log = logging.getLogger("kestrel.engine")


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


class EngineClient:
    def __init__(self, cfg: KestrelConfig, num_ranks: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, tokenizer: Any,
                 ping: Callable[[], Awaitable[None]] | None = None, replica: str = "local",
                 vocab_at_ranks: bool = False):
        """`reader`/`writer`: the front channel, connected (see `connect`); `ping`: checks
        the core and the rank actors (the health check); `replica`: its name in stats;
        `vocab_at_ranks`: the ranks were given the grammar vocabulary at start-up."""
        self.cfg = cfg
        self.reader, self.writer = reader, writer
        self.tokenizer = tokenizer
        self.ping = ping
        self.replica = replica
        sc = cfg.scheduler
        # Under dp_attention the core places each request by the ranks' loads: one count
        # here, against the whole group's capacity (the least loaded rank is then below its own).
        self.lockstep = cfg.parallel.dp_attention
        self.capacity = sc.held_per_rank * (num_ranks if self.lockstep else 1)
        self.interval_s = cfg.serve.stream_interval_ms / 1000.0
        self.streams: dict[str, RequestStream] = {}
        self.held = [0] * (1 if self.lockstep else num_ranks)  # streams per rank that have not ended
        self.closing = False
        self.failed: str | None = None
        self.vocab_at_ranks = vocab_at_ranks
        self._vocab_sent = False  # the grammar vocabulary (serve_app/text/grammar.py), sent once
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.reading = asyncio.create_task(self._read(), name="kestrel-front-channel")

    @classmethod
    async def connect(cls, cfg: KestrelConfig, num_ranks: int, host: str, port: int, token: str,
                      tokenizer: Any, timeout_s: float = 60.0, **kw) -> "EngineClient":
        try:
            reader, writer = await asyncio.wait_for(open_channel(host, port, token, FRONT_RECEIVES),
                                                    timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            raise EngineUnavailable(f"could not open the front channel to the engine core at "
                                    f"{host}:{port} ({type(e).__name__}: {e})") from None
        return cls(cfg, num_ranks, reader, writer, tokenizer, **kw)

    # ---- from the core -----------------------------------------------------------------
    async def _read(self) -> None:
        try:
            while True:
                message = await read_message(self.reader, FRONT_RECEIVES)
                if isinstance(message, Outputs):
                    streams = self.streams
                    for out in message.outputs:
                        stream = streams.get(out.rid)
                        if stream is not None:
                            stream.push(out)
                elif isinstance(message, StatsReply):
                    fut = self._calls.pop(message.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(message.value)
                elif isinstance(message, Rejected):
                    if message.rid in self.streams:
                        self.streams[message.rid].fail(message.message)
                elif isinstance(message, RanksFailed):
                    self._fail(message.message, message.rank)
        except WireError as e:
            self._fail(f"the front channel to the engine core failed: {e}")
        except (asyncio.IncompleteReadError, ConnectionError):
            self._fail("the engine core closed its channel (it died or was killed)")

    def _fail(self, message: str, rank: int | None = None) -> None:
        self.failed = message
        for stream in list(self.streams.values()):
            if rank is None or stream.rank == rank:
                stream.fail(message)
        if rank is None:
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(EngineUnavailable(message))

    def _send(self, message: Any) -> None:
        if self.writer.is_closing():
            raise EngineUnavailable(self.failed or "the front channel to the engine core is closed")
        self.writer.write(encode(message))

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
            prompt = [int(t) for t in prompt_ids]
            check_prompt(prompt, self.cfg.model.max_model_len)
            if self.lockstep and params.prompt_logprobs is not None:
                # Its extra LM-head calls on one rank would not line up with the others'.
                raise ValueError("prompt_logprobs (and echo with logprobs) is not available "
                                 "with parallel.dp_attention")
        except (TypeError, ValueError) as e:
            raise RequestRejected(str(e)) from None
        if rid in self.streams:
            raise RequestRejected(f"request id {rid!r} is already running")
        rank = min(range(len(self.held)), key=self.held.__getitem__)
        if self.held[rank] >= self.capacity:
            raise QueueFull(f"the engine queue is full ({self.held[rank]} requests)")
        if params.grammar is not None and not self._vocab_sent:  # once: the core keeps it
            # None when the ranks hold it: the core only learns that grammars may come.
            self._send(GrammarVocab(None if self.vocab_at_ranks else compiler_for(self.tokenizer).vocab_json))
            self._vocab_sent = True
        text = TextStream(self.tokenizer, prompt, params.stop) if self.tokenizer is not None else None
        stream = RequestStream(rid, rank, len(prompt), text, self._end, self.interval_s)
        self._send(AddRequest(rid, prompt, params, None if self.lockstep else rank))
        self.streams[rid] = stream
        self.held[rank] += 1
        return stream

    def _end(self, rid: str, reason: str | None) -> None:
        """A stream ended (RequestStream calls this once); "stop"/"abort" end the request."""
        stream = self.streams.pop(rid, None)
        if stream is None:
            return
        self.held[stream.rank] -= 1
        if reason is not None and not self.writer.is_closing():
            self.writer.write(encode(FinishRequest(rid, reason)))

    # ---- state ---------------------------------------------------------------------------
    def num_requests(self) -> int:
        """Requests admitted whose streams have not ended."""
        return sum(self.held)

    async def _query(self, stats: Stats) -> Any:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(StatsQuery(call_id, stats))
        return await fut

    async def kv_stats(self) -> list[dict[str, int]]:
        return await self._query(Stats.KV)

    async def rank_stats(self) -> list[dict[str, Any]]:
        return await self._query(Stats.RANKS)

    async def stats(self) -> dict[str, Any]:
        return {"replica": self.replica, **(await self._query(Stats.ENGINE))}

    async def check_health(self) -> None:
        """Raises if a rank or the core failed, or an actor does not answer."""
        if self.failed:
            raise RuntimeError(self.failed)
        if self.reading.done():
            raise RuntimeError("the front channel to the engine core is closed")
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
        self._fail("the engine replica stopped")
        self.reading.cancel()
        self.writer.close()
