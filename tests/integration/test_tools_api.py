"""tool_choice auto over HTTP with the official client: a scripted engine answers in the
<tool_call> format, and the app returns the calls as tool_calls (the text around them as
content), streamed and not, with n > 1; the tools reach the prompt (serve_app/api/tools.py)."""
from __future__ import annotations

import json

import openai
import pytest
from fake_engine import FakeEngine, serve_over_http, tokens

from configs.schema import load_config
from serve_app.api.openai_server import OpenAIServer, build_api
from serve_app.api.tools import CLOSE, OPEN

MODEL = "SmolLM2-135M-Instruct"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}
PIECES = ["Sure. ", f'{OPEN}\n{{"name": "look', 'up", "arguments": {"q": "kestrel"}}', f"\n{CLOSE}",
          f'\n{OPEN}{{"name": "lookup", "arguments": {{"q": "ray"}}}}{CLOSE}']


def script(ids, params, rid):
    n = len(PIECES)
    return [tokens(rid, p, i + 1, i == n - 1, "stop" if i == n - 1 else None) for i, p in enumerate(PIECES)]


@pytest.fixture(scope="module")
def served(tokenizer):
    engine = FakeEngine(script)
    app = build_api(OpenAIServer(load_config(overrides=["device=cpu"]), engine, tokenizer))
    with serve_over_http(app) as url:
        yield url, tokenizer


def test_auto_tool_calls_whole_and_streamed(served):
    url, tok = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Find kestrel and ray."}],
              tools=[TOOL], max_tokens=32)
    whole = client.chat.completions.create(n=2, **kw).choices
    for c in whole:
        assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
            ("lookup", {"q": "kestrel"}), ("lookup", {"q": "ray"})]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.delta.tool_calls or [])]
    assert content == "Sure. "
    assert [(t.index, json.loads(t.function.arguments)["q"]) for t in calls] == [(0, "kestrel"), (1, "ray")]
    assert chunks[-1].finish_reason == "tool_calls"
    none = client.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert none.finish_reason == "stop" and none.message.tool_calls is None
    assert none.message.content == "".join(PIECES)


def test_the_tools_reach_the_prompt(served, tokenizer):
    url, _ = served
    r = __import__("httpx").post(url + "/tokenize", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}, timeout=30)
    assert r.status_code == 200, r.text
    text = tokenizer.decode(r.json()["tokens"])
    assert '"lookup"' in text and "<tools>" in text


def test_a_template_that_renders_tools_gets_them(tokenizer):
    """A model whose chat template has its own tool format (Qwen, Llama 3.1) gets the tools
    as the template's `tools` variable, not written into the system message."""
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for t in tools %}[TOOL {{ t.function.name }}]{% endfor %}"
                         "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    app = build_api(OpenAIServer(load_config(overrides=["device=cpu"]), FakeEngine(script), tok))
    with serve_over_http(app) as url:
        r = __import__("httpx").post(url + "/tokenize", json={
            "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}, timeout=30)
    assert r.status_code == 200, r.text
    assert tok.decode(r.json()["tokens"]) == "[TOOL lookup]<user>hi<assistant>"
