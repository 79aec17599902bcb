"""One request's outputs on their way from the step loop to the code that answers it.

The step loop only appends each step's token ids (`push`) and wakes the consumer. The
consumer, when it next runs, takes everything that arrived, detokenizes it and checks the
stop strings: text work happens after the next plan went out, once per batch the
consumer takes rather than once per step, and a consumer that lags takes several steps
in one go. With `interval_s` (serve.stream_interval_ms) the consumer waits out the rest
of the interval after each batch; the first batch always goes at once.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from actors.protocol.messages import RequestOutput
from serve_app.text.detokenizer import TextStream
from serve_app.engine.request import text_ids


class StreamFailed(Exception):
    """The engine rank running this request failed; the message says why."""


class RequestStream:
    def __init__(self, rid: str, rank: int, num_prompt_tokens: int, text: TextStream | None,
                 end: Callable[[str, str | None], None], interval_s: float = 0.0):
        """`end(rid, reason)` is called once, when the stream ends: reason "stop" (a stop
        string was seen) or "abort" (the consumer went away) also end the request in
        its scheduler; None means it had already ended there."""
        self.rid = rid
        self.rank = rank
        self.num_prompt_tokens = num_prompt_tokens
        self.text = text
        self._end = end
        self.interval_s = interval_s
        self.pending: list[RequestOutput] = []
        self._waiter: asyncio.Future | None = None  # the consumer waiting for outputs
        self.error: str | None = None
        self.finished = False
        self.num_output_tokens = 0
        self.first_token_time: float | None = None  # monotonic, when the step loop had it
        self._last_sent = 0.0

    # ---- step loop side ----------------------------------------------------------------
    def push(self, out: RequestOutput) -> None:
        if self.first_token_time is None and out.new_token_ids:
            self.first_token_time = time.monotonic()
        self.pending.append(out)
        self._wake()

    def fail(self, message: str) -> None:
        self.error = message
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- consumer side -----------------------------------------------------------------
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self.pending and self.error is None:
            # A bare future per wait: cheaper than an asyncio.Event's clear/wait/set.
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.interval_s > 0 and self.error is None and not self.pending[-1].finished:
            delay = self._last_sent + self.interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        if self.error is not None:
            self.finished = True
            self._end(self.rid, None)
            raise StreamFailed(self.error)
        outs, self.pending = self.pending, []
        self._last_sent = time.monotonic()
        return self._merge(outs)

    def _merge(self, outs: list[RequestOutput]) -> RequestOutput:
        ids = outs[0].new_token_ids if len(outs) == 1 else [t for o in outs for t in o.new_token_ids]
        last = outs[-1]
        finished, reason = last.finished, last.finish_reason
        accepts = outs[0].accept_lengths if len(outs) == 1 else [a for o in outs for a in o.accept_lengths]
        logprobs = None
        if outs[0].logprobs is not None:
            logprobs = outs[0].logprobs if len(outs) == 1 else [e for o in outs for e in o.logprobs or []]
        self.num_output_tokens = last.num_output_tokens or self.num_output_tokens
        text, ended_here = "", False
        if self.text is not None:
            # The scheduler of a Serve engine makes no text, so its "stop" is always a stop
            # token.
            shown = text_ids(ids, finished and reason == "stop")
            if logprobs is not None:
                logprobs = logprobs[:len(shown)]
            text, stopped = self.text.feed(shown, final=finished)
            if stopped:
                ended_here = not finished
                finished, reason = True, "stop"
        if finished:
            self.finished = True
            self._end(self.rid, "stop" if ended_here else None)
        # Only a request's first output has prompt logprobs.
        return RequestOutput(rid=self.rid, new_token_ids=ids, new_text=text, finished=finished,
                             finish_reason=reason, num_prompt_tokens=self.num_prompt_tokens,
                             num_output_tokens=self.num_output_tokens, accept_lengths=accepts,
                             cached_tokens=last.cached_tokens, logprobs=logprobs,
                             prompt_logprobs=outs[0].prompt_logprobs)

    def cancel(self) -> None:
        """The consumer went away: the request ends now and its KV is freed."""
        if not self.finished:
            self.finished = True
            self._end(self.rid, "abort")
