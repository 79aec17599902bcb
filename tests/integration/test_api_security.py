"""API keys on every route but /health (and /metrics, unless the config asks for a key
there too), keys compared whole, and no prompt text or API key in any log line at the
default level (INFO, as the Engine replica sets it). The real FastAPI app on a socket with
a scripted engine; the Serve app's own logs are checked in test_serve_api_fuzz.py."""
from __future__ import annotations

import logging

import httpx
import pytest
from api_answer_contract import assert_error_body
from api_fuzzing import ROUTES
from fake_engine import FakeEngine, echo_script, serve_over_http

from configs.schema import load_config
from serve_app.api.openai_server import OpenAIServer, build_api

KEY = "sk-kestrel-Zq7vK2mW9xR4"
PROMPT = "The okapi named Philomena-Quetzal-7731 sings"
OPEN = {"/health", "/metrics"}
FAILING_MAX_TOKENS = 3
BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          "/v1/completions": {"prompt": "hi", "max_tokens": 2},
          "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}


def failing_on_request(ids, params, rid):
    """Echoes, except that a request for FAILING_MAX_TOKENS makes the engine raise (a 500,
    logged with its traceback)."""
    if params["max_tokens"] == FAILING_MAX_TOKENS:
        return [RuntimeError("engine exploded")]
    return echo_script(ids, params, rid)


def serve(tokenizer, *overrides, log_level="warning"):
    cfg = load_config(overrides=["device=cpu", f"serve.api_keys=[other-key, {KEY}]", *overrides])
    return serve_over_http(build_api(OpenAIServer(cfg, FakeEngine(failing_on_request),
                                                  tokenizer)), log_level=log_level)


@pytest.fixture(scope="module")
def url(tokenizer):
    with serve(tokenizer) as u:
        yield u


def call(url, method, path, key=None, scheme="Bearer"):
    headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
    return httpx.request(method, url + path, json=BODIES.get(path), headers=headers, timeout=30)


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_but_the_probes_needs_a_key(url, method, path):
    if path in OPEN:
        assert call(url, method, path).status_code == 200
        return
    for key, scheme in [(None, "Bearer"), ("wrong", "Bearer"), (KEY[:-1], "Bearer"),
                        (KEY + "x", "Bearer"), (f" {KEY}x", "Bearer"), (KEY, "Basic")]:
        r = call(url, method, path, key, scheme)
        assert r.status_code == 401, (key, scheme, r.text)
        assert assert_error_body(r.content)["code"] == "invalid_api_key"
    assert call(url, method, path, KEY).status_code == 200


def test_the_document_marks_the_keyed_routes(tokenizer):
    cfg = load_config(overrides=["device=cpu", f"serve.api_keys=[{KEY}]"])
    doc = build_api(OpenAIServer(cfg, FakeEngine(echo_script), tokenizer)).openapi()
    keyed = {path for path, ops in doc["paths"].items()
             if any("security" in op for op in ops.values())}
    assert keyed == {path for _, path in ROUTES} - OPEN


def test_metrics_can_require_a_key(tokenizer):
    with serve(tokenizer, "serve.metrics_require_api_key=true") as u:
        assert call(u, "GET", "/metrics").status_code == 401
        assert call(u, "GET", "/metrics", KEY).status_code == 200
        assert call(u, "GET", "/health").status_code == 200


def test_no_prompt_or_key_in_the_logs(tokenizer, caplog):
    caplog.set_level(logging.INFO)  # the default level: EngineDeployment sets INFO
    with serve(tokenizer, log_level="info") as u:
        for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": FAILING_MAX_TOKENS}),  # 500
            ("/v1/completions", {"prompt": PROMPT, "stream": True}),
            ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True}),  # 400
            ("/v1/completions", {"prompt": PROMPT * 500}),  # 400: beyond the context
            ("/tokenize", {"prompt": PROMPT}),
        ]:
            for key in (KEY, KEY[::-1]):  # the right key, and a wrong one (401)
                httpx.post(u + path, json=body, headers={"Authorization": f"Bearer {key}"},
                           timeout=30)
    lines = [caplog.handler.format(r) for r in caplog.records]
    assert any(r.name == "uvicorn.access" for r in caplog.records), "no access log captured"
    assert any("engine exploded" in line for line in lines), "the 500 was not logged"
    for secret in (PROMPT, "Philomena", KEY, KEY[::-1], KEY[-8:]):
        assert not [line for line in lines if secret in line], secret
