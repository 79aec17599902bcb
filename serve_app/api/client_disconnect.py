"""A non-streamed answer whose client hangs up: stop the work it waits for.

Starlette cancels nothing when the client of a plain (non-streaming) response goes away:
the handler runs to the end, and its sequences keep the engine busy for an answer nobody
reads (a client's timeout and its retry would double the load). A streamed response
notices on its next write; this watches the connection for the rest.

Behind HAProxy (serve.http_proxy=haproxy) the replica learns of it only when its answer
is written: HAProxy cannot tell a client that hung up from one that only closed its
sending half, so it keeps the forwarded request (its `abortonclose` drops only queued
ones). Where the disconnect reaches the app (uvicorn alone) it arrives at once."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import Request


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready."""


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message the server gives is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or ClientDisconnected once the client is gone (`work` cancelled,
    so its `finally` blocks abort what it started)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
