"""A client that hangs up before its non-streamed answer is ready: every sequence of the
request is aborted then, not when it would have finished (the real app over a socket,
uvicorn, with a stand-in engine whose streams never end by themselves)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fake_engine import FakeEngine, FakeStream, serve_over_http, tokens

from configs.schema import load_config
from serve_app.api.openai_server import OpenAIServer, build_api


class EndlessStream(FakeStream):
    """A token every 10 ms until cancelled."""

    async def __anext__(self):
        await asyncio.sleep(0.01)
        return self.items[0]

    def cancel(self):
        self.cancelled = True


class EndlessEngine(FakeEngine):
    def add_request(self, ids, params, rid):
        s = EndlessStream([tokens(rid, "x", 1)])
        self.streams.append(s)
        return s


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}),
])
def test_a_hang_up_aborts_every_sequence_of_a_whole_answer(tokenizer, path, body):
    engine = EndlessEngine(None)
    app = build_api(OpenAIServer(load_config(overrides=["device=cpu"]), engine, tokenizer))
    with serve_over_http(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + path, json={**body, "max_tokens": 100000},
                       timeout=httpx.Timeout(10, read=0.5))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(s.cancelled for s in engine.streams):
            time.sleep(0.02)
    n = body["n"] * len(body.get("prompt", [0]))
    assert len(engine.streams) == n
    assert all(s.cancelled for s in engine.streams)
