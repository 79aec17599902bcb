"""The HTTP front end's behaviour with a scripted engine in place of the EngineClient: API
keys, queue-full statuses, error mapping, mid-stream failures, what the TTFT histogram
covers. In-process (ASGI), fast."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fake_engine import FakeEngine, call, echo_script, tokens

from configs.schema import load_config
from serve_app.api.openai_server import OpenAIServer, build_api
from serve_app.engine.engine_client import EngineUnavailable, QueueFull, RequestRejected
from serve_app.engine.request_stream import StreamFailed

MODEL = "SmolLM2-135M-Instruct"


def make_client(script=echo_script, *overrides):
    cfg = load_config(overrides=["device=cpu", *overrides])
    return cfg, FakeEngine(script)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_api_keys(tokenizer):
    cfg, engine = make_client(echo_script, "serve.api_keys=[k1, k2]")
    r = call(tokenizer, cfg, engine, "POST", "/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = call(tokenizer, cfg, engine, "POST", "/v1/chat/completions", json=CHAT,
             headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    r = call(tokenizer, cfg, engine, "GET", "/v1/models")
    assert r.status_code == 401
    r = call(tokenizer, cfg, engine, "POST", "/v1/chat/completions", json=CHAT,
             headers={"Authorization": "Bearer k2"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world"
    # Probes stay open: load balancers and Prometheus carry no key.
    assert call(tokenizer, cfg, engine, "GET", "/health").status_code == 200
    assert call(tokenizer, cfg, engine, "GET", "/metrics").status_code == 200


@pytest.mark.parametrize("status", [503, 429])
def test_queue_full_status_and_retry_after(tokenizer, status):
    admitted = []

    def third_is_full(ids, params, rid):
        admitted.append(rid)
        return [QueueFull("queue is full")] if len(admitted) == 3 else echo_script(ids, params, rid)

    cfg, engine = make_client(third_is_full, f"serve.queue_full_status={status}", "serve.retry_after_s=7")
    r = call(tokenizer, cfg, engine, "POST", "/v1/completions", json={"prompt": "x", "n": 3})
    assert r.status_code == status
    assert r.headers["retry-after"] == "7"
    assert r.json()["error"]["type"] in ("overloaded_error", "rate_limit_error")
    assert len(engine.streams) == 2 and all(s.cancelled for s in engine.streams)  # withdrawn


def test_engine_rejection_is_400_and_unavailable_is_503(tokenizer):
    cfg, engine = make_client(lambda *a: [RequestRejected("temperature must be within [0, 2]")])
    r = call(tokenizer, cfg, engine, "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    cfg, engine = make_client(lambda *a: [EngineUnavailable("shutting down")])
    r = call(tokenizer, cfg, engine, "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "shutting down"
    cfg, engine = make_client(lambda *a: [RuntimeError("boom")])
    r = call(tokenizer, cfg, engine, "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"


def test_mid_stream_failure_is_reported_in_band(tokenizer):
    def dies(ids, params, rid):
        return [tokens(rid, "Hel", 1), StreamFailed("engine rank 0 failed")]

    cfg, engine = make_client(dies)
    r = call(tokenizer, cfg, engine, "POST", "/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "engine rank 0 failed"
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "Hel"


def test_fan_out_seeds_and_indices(tokenizer):
    seen = []

    def record(ids, params, rid):
        seen.append((rid, params["seed"]))
        return echo_script(ids, params, rid)

    cfg, engine = make_client(record)
    r = call(tokenizer, cfg, engine, "POST", "/v1/completions",
             json={"prompt": ["a", "b"], "n": 2, "seed": 10, "temperature": 0.8})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert sorted(s for _, s in seen) == [10, 10, 11, 11]  # per prompt: seed, seed+1
    assert len({rid for rid, _ in seen}) == 4
    assert body["usage"]["completion_tokens"] == 8


def test_a_prompt_that_cannot_run_is_answered_before_the_engine(tokenizer):
    """The one prompt check (scheduler.check_prompt), worded for HTTP clients."""
    cfg, engine = make_client(echo_script, "model.max_model_len=16")
    r = call(tokenizer, cfg, engine, "POST", "/v1/completions", json={"prompt": list(range(1, 17))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == ("This model's maximum context length is 16 tokens; the prompt "
                                            "has 16 tokens (at most 15 leave room for one generated token)")
    r = call(tokenizer, cfg, engine, "POST", "/v1/completions", json={"prompt": [[1, 2], list(range(1, 20))]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1"
    assert not engine.streams
    r = call(tokenizer, cfg, engine, "POST", "/v1/completions", json={"prompt": list(range(1, 16))})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 15


def test_ttft_covers_the_handlers_whole_time(tokenizer):
    """The server's TTFT starts before the body is read: a body that comes 0.3 s after the
    headers (a slow upload; HAProxy forwards the headers first) is in it, and so is the
    work after it, here a tokenizer slowed by 0.2 s. The client saw at least as long."""
    cfg, engine = make_client()
    server = OpenAIServer(cfg, engine, tokenizer)
    encode = server.encoder.encode

    async def slow_encode(text, add_special_tokens=False):
        await asyncio.sleep(0.2)
        return await encode(text, add_special_tokens)
    server.encoder.encode = slow_encode

    async def late_body():
        await asyncio.sleep(0.3)
        yield json.dumps({**CHAT, "stream": True}).encode()

    async def main():
        transport = httpx.ASGITransport(app=build_api(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", content=late_body(),
                                  headers={"content-type": "application/json"})
            return r, time.monotonic() - t0
    r, client_s = asyncio.run(main())
    assert r.status_code == 200 and "Hello" in r.text
    sample = server.metrics.registry.get_sample_value
    assert sample("kestrel_time_to_first_token_seconds_count", {"model": MODEL}) == 1
    assert 0.5 <= sample("kestrel_time_to_first_token_seconds_sum", {"model": MODEL}) <= client_s
