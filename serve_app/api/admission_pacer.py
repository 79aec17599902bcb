"""New requests' admission work ahead of running streams' chunks on the replica's event loop.

The front end has one event loop for every request of the replica. When hundreds of
requests arrive together (a closed benchmark level, a burst), their handlers (chat
template, tokenize, admission: about a millisecond each) and the chunks of the streams
already running (detokenize, JSON, socket write) share it in arrival order, so the last
requests of a burst reached the engine only after many rounds of other streams' chunks.

So while any handler is inside `admission`, streams that have sent their first chunk
park after each chunk (`pause`) until no handler is admitting, or at most `defer_s`:
their tokens pile up and go out as one chunk, and the loop's time goes to the new
requests. Nothing waits for a lone request's own admission.

With `slice_s`, a handler also takes a turn: turns run without waiting while this
round's admission work is under `slice_s`; beyond it, handlers queue, and each later
round releases about `slice_s` of them, with the sockets polled in between (first
tokens are read and sent between slices). An asyncio loop polls its sockets only
between rounds, and a round runs every callback that was ready when it began.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import AsyncIterator


class AdmissionPacer:
    def __init__(self, slice_s: float, defer_s: float):
        """`slice_s`: admission work per loop round (0: no pacing); `defer_s`: the longest
        a running stream holds its chunks back for queued admissions."""
        self.slice_s = slice_s
        self.defer_s = defer_s
        self.used = 0.0  # admission seconds run in this loop round
        self.cost = slice_s / 4  # seconds per admission, a moving average
        self.queue: collections.deque[asyncio.Future] = collections.deque()
        self.admitting = 0  # handlers inside admission(), queued or running
        self.parked: list[asyncio.Future] = []  # streams waiting for the admissions to end
        self._round_mark = False  # a callback is set to open the next round's slice
        self._timer: asyncio.TimerHandle | None = None

    @contextlib.asynccontextmanager
    async def admission(self) -> AsyncIterator[None]:
        """Around one request's work up to its admission (add_request)."""
        self.admitting += 1
        try:
            if self.slice_s <= 0:
                yield
            else:
                async with self._turn():
                    yield
        finally:
            self.admitting -= 1
            if not self.backlog:
                self._release()

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        if self.queue or self.used >= self.slice_s:
            fut = asyncio.get_running_loop().create_future()
            self.queue.append(fut)
            self._mark_round()
            await fut  # a cancelled waiter stays queued, done, and is skipped
        self._mark_round()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            # Awaited work (a long prompt tokenized on a thread) is not the loop's: a turn
            # counts for at most one slice.
            spent = min(time.perf_counter() - t0, self.slice_s)
            self.used += spent
            self.cost += 0.2 * (spent - self.cost)

    def _mark_round(self) -> None:
        if not self._round_mark:
            self._round_mark = True
            # Called soon from within this round, so it runs in the next, after the poll.
            asyncio.get_running_loop().call_soon(self._next_round)

    def _next_round(self) -> None:
        self._round_mark = False
        self.used = 0.0
        n = max(1, int(self.slice_s / max(self.cost, 1e-5)))
        while self.queue and n:
            fut = self.queue.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1
        if self.queue:
            self._mark_round()

    @property
    def backlog(self) -> bool:
        """Handlers are admitting requests (running streams then wait, when defer_s > 0)."""
        return self.admitting > 0 and self.defer_s > 0

    async def pause(self) -> None:
        """A running stream's wait, after a chunk, while handlers admit (`backlog`): until
        none is admitting, at most `defer_s` from when the first stream parked."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.parked.append(fut)
        if self._timer is None:
            self._timer = loop.call_later(self.defer_s, self._release)
        await fut

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        parked, self.parked = self.parked, []
        for fut in parked:
            if not fut.done():
                fut.set_result(None)
