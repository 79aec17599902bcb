"""The step channel, Engine side: one asyncio connection to one RankActor.

`send(plan)` writes the plan at once, without waiting (the actor runs plans in the order
they arrive, so the step loop keeps the next one queued behind the running one);
`recv()` returns the oldest unanswered plan's StepOutput. A closed connection (the actor
died) or a failed step raises RankFailed with what the actor said.
"""
from __future__ import annotations

import asyncio

from actors.protocol.messages import (CORE_RECEIVES_FROM_RANK, StepFailed, WireError, encode,
                                      open_channel, read_message)
from actors.protocol.step_plan import StepOutput, StepPlan


class RankFailed(RuntimeError):
    """The rank's actor died, closed its channel, or raised while running a step. The
    message may reach clients, so it names no exception class; `detail` is the actor's
    traceback, for the log."""

    def __init__(self, message: str, detail: str = "", closed: bool = False):
        super().__init__(message)
        self.detail = detail
        self.closed = closed  # the channel closed: the actor itself is gone


class RankChannel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rank: int):
        self.reader = reader
        self.writer = writer
        self.rank = rank

    @classmethod
    async def connect(cls, host: str, port: int, token: str, rank: int,
                      timeout_s: float = 60.0) -> "RankChannel":
        try:
            reader, writer = await asyncio.wait_for(
                open_channel(host, port, token, CORE_RECEIVES_FROM_RANK), timeout_s)
            return cls(reader, writer, rank)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            raise RankFailed(f"could not open the step channel of rank {rank} at {host}:{port} "
                             f"({type(e).__name__}: {e}); see the RankActor's log") from None

    def send(self, plan: StepPlan) -> None:
        if self.writer.is_closing():
            raise RankFailed(f"the step channel of rank {self.rank} is closed")
        self.writer.write(encode(plan))

    async def recv(self) -> StepOutput:
        try:
            message = await read_message(self.reader, CORE_RECEIVES_FROM_RANK)
        except WireError as e:
            raise RankFailed(f"rank {self.rank} sent a frame this engine cannot read: {e}") from None
        except (asyncio.IncompleteReadError, ConnectionError):
            raise RankFailed(f"the actor of rank {self.rank} closed its step channel "
                             "(it died or was killed)", closed=True) from None
        if isinstance(message, StepOutput):
            return message
        if isinstance(message, StepFailed):
            raise RankFailed(f"rank {self.rank} failed a step: {message.message}", detail=message.traceback)
        raise RankFailed(f"rank {self.rank} sent an unexpected {type(message).__name__}")

    def close(self) -> None:
        self.writer.close()
