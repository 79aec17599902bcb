"""The step channel, Engine side: one asyncio connection to one RankActor.

`send(plan)` writes the plan at once, without waiting (the actor runs plans in the order
they arrive, so the step loop keeps the next one queued behind the running one);
`recv()` returns the oldest unanswered plan's StepOutput. A closed connection (the actor
died) or a failed step raises RankFailed with what the actor said.
"""
from __future__ import annotations

import asyncio
import socket

from actors.worker.step_channel import ERROR, HEADER, HELLO, OK, decode, encode
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
        async def hello() -> "RankChannel":
            reader, writer = await asyncio.open_connection(host, port)
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = cls(reader, writer, rank)
            writer.write(encode(HELLO, token))
            await channel.recv()  # the actor's OK: the token matched
            return channel
        try:
            return await asyncio.wait_for(hello(), timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise RankFailed(f"could not open the step channel of rank {rank} at {host}:{port} "
                             f"({type(e).__name__}: {e}); see the RankActor's log") from None

    def send(self, plan: StepPlan) -> None:
        if self.writer.is_closing():
            raise RankFailed(f"the step channel of rank {self.rank} is closed")
        self.writer.write(encode(OK, plan))

    async def recv(self) -> StepOutput:
        try:
            header = await self.reader.readexactly(HEADER.size)
            (n,) = HEADER.unpack(header)
            kind, payload = decode(await self.reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise RankFailed(f"the actor of rank {self.rank} closed its step channel "
                             "(it died or was killed)", closed=True) from None
        if kind == ERROR:
            message, trace = payload
            raise RankFailed(f"rank {self.rank} failed a step: {message}", detail=trace)
        if kind != OK:
            raise RankFailed(f"rank {self.rank} sent an unknown frame {kind!r}")
        return payload

    def close(self) -> None:
        self.writer.close()
