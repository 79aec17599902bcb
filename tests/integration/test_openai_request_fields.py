"""No silent drops, over HTTP: the official `openai` client (vLLM's fields through
extra_body) against the real FastAPI app on a socket, a scripted engine behind it. A
field Kestrel does not act on is a 400 naming it and reaches no engine; a field it accepts
or honours shows in what the engine is asked to do."""
from __future__ import annotations

import json

import openai
import pytest
from fake_engine import BosTokenizer, FakeEngine, Recorder, call, serve_recorded

from configs.schema import load_config
from serve_app.text.grammar import compiler_for
from serve_app.text.tokenizer import apply_chat_template

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(tokenizer):
    with serve_recorded(tokenizer) as served:
        yield served


@pytest.fixture
def engine_asked(served) -> list:
    """(prompt ids, sampling params) of each request the engine got during the test."""
    served[1].requests.clear()
    return served[1].requests


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=30) as c:
        yield c


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MSGS),
                                          max_tokens=kw.pop("max_tokens", 2), **kw)


def complete(client, **kw):
    return client.completions.create(model=MODEL, prompt="Once", max_tokens=2, **kw)


def assert_rejected(err: openai.BadRequestError, param: str) -> None:
    assert err.status_code == 400 and err.param == param, (err.param, err.message)
    assert "not supported by Kestrel" in err.message and param in err.message


# ----------------------------------------------------------------- rejected


CHAT_REJECTED = [  # (param, the client's own keyword arguments)
    ("functions", {"functions": [{"name": "f"}]}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("prediction", {"prediction": {"type": "content", "content": "Hello"}}),
    ("web_search_options", {"web_search_options": {}}),
    ("reasoning_effort", {"reasoning_effort": "low"}),
    ("verbosity", {"verbosity": "low"}),
    ("echo", {"extra_body": {"echo": True}}),
    ("prompt_logprobs", {"extra_body": {"prompt_logprobs": 1}}),  # served on completions
]
VLLM_REJECTED = [  # (param, extra_body), both endpoints
    ("length_penalty", {"length_penalty": 0.5}),
    ("use_beam_search", {"use_beam_search": True}),
    ("allowed_token_ids", {"allowed_token_ids": [1, 2]}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": True}),
    ("skip_special_tokens", {"skip_special_tokens": False}),
    ("spaces_between_special_tokens", {"spaces_between_special_tokens": False}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 8}),
    ("priority", {"priority": 1}),
    ("cache_salt", {"cache_salt": "tenant"}),
    ("foo", {"foo": 1}),  # no API has it
]


@pytest.mark.parametrize("param,kwargs", CHAT_REJECTED, ids=[p for p, _ in CHAT_REJECTED])
def test_chat_fields_kestrel_cannot_honour_are_400(client, engine_asked, param, kwargs):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, **kwargs)
    assert_rejected(ei.value, param)
    assert engine_asked == []


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("param,extra", VLLM_REJECTED, ids=[p for p, _ in VLLM_REJECTED])
def test_vllm_fields_kestrel_cannot_honour_are_400(client, engine_asked, endpoint, param, extra):
    with pytest.raises(openai.BadRequestError) as ei:
        (chat if endpoint == "chat" else complete)(client, extra_body=extra)
    assert_rejected(ei.value, param)
    assert engine_asked == []


@pytest.mark.parametrize("param,kwargs", [
    ("suffix", {"suffix": "}"}),
    ("best_of", {"best_of": 2}),
])
def test_completion_fields_kestrel_cannot_honour_are_400(client, engine_asked, param, kwargs):
    with pytest.raises(openai.BadRequestError) as ei:
        complete(client, **kwargs)
    assert_rejected(ei.value, param)
    assert engine_asked == []


def test_streamed_request_is_refused_before_it_streams(client, engine_asked):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, stream=True, extra_body={"allowed_token_ids": [1]})
    assert_rejected(ei.value, "allowed_token_ids")
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, stream=True, stream_options={"include_usage": True, "include_obfuscation": True})
    assert ei.value.param == "stream_options.include_obfuscation"
    assert engine_asked == []


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_non_text_content_parts_are_400(client, engine_asked, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, messages=messages)
    assert ei.value.param == "messages.0.content" and part["type"] in ei.value.message
    assert engine_asked == []


def test_tool_turns_reach_the_prompt(client, engine_asked, tokenizer):
    """An assistant turn of tool calls and the tool's result, in the Hermes format the
    app writes for a template without a tool format (serve_app/api/tools.py)."""
    chat(client, messages=[*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    text = tokenizer.decode(engine_asked[0][0])
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<tool_response>\n42\n</tool_response>" in text
    with pytest.raises(openai.BadRequestError) as ei:  # a result without the call it answers
        chat(client, messages=[*MSGS, {"role": "tool", "content": "42"}])
    assert ei.value.param.startswith("messages.1")


# ----------------------------------------------------------------- accepted, honoured


def test_no_effect_fields_change_nothing(client, engine_asked):
    chat(client, temperature=0)
    chat(client, temperature=0, user="u-1", metadata={"k": "v"}, store=True,
         service_tier="default", parallel_tool_calls=False, tool_choice="none",
         response_format={"type": "text"}, presence_penalty=0, logprobs=False,
         extra_body={"repetition_penalty": 1.0, "min_p": 0, "skip_special_tokens": True})
    plain, decorated = engine_asked
    assert decorated == plain


@pytest.mark.parametrize("kwargs", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
    {"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}},
    {"extra_body": {"structured_outputs": {"json": {"type": "integer"}}}},
    {"extra_body": {"guided_regex": "[ab]+"}},
    {"extra_body": {"guided_grammar": "root ::= \"a\" | \"b\""}},
], ids=["json_object", "json_schema", "choice", "json", "regex", "grammar"])
def test_output_constraints_reach_the_engine_compiled(client, engine_asked, kwargs):
    chat(client, **kwargs)
    complete(client, extra_body=kwargs.get("extra_body", kwargs))  # the client's completions lack response_format
    assert all(isinstance(p["grammar"], str) and p["grammar"] for _, p in engine_asked)
    assert len(engine_asked) == 2


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name"],
          "properties": {"name": {"type": "string", "maxLength": 20}}}


def test_json_is_compact_unless_the_request_asks_for_any_whitespace(client, engine_asked, tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    chat(client, response_format=fmt)
    chat(client, response_format=fmt, extra_body={"structured_outputs": {"disable_any_whitespace": False}})
    chat(client, response_format=fmt, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    complete(client, extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}})
    spec = ("json_schema", json.dumps(SCHEMA))
    compact, spaced = (compiler_for(tokenizer).compile(spec, w) for w in ("compact", "any"))
    assert compact != spaced
    assert [p["grammar"] for _, p in engine_asked] == [compact, spaced, compact, spaced]


@pytest.mark.parametrize("endpoint,extra", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}),
    ("completions", {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}),
    ("chat", {"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}}),
], ids=["response_format", "structured_outputs", "disable_any_whitespace"])
def test_what_the_grammar_engine_cannot_do_is_400(client, engine_asked, endpoint, extra):
    with pytest.raises(openai.BadRequestError) as ei:
        (chat if endpoint == "chat" else complete)(client, extra_body=extra)
    err = ei.value
    named = "disable_any_whitespace" if "disable_any_whitespace" in str(extra) else '"uniqueItems"'
    assert err.status_code == 400 and named in err.message, err.message
    assert err.param == ("structured_outputs.disable_any_whitespace" if named == "disable_any_whitespace"
                         else next(iter(extra)))
    assert engine_asked == []


def test_logit_processing_reaches_the_engine(client, engine_asked):
    """OpenAI's penalties and bias through the client's own keywords, vLLM's through
    extra_body, on both endpoints; a bias on an id outside the vocabulary is a 400."""
    chat(client, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"7": 3},
         extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 1})
    complete(client, presence_penalty=1.0, logit_bias={"1": -5})
    (_, c), (_, t) = engine_asked
    assert (c["presence_penalty"], c["frequency_penalty"], c["logit_bias"]) == (0.5, -0.5, {7: 3.0})
    assert (c["repetition_penalty"], c["min_tokens"]) == (1.2, 1) and c["min_p"] == pytest.approx(0.1)
    assert (t["presence_penalty"], t["logit_bias"]) == (1.0, {1: -5.0})
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, logit_bias={"99999999": 1})
    assert ei.value.param == "logit_bias" and "vocabulary" in ei.value.message
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=2, extra_body={"min_tokens": 3})
    assert ei.value.param == "min_tokens"


def test_include_usage_is_honoured(client):
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens_is_max_tokens(client, engine_asked):
    client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=7)
    chat(client, max_tokens=7, max_completion_tokens=7)
    assert [params["max_tokens"] for _, params in engine_asked] == [7, 7]
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=7, max_completion_tokens=8)
    assert ei.value.param == "max_completion_tokens"


def test_best_of_equal_to_n(client, engine_asked):
    resp = complete(client, n=2, best_of=2)
    assert len(resp.choices) == 2 and len(engine_asked) == 2


def test_text_parts_are_joined(client, engine_asked, tokenizer):
    chat(client, messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "text", "text": "b"}]}])
    (ids, _), = engine_asked
    assert ids == apply_chat_template(tokenizer, [{"role": "user", "content": "a\nb"}])


def test_chat_template_fields_are_honoured(client, engine_asked, tokenizer):
    messages = [*MSGS, {"role": "assistant", "content": "Hel"}]
    chat(client, messages=messages)
    chat(client, messages=messages, extra_body={"add_generation_prompt": False})
    chat(client, messages=messages, extra_body={"add_generation_prompt": False,
                                                "continue_final_message": True})
    got = [ids for ids, _ in engine_asked]
    assert got == [apply_chat_template(tokenizer, messages),
                   apply_chat_template(tokenizer, messages, add_generation_prompt=False),
                   apply_chat_template(tokenizer, messages, add_generation_prompt=False,
                                       continue_final_message=True)]
    assert len(set(map(tuple, got))) == 3
    assert tokenizer.decode(got[2]).endswith("Hel")
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, messages=messages, extra_body={"continue_final_message": True})
    assert ei.value.param == "continue_final_message"


def test_completion_add_special_tokens_is_honoured(tokenizer):
    recorder = Recorder()
    cfg = load_config(overrides=["device=cpu"])
    bos = BosTokenizer(tokenizer)
    for flag in (None, True, False):
        body = {"prompt": "Once", "max_tokens": 2}
        if flag is not None:
            body["add_special_tokens"] = flag
        r = call(bos, cfg, FakeEngine(recorder), "POST", "/v1/completions", json=body)
        assert r.status_code == 200, r.text
    plain = tokenizer.encode("Once", add_special_tokens=False)
    assert [ids for ids, _ in recorder.requests] == [[bos.BOS, *plain], [bos.BOS, *plain], plain]
