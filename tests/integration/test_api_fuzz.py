"""Property-based fuzzing of every route (tests/api_fuzzing.py) against the real FastAPI
app on a socket with a scripted engine: every answer is a 2xx or a 4xx with OpenAI's
error body and fits the OpenAPI document, and the server still serves afterwards. API
keys are on and every request carries a valid one, so the requests reach the handlers."""
from __future__ import annotations

import httpx
import pytest
from api_fuzzing import ROUTES, document_routes, fuzz_route
from fake_engine import FakeEngine, echo_script, serve_over_http

from configs.schema import load_config
from serve_app.api.openai_server import OpenAIServer, build_api

EXAMPLES_PER_ROUTE = 100
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tokenizer):
    cfg = load_config(overrides=["device=cpu", f"serve.api_keys=[{KEY}]"])
    app = build_api(OpenAIServer(cfg, FakeEngine(echo_script), tokenizer))
    with serve_over_http(app) as url:
        yield app.openapi(), url


def test_the_document_lists_every_route(served):
    assert sorted(document_routes(served[0])) == sorted(ROUTES)
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        assert served[0]["paths"][path]["post"]["requestBody"]["required"]


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_answer_is_2xx_or_an_openai_4xx(served, method, path):
    statuses = fuzz_route(served[0], method, path, served[1], EXAMPLES_PER_ROUTE, headers=AUTH)
    print(f"{method} {path}: {dict(sorted(statuses.items()))}")


def test_still_serves_after_the_fuzzing(served):
    url = served[1]
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world"
    assert httpx.get(url + "/health", timeout=30).status_code == 200
