"""A scripted stand-in for the replica's EngineClient, and a way to call the real FastAPI
app with it in process (ASGI): the HTTP front end's tests need no Ray and no model."""
from __future__ import annotations

import asyncio

import httpx

from serve_app.openai_server import OpenAIServer, build_api
from serve_app.request import RequestOutput


class FakeStream:
    """Stands in for a RequestStream: yields the scripted outputs, raises scripted errors."""

    def __init__(self, items):
        self.items = list(items)
        self.cancelled = False  # cancelled before its outputs ran out

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            self.items = []
            raise item
        return item

    def cancel(self):
        if self.items:
            self.cancelled = True


class FakeEngine:
    """Stands in for EngineClient. script(prompt_ids, params, rid) -> outputs and errors; an
    error first is raised by add_request itself (the request is not admitted)."""

    def __init__(self, script):
        self.script = script
        self.streams: list[FakeStream] = []

    def add_request(self, ids, params, rid):
        items = self.script(ids, params, rid)
        if items and isinstance(items[0], BaseException):
            raise items[0]
        s = FakeStream(items)
        self.streams.append(s)
        return s

    async def check_health(self):
        return None

    async def stats(self):
        return {"replica": "fake", "running": 0, "waiting": 0, "kv": [{"rank": 0, "free": 10, "capacity": 10}]}


def tokens(rid, text, n, finished=False, reason=None):
    return RequestOutput(rid, list(range(n)), text, finished, reason, 3, n)


def echo_script(ids, params, rid):
    return [tokens(rid, "Hello", 1), tokens(rid, " world", 2, True, "length")]


async def _request(app, method, path, **kw) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.request(method, path, **kw)


def request(app, method, path, **kw) -> httpx.Response:
    """One request to the app, in process."""
    return asyncio.run(_request(app, method, path, **kw))


def call(tokenizer, cfg, engine, method, path, **kw) -> httpx.Response:
    """One request to a fresh app over `engine`, in process."""
    return request(build_api(OpenAIServer(cfg, engine, tokenizer)), method, path, **kw)
