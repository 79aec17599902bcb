"""Stand-ins for the replica's EngineClient (scripted) and tokenizer (with a BOS), and two
ways to call the real FastAPI app with them: in process (ASGI), or over a socket (uvicorn
in a thread, for the official `openai` client). The HTTP front end's tests need no Ray
and no model."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import uvicorn

from serve_app.api.openai_server import OpenAIServer, build_api
from serve_app.engine.request import RequestOutput


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


class Recorder:
    """An echo script that keeps what each admitted request asked for."""

    def __init__(self):
        self.requests: list[tuple[list[int], dict[str, Any]]] = []

    def __call__(self, ids, params, rid):
        self.requests.append((list(ids), dict(params)))
        return echo_script(ids, params, rid)


class BosTokenizer:
    """The given tokenizer, with a BOS id put first unless add_special_tokens is false
    (SmolLM2's tokenizer adds none, so with it the two cannot be told apart). As in a real
    fast tokenizer, the Rust tokenizer's post-processor adds it: the transformers wrapper
    and the Rust encoder (serve_app/text/prompt_encoder.py) then agree."""

    BOS = 1

    def __new__(cls, tokenizer):
        from tokenizers.processors import TemplateProcessing
        tok = copy.deepcopy(tokenizer)
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{tok.convert_ids_to_tokens(cls.BOS)} $A",
            special_tokens=[(tok.convert_ids_to_tokens(cls.BOS), cls.BOS)])
        tok.BOS = cls.BOS
        return tok


async def _request(app, method, path, **kw) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.request(method, path, **kw)


def request(app, method, path, **kw) -> httpx.Response:
    """One request to the app, in process."""
    return asyncio.run(_request(app, method, path, **kw))


def call(tokenizer, cfg, engine, method, path, **kw) -> httpx.Response:
    """One request to a fresh app over `engine`, in process."""
    return request(build_api(OpenAIServer(cfg, engine, tokenizer)), method, path, **kw)


@contextlib.contextmanager
def serve_over_http(app, log_level: str = "warning") -> Iterator[str]:
    """The app on a loopback port for the duration; yields its base URL. uvicorn's log
    records (its access log at "info") propagate to the root logger, where pytest's
    caplog sees them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, log_config=None,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextlib.contextmanager
def serve_recorded(tokenizer) -> Iterator[tuple[str, "Recorder"]]:
    """The real app on a socket, with a Recorder for engine: (base URL, recorder)."""
    from configs.schema import load_config
    recorder = Recorder()
    app = build_api(OpenAIServer(load_config(overrides=["device=cpu"]), FakeEngine(recorder), tokenizer))
    with serve_over_http(app) as url:
        yield url, recorder
