"""Logprobs in OpenAI's shapes, over HTTP with the official client: chat's
`choices[].logprobs.content` (token, logprob, bytes, top_logprobs) and completions'
parallel lists, streamed and not, from a scripted engine whose outputs carry the
engine's entries (actors/sampling/logprobs.py). The values themselves are the engine's: see
tests/unit/spec/test_logprobs_lossless.py and the Serve app test."""
from __future__ import annotations

import openai
import pytest
from fake_engine import FakeEngine, serve_over_http

from configs.schema import load_config
from serve_app.api.openai_server import OpenAIServer, build_api
from serve_app.engine.request import RequestOutput

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    return tokenizer.encode(" Hello world", add_special_tokens=False)[:2]


@pytest.fixture(scope="module")
def client(tokenizer, ids):
    def script(prompt_ids, params, rid):
        k = params["logprobs"]
        entries = [(-0.25 * (i + 1), [t, 0][:k], [-0.25 * (i + 1), -3.0][:k]) for i, t in enumerate(ids)]
        if k is None:
            entries = None
        first = tokenizer.decode(ids[:1])
        return [RequestOutput(rid, ids[:1], first, False, None, 3, 1, [], 0, entries and entries[:1]),
                RequestOutput(rid, ids[1:], tokenizer.decode(ids)[len(first):], True, "length", 3, 2,
                              [], 0, entries and entries[1:])]

    app = build_api(OpenAIServer(load_config(overrides=["device=cpu"]), FakeEngine(script), tokenizer))
    with serve_over_http(app) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30) as c:
            yield c


def check_chat(content, tokenizer, ids, top):
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ids]
    assert [c.logprob for c in content] == [-0.25, -0.5]
    assert content[0].bytes == list(content[0].token.encode("utf-8"))
    assert [len(c.top_logprobs) for c in content] == [top, top]
    if top:
        assert content[1].top_logprobs[0].token == content[1].token
        assert content[1].top_logprobs[-1].logprob == -3.0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(client, tokenizer, ids, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
              logprobs=True, top_logprobs=2)
    if stream:
        content = [c for ch in client.chat.completions.create(stream=True, **kw) if ch.choices
                   and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    check_chat(content, tokenizer, ids, 2)


def test_chat_without_logprobs_has_none(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2)
    assert resp.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(client, tokenizer, ids, stream):
    kw = dict(model=MODEL, prompt="Once", max_tokens=2, logprobs=1)
    if stream:
        parts = [ch.choices[0].logprobs for ch in client.completions.create(stream=True, **kw)
                 if ch.choices and ch.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        lps = [v for p in parts for v in p.token_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
        tops = [d for p in parts for d in p.top_logprobs]
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, lps, offsets, tops = lp.tokens, lp.token_logprobs, lp.text_offset, lp.top_logprobs
    pieces = [tokenizer.decode([t]) for t in ids]
    assert tokens == pieces and lps == [-0.25, -0.5]
    assert offsets == [0, len(pieces[0])]
    assert tops == [{pieces[0]: -0.25}, {pieces[1]: -0.5}]
