"""Hostile request bodies, by hand, against the real FastAPI app on a socket with a
scripted engine and the real tokenizer and limits: bytes that are not UTF-8, lone
surrogates, bodies over the size limit, deep nesting, NaN and Infinity, out-of-range
numbers, roles, token ids, content types and bodies that are not a JSON object. Each
gets the status it should, with OpenAI's error body and the field in `param` where one
is at fault, and the server serves on. Those that need the engine itself (its context
cap, its int64 seeds) are in test_serve_api_fuzz.py."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from api_answer_contract import assert_api_answer
from fake_engine import serve_recorded


JSON = "application/json"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
HUGE = 2 ** 70


def msgs(content: str = "hi", role: str = "user") -> str:
    return json.dumps([{"role": role, "content": content}])


def nested(depth: int, leaf: str = "1") -> str:
    return '{"a":' * depth + leaf + "}" * depth


# (id, path, body: str (JSON text, escapes as written) or bytes, status, param)
CASES = [
    ("utf8-invalid-value", CMPL, b'{"prompt": "\xff\xfe ok"}', 400, None),
    ("utf8-invalid-key", CMPL, b'{"\xc3\x28": 1, "prompt": "x"}', 400, None),
    ("utf8-encoded-surrogate", CMPL, b'{"prompt": "\xed\xa0\x80"}', 400, None),
    ("surrogate-prompt", CMPL, r'{"prompt": "a\ud800b"}', 400, None),
    ("surrogate-batch-prompt", CMPL, r'{"prompt": ["ok", "\udfff"]}', 400, None),
    ("surrogate-message", CHAT, r'{"messages": [{"role": "user", "content": "\ud800"}]}', 400, None),
    ("surrogate-name", CHAT, r'{"messages": [{"role": "user", "content": "x", "name": "\udc00"}]}', 400, None),
    ("surrogate-model", CMPL, r'{"prompt": "x", "model": "\ud800"}', 400, None),
    ("surrogate-stop", CMPL, r'{"prompt": "x", "stop": ["\ud800"]}', 400, None),
    ("surrogate-key", CMPL, r'{"prompt": "x", "\ud800": 1}', 400, None),
    ("surrogate-tokenize", "/tokenize", r'{"prompt": "\ud800"}', 400, None),
    ("surrogate-pair-is-text", CMPL, r'{"prompt": "\ud83d\ude00"}', 200, None),
    ("escaped-backslash-is-text", CMPL, r'{"prompt": "\\ud800"}', 200, None),
    ("nested-10000-arrays", CMPL, '{"prompt": ' + "[" * 10000 + "]" * 10000 + "}", 400, None),
    ("nested-10000-objects", CHAT, f'{{"messages": {msgs()}, "metadata": {nested(10000)}}}', 400, None),
    ("nested-200-accepted", CHAT, f'{{"messages": {msgs()}, "metadata": {nested(200)}}}', 200, None),
    ("nan-temperature", CMPL, '{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("inf-max-tokens", CMPL, '{"prompt": "x", "max_tokens": Infinity}', 400, "max_tokens"),
    ("neg-inf-top-p", CMPL, '{"prompt": "x", "top_p": -Infinity}', 400, "top_p"),
    ("nan-seed", CMPL, '{"prompt": "x", "seed": NaN}', 400, "seed"),
    ("nan-in-metadata", CHAT, f'{{"messages": {msgs()}, "metadata": {{"x": NaN}}}}', 200, None),
    ("role-empty", CHAT, f'{{"messages": {msgs(role="")}}}', 400, "messages.0.role"),
    ("role-unknown", CHAT, f'{{"messages": {msgs(role="wizard")}}}', 400, "messages.0.role"),
    ("role-missing", CHAT, '{"messages": [{"content": "x"}]}', 400, "messages.0.role"),
    ("messages-empty", CHAT, '{"messages": []}', 400, "messages"),
    ("n-huge", CMPL, f'{{"prompt": "x", "n": {10 ** 30}}}', 400, "n"),
    ("n-17", CMPL, '{"prompt": "x", "n": 17}', 400, "n"),
    ("stop-17", CMPL, json.dumps({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}), 400, "stop"),
    ("stop-10000", CMPL, json.dumps({"prompt": "x", "stop": ["s"] * 10000}), 400, "stop"),
    ("token-out-of-vocab", CMPL, '{"prompt": [1000000000]}', 400, "prompt"),
    ("token-beyond-int64", CMPL, f'{{"prompt": [{HUGE}]}}', 400, "prompt"),
    ("token-negative", CMPL, '{"prompt": [-1]}', 400, "prompt"),
    ("token-negative-in-batch", CMPL, '{"prompt": [[1], [-5]]}', 400, "prompt"),
    ("token-bool", CMPL, '{"prompt": [true]}', 400, "prompt"),
    ("detokenize-negative", "/detokenize", '{"tokens": [-1]}', 400, "tokens"),
    ("detokenize-beyond-int64", "/detokenize", f'{{"tokens": [{HUGE}]}}', 400, "tokens"),
    ("stop-token-negative", CMPL, '{"prompt": "x", "stop_token_ids": [-1]}', 400, "stop_token_ids"),
    ("seed-beyond-int64", CMPL, f'{{"prompt": "x", "seed": {HUGE}}}', 400, "seed"),
    ("top-k-beyond-int64", CMPL, f'{{"prompt": "x", "top_k": {HUGE}}}', 400, "top_k"),
    ("int-of-5000-digits", CMPL, '{"prompt": "x", "seed": ' + "9" * 5000 + "}", 400, None),
    ("prompt-text-beyond-context", CMPL, json.dumps({"prompt": "word " * 3000}), 400, "prompt"),
    ("prompt-ids-beyond-context", CMPL, json.dumps({"prompt": [1] * 2048}), 400, "prompt"),
    ("chat-beyond-context", CHAT, f'{{"messages": {msgs("word " * 3000)}}}', 400, "messages"),
    ("empty-body", CMPL, "", 400, None),
    ("not-json", CMPL, "{'prompt': 'x'}", 400, None),
    ("json-array", CMPL, '[{"prompt": "x"}]', 400, None),
    ("json-string", CMPL, '"x"', 400, None),
    ("json-null", CMPL, "null", 400, None),
    ("json-number", "/tokenize", "1", 400, None),
]
CONTENT_TYPES = [  # (content type or None, status) for a valid body
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415), (None, 415), ("application/xml", 415),
    ("application/json; charset=utf-8", 200), ("APPLICATION/JSON", 200),
    ("application/merge-patch+json", 200),
]


@pytest.fixture(scope="module")
def served(tokenizer):
    with serve_recorded(tokenizer) as served:
        yield served


def send(url: str, path: str, body: str | bytes, content_type: str | None = JSON,
         **kw) -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    content = body.encode() if isinstance(body, str) else body
    r = httpx.post(url + path, content=content, headers=headers, timeout=60, **kw)
    assert_api_answer(r.status_code, r.headers.get("content-type", ""), r.content)
    return r


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_body(served, path, body, status, param):
    if path == CMPL and status == 200 and isinstance(body, str):
        body = body[:-1] + ', "max_tokens": 2}'
    r = send(served[0], path, body)
    assert r.status_code == status, r.text[:300]
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text[:300]


@pytest.mark.parametrize("content_type,status", CONTENT_TYPES, ids=[str(c) for c, _ in CONTENT_TYPES])
def test_content_type(served, content_type, status):
    r = send(served[0], CMPL, '{"prompt": "x", "max_tokens": 2}', content_type)
    assert r.status_code == status, r.text[:300]


def test_a_10_mb_body_is_413(served):
    body = json.dumps({"prompt": "x" * 10_000_000})
    assert send(served[0], CMPL, body).status_code == 413

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)].encode()

    r = httpx.post(served[0] + CMPL, content=chunks(), headers={"content-type": JSON}, timeout=60)
    assert_api_answer(r.status_code, r.headers.get("content-type", ""), r.content)
    assert r.status_code == 413


def test_a_long_prompt_does_not_hold_up_other_requests(served):
    """2 MB of text takes the tokenizer a couple of seconds; meanwhile /health answers."""
    done = threading.Event()

    def long_prompt():
        send(served[0], CMPL, json.dumps({"prompt": "hello world " * 170_000}))
        done.set()

    t = threading.Thread(target=long_prompt)
    t.start()
    time.sleep(0.3)  # the body is sent and tokenizing
    answered_meanwhile = 0
    for _ in range(5):
        assert httpx.get(served[0] + "/health", timeout=30).status_code == 200
        answered_meanwhile += not done.is_set()
    t.join()
    assert answered_meanwhile == 5


def test_still_serves_after_all_that(served):
    served[1].requests.clear()
    r = httpx.post(served[0] + CHAT, json={"messages": json.loads(msgs()), "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world"
    assert len(served[1].requests) == 1
