"""The fuzzing and the hostile requests that need the real model behind the API: its
tokenizer, its context length and its sampler. They share the session's Serve app
(conftest.py), so they are few, and their generations short."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from api_answer_contract import assert_api_answer, assert_error_body
from api_fuzzing import ROUTES, fuzz_route

from configs.schema import load_config
from serve_app.api.openai_server import OpenAIServer, build_api

pytestmark = pytest.mark.timeout(300)

EXAMPLES_PER_ROUTE = 25
MAX_TOKENS = 4  # what a fuzzed request may generate, so that it costs a step or few
GENERATING = {"/v1/chat/completions", "/v1/completions"}
HUGE = 2 ** 70  # beyond int64, where the engine keeps seeds and top_k


def short_and_served(case, model: str) -> None:
    """Caps what a drawn request may generate, and names the served model where it names
    one, so that more requests reach the engine; a negative case's invalid value stays."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    if case.path not in GENERATING:
        return
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        # 1e10 is an integer to pydantic too; null is the rest of the context.
        if v is None or isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS


@pytest.fixture(scope="module")
def document(server, tokenizer):
    """The served app's OpenAPI document: build_api's, for the server's config."""
    return build_api(OpenAIServer(server.cfg, None, tokenizer)).openapi()


def post(server, path, body, headers: dict[str, str] | None = None) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800 (httpx's json= cannot encode one).
    r = httpx.post(server.base_url + path, content=json.dumps(body), timeout=120,
                   headers={"content-type": "application/json", **(headers or {})})
    assert_api_answer(r.status_code, r.headers.get("content-type", ""), r.content)
    return r


@pytest.mark.parametrize("method,path", ROUTES)
def test_fuzzed_requests_get_2xx_or_openai_4xx(server, document, method, path):
    server.wait_idle()
    statuses = fuzz_route(document, method, path, server.base_url, EXAMPLES_PER_ROUTE,
                          edit=lambda case: short_and_served(case, server.cfg.model.name),
                          timeout=120)
    print(f"{method} {path}: {dict(sorted(statuses.items()))}")


def test_max_tokens_beyond_the_context_is_capped_there(server, tokenizer):
    ids = tokenizer.encode("x " * 4000)[: server.cfg.model.max_model_len - 3]
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": HUGE, "ignore_eos": True,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("field", ["seed", "top_k"])
def test_integers_beyond_int64_are_400_not_a_dead_engine(server, field):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 1.0,
                                         field: HUGE})
    assert r.status_code == 400 and assert_error_body(r.content)["param"] == field, r.text
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 1.0})
    assert r.status_code == 200, r.text


def test_a_temperature_too_small_for_float32_samples_greedily(server):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()
    tiny = post(server, "/v1/completions", {**body, "temperature": 1e-40}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize("body", [
    {"prompt": "Hi", "stop": ["\ud800"]},
    {"prompt": "Hi \ud800 there"},
    {"messages": [{"role": "user", "content": "\udfff"}]},
], ids=["stop", "prompt", "message"])
def test_lone_surrogates_are_400(server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(server, path, {**body, "max_tokens": 2})
    assert r.status_code == 400, r.text


def test_no_prompt_or_key_in_the_ray_logs(server):
    """Every log file of the Ray session (replica, engine core, rank actors, Serve's
    controller and proxies, HAProxy) after requests that carry a distinctive prompt and
    key. The session's server has no API keys, so the key travels but is not checked
    (test_api_security.py covers that path, in process)."""
    import ray
    prompt, key = "The okapi named Philomena-Quetzal-7731 sings", "sk-kestrel-Zq7vK2mW9xR4"
    auth = {"Authorization": f"Bearer {key}"}
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3}
    assert post(server, "/v1/chat/completions", chat, auth).status_code == 200
    assert post(server, "/v1/chat/completions", {**chat, "stream": True}, auth).status_code == 200
    assert post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3}, auth).status_code == 200
    assert post(server, "/v1/completions", {"prompt": prompt, "use_beam_search": True}, auth).status_code == 400
    assert post(server, "/tokenize", {"prompt": prompt}, auth).status_code == 200
    time.sleep(3)  # the processes flush their log files
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [p for p in logs.rglob("*") if p.is_file()]
    access = [p for p in files if p.name.startswith("replica_") and b"/v1/completions" in p.read_bytes()]
    assert access, "no replica access log found: the check below would be vacuous"
    for secret in (prompt, "Philomena", key, key[-8:]):
        assert not [p for p in files if secret.encode() in p.read_bytes()], secret


def test_still_serves_after_all_that(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
