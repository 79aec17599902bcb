"""OpenAI request/response models and their 400 error bodies."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from serve_app.api.errors import KestrelAPIError, error_body, loc_to_param, validation_error_body
from serve_app.api.openai_protocol import (SSE_DONE, ChatCompletionChoice, ChatCompletionChunk,
                                       ChatCompletionMessage, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatCompletionStreamChoice,
                                       CompletionChoice, CompletionChunk, CompletionRequest,
                                       CompletionResponse, CompletionStreamChoice, DeltaMessage,
                                       ErrorResponse, ModelCard, ModelList, UsageInfo, sse_event)

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def chat(**kw):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, **kw})


def bad(cls, body) -> tuple[int, dict]:
    with pytest.raises(ValidationError) as ei:
        cls.model_validate(body)
    status, payload = validation_error_body(ei.value)
    ErrorResponse.model_validate(payload)  # the body has OpenAI's shape
    return status, payload["error"]


# ----------------------------------------------------------------- good requests


def test_minimal_chat_request_and_defaults():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert req.model is None and req.n == 1 and req.stream is False
    sp = req.to_sampling_params(default_max_tokens=128)
    assert sp == {"max_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": None,
                  "stop": [], "stop_token_ids": [], "ignore_eos": False, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                  "logit_bias": {}, "min_p": 0.0, "min_tokens": 0, "bad_words": [],
                  "logprobs": None, "prompt_logprobs": None, "grammar": None, "n": 1}


def test_full_chat_request():
    req = chat(max_tokens=50, temperature=0, top_p=0.9, top_k=40, seed=3, stop="###",
               stop_token_ids=[2, 2, 7], n=3, stream=True, stream_options={"include_usage": True},
               presence_penalty=0, frequency_penalty=0.0, logprobs=False, user="u1",
               ignore_eos=True, metadata={"x": 1}, store=False)  # no-effect fields accepted
    assert req.include_usage_in_stream
    sp = req.to_sampling_params(default_max_tokens=16)
    assert sp == {"max_tokens": 50, "temperature": 0.0, "top_p": 0.9, "top_k": 40, "seed": 3,
                  "stop": ["###"], "stop_token_ids": [2, 7], "ignore_eos": True, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                  "logit_bias": {}, "min_p": 0.0, "min_tokens": 0, "bad_words": [],
                  "logprobs": None, "prompt_logprobs": None, "grammar": None, "n": 3}


def test_content_parts_and_roles():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]})
    assert [m.role for m in req.messages] == ["system", "user", "assistant"]
    assert req.messages[1].content == "a\nb"
    assert req.messages[2].content == ""


def test_max_completion_tokens_is_max_tokens_and_top_k_zero_is_off():
    sp = chat(max_completion_tokens=20, top_k=0).to_sampling_params(5)
    assert sp["max_tokens"] == 20 and sp["top_k"] == -1
    assert chat(max_tokens=7, max_completion_tokens=7).to_sampling_params(5)["max_tokens"] == 7


def test_stop_list_normalized():
    sp = chat(stop=["a", "", "a", "b"]).to_sampling_params(1)
    assert sp["stop"] == ["a", "b"]
    assert chat(stop=[f"s{i}" for i in range(16)]).stop[-1] == "s15"


@pytest.mark.parametrize("prompt,expected", [
    ("hello", ["hello"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_shapes(prompt, expected):
    req = CompletionRequest.model_validate({"model": "m", "prompt": prompt, "max_tokens": 4})
    assert req.prompts() == expected
    assert req.to_sampling_params(16)["max_tokens"] == 4


def test_completion_defaults():
    req = CompletionRequest.model_validate({"prompt": "x", "echo": False, "logprobs": None,
                                            "best_of": 1})
    assert req.to_sampling_params(16)["max_tokens"] == 16


# ----------------------------------------------------------------- bad requests


@pytest.mark.parametrize("body,param", [
    ({"model": "m"}, "messages"),                                   # missing messages
    ({"messages": []}, "messages"),                                 # empty
    ({"messages": "hello"}, "messages"),                            # wrong type
    ({"messages": ["hello"]}, "messages.0"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    ({"messages": MSGS, "max_tokens": -1}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": "many"}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": True}, "max_tokens"),
    ({"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSGS, "temperature": 10}, "temperature"),
    ({"messages": MSGS, "temperature": -0.1}, "temperature"),
    ({"messages": MSGS, "top_p": 0}, "top_p"),
    ({"messages": MSGS, "top_p": 1.5}, "top_p"),
    ({"messages": MSGS, "top_k": -2}, "top_k"),
    ({"messages": MSGS, "n": 0}, "n"),
    ({"messages": MSGS, "n": 17}, "n"),
    ({"messages": MSGS, "stop": 5}, "stop"),
    ({"messages": MSGS, "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"messages": MSGS, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"messages": MSGS, "stream": "sometimes"}, "stream"),
    ({"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSGS, "model": 7}, "model"),
])
def test_bad_chat_requests_name_the_field(body, param):
    status, err = bad(ChatCompletionRequest, body)
    assert status == 400
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param in err["message"]


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]),
])
def test_unsupported_chat_fields(field, value):
    status, err = bad(ChatCompletionRequest, {"messages": MSGS, field: value})
    assert status == 400 and err["param"] == field
    assert "not supported by Kestrel" in err["message"] and field in err["message"]


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt": "x", "prompt_logprobs": True}, "prompt_logprobs", "boolean"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "x", "best_of": 3}, "best_of", "not supported"),
    ({}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [1, "a"]}, "prompt", "mix"),
    ({"prompt": [[1], []]}, "prompt", "empty"),
    ({"prompt": [1, -3]}, "prompt", "non-negative"),
    ({"prompt": {"text": "x"}}, "prompt", "prompt"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than"),
])
def test_bad_completion_requests(body, param, words):
    status, err = bad(CompletionRequest, body)
    assert status == 400 and err["param"] == param
    assert words in err["message"]


def test_multiple_errors_listed_first_is_param():
    _, err = bad(ChatCompletionRequest, {"messages": MSGS, "max_tokens": -1, "temperature": 9,
                                         "n": 0, "top_p": 5})
    assert err["param"] == "max_tokens"
    assert "temperature" in err["message"] and "more error" in err["message"]


def test_message_echoes_small_inputs_only():
    _, err = bad(ChatCompletionRequest, {"messages": MSGS, "max_tokens": -1})
    assert "got -1" in err["message"]
    _, err = bad(ChatCompletionRequest, {"messages": "x" * 500})
    assert "x" * 100 not in err["message"]


# ----------------------------------------------------------------- structured outputs

UNIQUE_TAGS = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
TOOL = {"type": "function", "function": {"name": "tag", "parameters": UNIQUE_TAGS}}


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": UNIQUE_TAGS}}},
     "response_format"),
    ({"structured_outputs": {"json": UNIQUE_TAGS}}, "structured_outputs"),
    ({"guided_json": UNIQUE_TAGS}, "guided_json"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "tag"}}}, "tool_choice"),
])
def test_a_schema_keyword_the_engine_drops_is_400_naming_it(body, param):
    status, err = bad(ChatCompletionRequest, {"messages": MSGS, **body})
    assert status == 400 and err["param"] == param
    assert '"uniqueItems" (at /properties/tags)' in err["message"] and "remove it" in err["message"]


def test_tools_not_constrained_keep_any_schema():
    # With tool_choice auto or none the parameters only go into the prompt.
    for choice in ("auto", "none", None):
        assert chat(tools=[TOOL], tool_choice=choice).grammar_spec() is None


@pytest.mark.parametrize("so,default,expected", [
    (None, "compact", "compact"), (None, "any", "any"),
    ({"disable_any_whitespace": True}, "any", "compact"),
    ({"disable_any_whitespace": False}, "compact", "any"),
    ({"json": {"type": "object"}, "disable_any_whitespace": None}, "any", "any"),
])
def test_json_whitespace_per_request_over_the_server_default(so, default, expected):
    req = chat(structured_outputs=so, response_format={"type": "json_object"} if so is None or
               "json" not in so else None)
    assert req.json_whitespace(default) == expected
    assert req.grammar_spec()[0] in ("json_object", "json_schema")


@pytest.mark.parametrize("value", ["yes", 1, "compact"])
def test_disable_any_whitespace_is_a_boolean(value):
    status, err = bad(ChatCompletionRequest, {"messages": MSGS, "response_format": {"type": "json_object"},
                                              "structured_outputs": {"disable_any_whitespace": value}})
    assert status == 400 and err["param"] == "structured_outputs.disable_any_whitespace"


# ----------------------------------------------------------------- errors module


def test_error_body_shapes():
    assert error_body(400, "bad", param="n") == {"error": {
        "message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
    assert error_body(401, "no key")["error"]["type"] == "authentication_error"
    assert error_body(401, "no key")["error"]["code"] == "invalid_api_key"
    assert error_body(404, "nope")["error"]["code"] == "model_not_found"
    assert error_body(404, "nope")["error"]["type"] == "not_found_error"
    assert error_body(429, "slow")["error"]["type"] == "rate_limit_error"
    assert error_body(503, "busy")["error"]["type"] == "overloaded_error"
    assert error_body(500, "oops")["error"]["type"] == "internal_error"
    assert error_body(500, "oops", "custom", code="x")["error"] == {
        "message": "oops", "type": "custom", "param": None, "code": "x"}


def test_kestrel_api_error():
    e = KestrelAPIError.model_not_found("gpt-9")
    assert e.status == 404 and e.param == "model" and "gpt-9" in e.message
    assert ErrorResponse.model_validate(e.body()).error.code == "model_not_found"
    e = KestrelAPIError.overloaded(429, retry_after_s=2)
    assert e.status == 429 and e.headers == {"Retry-After": "2"}
    assert e.body()["error"]["type"] == "rate_limit_error"
    assert KestrelAPIError.unauthorized().body()["error"]["code"] == "invalid_api_key"
    assert KestrelAPIError.bad_request("x", param="stop").body()["error"]["param"] == "stop"
    assert isinstance(KestrelAPIError.internal(), Exception)


def test_loc_to_param_drops_union_tags():
    assert loc_to_param(("messages", 0, "content")) == "messages.0.content"
    assert loc_to_param(("stop", "list[str]", 0)) == "stop.0"
    assert loc_to_param(("x", "function-after[f(), int]")) == "x"
    assert loc_to_param(()) is None


# ----------------------------------------------------------------- responses


def test_chat_response_dump():
    resp = ChatCompletionResponse(
        model="m", choices=[ChatCompletionChoice(index=0, message=ChatCompletionMessage(content="hi"),
                                                 finish_reason="stop")],
        usage=UsageInfo.of(5, 2, cached_tokens=3))
    d = json.loads(resp.model_dump_json())
    assert d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion"
    assert d["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "hi"},
                               "finish_reason": "stop", "logprobs": None}
    assert d["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": 3}}


def test_completion_response_dump():
    resp = CompletionResponse(model="m", usage=UsageInfo.of(1, 1),
                              choices=[CompletionChoice(index=0, text="x", finish_reason="length")])
    d = resp.model_dump()
    assert d["id"].startswith("cmpl-") and d["object"] == "text_completion"
    assert d["choices"][0]["text"] == "x"


def test_chat_chunk_omits_unset_delta_keys_and_usage():
    first = ChatCompletionChunk(id="c1", model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    mid = ChatCompletionChunk(id="c1", model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="tok"))])
    last = ChatCompletionChunk(id="c1", model="m", choices=[
        ChatCompletionStreamChoice(index=0, finish_reason="stop")])
    usage = ChatCompletionChunk(id="c1", model="m", choices=[], usage=UsageInfo.of(3, 4))
    assert first.model_dump()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    d = mid.model_dump()
    assert d["choices"][0]["delta"] == {"content": "tok"} and "usage" not in d
    assert d["choices"][0]["finish_reason"] is None
    assert last.model_dump()["choices"][0]["delta"] == {}
    assert usage.model_dump()["usage"]["total_tokens"] == 7
    line = mid.to_sse()
    assert line.startswith("data: {") and line.endswith("\n\n")
    assert json.loads(line[len("data: "):])["object"] == "chat.completion.chunk"
    assert SSE_DONE == "data: [DONE]\n\n"


def test_completion_chunk_and_sse_of_dict():
    c = CompletionChunk(id="cmpl-1", model="m", choices=[CompletionStreamChoice(index=1, text="é")])
    assert json.loads(c.to_sse()[6:])["choices"][0]["text"] == "é"
    assert json.loads(sse_event(error_body(500, "boom"))[6:])["error"]["message"] == "boom"


def test_model_list():
    d = ModelList(data=[ModelCard(id="SmolLM2-135M-Instruct", max_model_len=2048)]).model_dump()
    assert d["object"] == "list" and d["data"][0]["object"] == "model"
    assert d["data"][0]["owned_by"] == "kestrel"
