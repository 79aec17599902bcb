"""No silent drops: every request field is honoured, accepted as no-effect, or a 400 that
names it (serve_app/api/request_field_policy.py). The field lists below are the test's own
copy of docs/serve.md's; a field added to a model without a place here fails."""
from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from serve_app.api.errors import validation_error_body
from serve_app.api.openai_protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from serve_app.api.tokenize_protocol import (DetokenizeRequest, TokenizeChatRequest,
                                         TokenizePromptRequest, tokenize_request_model)

MSGS = [{"role": "user", "content": "Hi"}]
CHAT = {"messages": MSGS}
COMPLETION = {"prompt": "Once"}

HONOURED_BOTH = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "stop_token_ids", "n", "stream", "stream_options", "ignore_eos",
                 "presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty",
                 "min_p", "min_tokens", "bad_words", "response_format", "structured_outputs",
                 "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
HONOURED_CHAT = HONOURED_BOTH | {"messages", "max_completion_tokens", "add_generation_prompt",
                                 "continue_final_message", "logprobs", "top_logprobs", "tools",
                                 "tool_choice", "parallel_tool_calls"}
HONOURED_COMPLETION = HONOURED_BOTH | {"prompt", "best_of", "add_special_tokens", "logprobs",
                                       "echo", "prompt_logprobs"}

NO_EFFECT_BOTH = {"user": "u-1"}
NO_EFFECT_CHAT = {**NO_EFFECT_BOTH, "metadata": {"k": "v"}, "store": True,
                  "service_tier": "flex",
                  "prompt_cache_key": "k", "prompt_cache_retention": "24h",
                  "prompt_cache_options": {"ttl": "1h"}, "safety_identifier": "s"}

# field -> (a value Kestrel would have to act on, its neutral values)
REJECTED_BOTH = {
    "use_beam_search": (True, [False]),
    "length_penalty": (0.8, [1, 1.0]),
    "allowed_token_ids": ([1, 2], []),
    "logits_processors": (["my.module:proc"], [[]]),
    "include_stop_str_in_output": (True, [False]),
    "skip_special_tokens": (False, [True]),
    "spaces_between_special_tokens": (False, [True]),
    "truncate_prompt_tokens": (16, []),
    "truncation_side": ("left", []),
    "guided_decoding_backend": ("outlines", ["xgrammar"]),
    "guided_whitespace_pattern": (" ", []),
    "structural_tag": ("{}", []),
    "return_tokens_as_token_ids": (True, [False]),
    "return_token_ids": (True, [False]),
    "priority": (5, [0]),
    "request_id": ("mine", []),
    "cache_salt": ("tenant-a", []),
    "kv_transfer_params": ({"do_remote_decode": True}, []),
    "vllm_xargs": ({"a": 1}, [{}]),
}
REJECTED_CHAT = {
    **REJECTED_BOTH,
    "prompt_logprobs": (0, []),  # completions only: a chat prompt is the template's text
    "functions": ([{"name": "f"}], [[]]),
    "function_call": ("auto", ["none"]),
    "modalities": (["text", "audio"], [["text"]]),
    "audio": ({"voice": "alloy", "format": "wav"}, []),
    "prediction": ({"type": "content", "content": "x"}, []),
    "web_search_options": ({}, []),  # {} switches web search on: not neutral
    "reasoning_effort": ("low", []),
    "verbosity": ("low", []),
    "moderation": ({"model": "m"}, []),
    "echo": (True, [False]),
    "add_special_tokens": (True, [False]),
    "documents": ([{"title": "t", "text": "x"}], []),
    "chat_template": ("{{ messages }}", []),
    "chat_template_kwargs": ({"enable_thinking": True}, [{}]),
    "mm_processor_kwargs": ({"size": 3}, [{}]),
    "media_io_kwargs": ({"video": {}}, [{}]),
}
REJECTED_COMPLETION = {
    **REJECTED_BOTH,
    "suffix": ("}", [""]),
    "prompt_embeds": ("AAAA", []),
}
# field -> (value, the param the error names)
REJECTED_MESSAGE = {
    "function_call": ({"name": "f", "arguments": "{}"}, []),
    "refusal": ("no", []),
    "audio": ({"id": "a1"}, []),
}

CASES = [(ChatCompletionRequest, CHAT, REJECTED_CHAT),
         (CompletionRequest, COMPLETION, REJECTED_COMPLETION)]


def rejected(cls, body) -> dict:
    with pytest.raises(ValidationError) as ei:
        cls.model_validate(body)
    status, payload = validation_error_body(ei.value)
    assert status == 400
    return ErrorResponse.model_validate(payload).error.model_dump()


def params_of(cls, body) -> dict:
    return cls.model_validate(body).to_sampling_params(default_max_tokens=32)


# ----------------------------------------------------------------- every field has a kind


@pytest.mark.parametrize("cls,honoured,no_effect,rejected_fields", [
    (ChatCompletionRequest, HONOURED_CHAT, NO_EFFECT_CHAT, REJECTED_CHAT),
    (CompletionRequest, HONOURED_COMPLETION, NO_EFFECT_BOTH, REJECTED_COMPLETION),
])
def test_every_declared_field_is_classified(cls, honoured, no_effect, rejected_fields):
    kinds = [honoured, set(no_effect), set(rejected_fields)]
    assert set(cls.model_fields) == set().union(*kinds)
    assert sum(len(k) for k in kinds) == len(cls.model_fields)  # each in one kind only


def _openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


def test_every_openai_sdk_field_is_declared():
    """What the installed official client can send is never an unknown field to Kestrel."""
    from openai.types import completion_create_params as legacy
    from openai.types.chat import completion_create_params as chat
    assert _openai_fields(chat) - set(ChatCompletionRequest.model_fields) == set()
    assert _openai_fields(legacy) - set(CompletionRequest.model_fields) == set()


# ----------------------------------------------------------------- unknown fields


@pytest.mark.parametrize("cls,base,field", [
    (ChatCompletionRequest, CHAT, "foo"),
    (ChatCompletionRequest, CHAT, "prompt"),            # a completions field
    (ChatCompletionRequest, CHAT, "suffix"),
    (ChatCompletionRequest, CHAT, "best_of"),
    (ChatCompletionRequest, CHAT, "frequency_penalty_typo"),
    (CompletionRequest, COMPLETION, "foo"),
    (CompletionRequest, COMPLETION, "messages"),        # a chat field
    (CompletionRequest, COMPLETION, "max_completion_tokens"),
    (CompletionRequest, COMPLETION, "metadata"),
    (CompletionRequest, COMPLETION, "tools"),
    (TokenizePromptRequest, {"prompt": "x"}, "foo"),
    (TokenizeChatRequest, CHAT, "max_tokens"),
    (DetokenizeRequest, {"tokens": [1]}, "foo"),
])
def test_unknown_field_is_400_naming_it(cls, base, field):
    err = rejected(cls, {**base, field: 1})
    assert err["param"] == field
    assert f"{field} is not supported by Kestrel" in err["message"]
    assert "remove it" in err["message"]


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "stream": True, "stream_options": {"include_usage": True, "foo": 1}},
     "stream_options.foo"),
    ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages.0.foo"),
])
def test_unknown_nested_field_is_400_naming_its_path(body, param):
    err = rejected(ChatCompletionRequest, body)
    assert err["param"] == param
    assert param in err["message"] and "not supported by Kestrel" in err["message"]


# ----------------------------------------------------------------- rejected unless neutral


@pytest.mark.parametrize("cls,base,field,value", [
    (cls, base, field, bad) for cls, base, table in CASES for field, (bad, _) in table.items()])
def test_known_unsupported_field_is_400_naming_it(cls, base, field, value):
    err = rejected(cls, {**base, field: value})
    assert err["param"] == field
    assert f"{field} is not supported by Kestrel" in err["message"]
    assert "omit it" in err["message"] or "send" in err["message"]  # says what to do


@pytest.mark.parametrize("cls,base,field,value", [
    (cls, base, field, v) for cls, base, table in CASES
    for field, (_, neutral) in table.items() for v in [None, *neutral]])
def test_known_unsupported_field_at_neutral_value_changes_nothing(cls, base, field, value):
    assert params_of(cls, {**base, field: value}) == params_of(cls, base)


@pytest.mark.parametrize("field,value", [("repetition_penalty", True), ("presence_penalty", False),
                                         ("min_tokens", True),
                                         ("priority", False)])
def test_a_bool_is_not_a_neutral_number(field, value):
    # True == 1 and False == 0 in Python; a bool sent for a number is not the default.
    assert rejected(ChatCompletionRequest, {**CHAT, field: value})["param"] == field


@pytest.mark.parametrize("cls,base,field,value", [
    (ChatCompletionRequest, CHAT, f, v) for f, v in NO_EFFECT_CHAT.items()] + [
    (CompletionRequest, COMPLETION, f, v) for f, v in NO_EFFECT_BOTH.items()])
def test_no_effect_fields_are_accepted(cls, base, field, value):
    assert params_of(cls, {**base, field: value}) == params_of(cls, base)


def test_stream_options_obfuscation():
    body = {**CHAT, "stream": True}
    ok = ChatCompletionRequest.model_validate(
        {**body, "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert ok.include_usage_in_stream
    err = rejected(ChatCompletionRequest, {**body, "stream_options": {"include_obfuscation": True}})
    assert err["param"] == "stream_options.include_obfuscation"


# ----------------------------------------------------------------- messages


@pytest.mark.parametrize("field,value", [(f, bad) for f, (bad, _) in REJECTED_MESSAGE.items()])
def test_message_fields_beyond_text_are_400(field, value):
    err = rejected(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", field: value}]})
    assert err["param"] == f"messages.1.{field}"
    assert f"{field} is not supported by Kestrel" in err["message"]


def test_message_fields_at_neutral_values_stay_out_of_the_template():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "a", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [], "refusal": None}]})
    assert [m.for_template() for m in req.messages] == [
        {"role": "user", "content": "a", "name": "ann"}, {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f1"}},
    {"type": "refusal", "refusal": "no"},
    {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
    {"type": "text"},
    "just a string",
])
def test_non_text_content_parts_are_400_at_the_content(part):
    err = rejected(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "look:"}, part]}]})
    assert err["param"] == "messages.0.content"
    assert "content part 1" in err["message"]


def test_text_parts_are_joined():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]}]})
    assert [m.content for m in req.messages] == ["Be brief.", "a\nb"]


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "42"}, "messages.0"),  # without tool_call_id
    ({"role": "function", "content": "42", "name": "f"}, "messages.0.role"),
    ({"role": "user"}, "messages.0.content"),
    ({"role": "user", "content": None}, "messages.0.content"),
    ({"content": "x"}, "messages.0.role"),
])
def test_unknown_roles_and_missing_content_stay_400(message, param):
    assert rejected(ChatCompletionRequest, {"messages": [message]})["param"] == param


# ----------------------------------------------------------------- honoured fields


def test_max_completion_tokens_is_max_tokens():
    assert params_of(ChatCompletionRequest, {**CHAT, "max_completion_tokens": 9})["max_tokens"] == 9
    both = {**CHAT, "max_completion_tokens": 9, "max_tokens": 9}
    assert params_of(ChatCompletionRequest, both)["max_tokens"] == 9
    err = rejected(ChatCompletionRequest, {**CHAT, "max_completion_tokens": 9, "max_tokens": 10})
    assert err["param"] == "max_completion_tokens" and "max_tokens" in err["message"]
    assert rejected(ChatCompletionRequest, {**CHAT, "max_completion_tokens": True})["param"] == \
        "max_completion_tokens"


@pytest.mark.parametrize("cls,base", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)])
def test_logit_processing_fields_reach_the_engine(cls, base):
    body = {**base, "presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.2,
            "logit_bias": {"50": -100, "7": 2.5}, "min_p": 0.1, "min_tokens": 3}
    p = params_of(cls, body)
    assert (p["presence_penalty"], p["frequency_penalty"], p["repetition_penalty"]) == (0.5, -1.0, 1.2)
    assert p["logit_bias"] == {50: -100.0, 7: 2.5} and p["min_p"] == pytest.approx(0.1)
    assert p["min_tokens"] == 3
    off = params_of(cls, base)
    assert (off["presence_penalty"], off["repetition_penalty"], off["logit_bias"], off["min_tokens"]) == (0.0, 1.0, {}, 0)


def test_logprobs_fields_reach_the_engine():
    assert params_of(ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 5})["logprobs"] == 5
    assert params_of(ChatCompletionRequest, {**CHAT, "logprobs": True})["logprobs"] == 0
    assert params_of(ChatCompletionRequest, {**CHAT, "logprobs": False})["logprobs"] is None
    assert params_of(CompletionRequest, {**COMPLETION, "logprobs": 0})["logprobs"] == 0
    assert params_of(CompletionRequest, COMPLETION)["logprobs"] is None
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        assert rejected(ChatCompletionRequest, {**CHAT, **bad})["param"] == "top_logprobs"
    assert rejected(CompletionRequest, {**COMPLETION, "logprobs": 21})["param"] == "logprobs"


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", 2.5), ("min_p", 1.5), ("min_tokens", -1),
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101})])
def test_logit_processing_values_out_of_range_are_400(field, value):
    assert rejected(ChatCompletionRequest, {**CHAT, field: value})["param"] == field


@pytest.mark.parametrize("best_of,n,ok", [(None, 3, True), (1, 1, True), (3, 3, True),
                                          (2, 1, False), (1, 2, False), (True, 1, False)])
def test_best_of_only_as_n(best_of, n, ok):
    body = {**COMPLETION, "best_of": best_of, "n": n}
    if ok:
        assert params_of(CompletionRequest, body)["n"] == n
    else:
        err = rejected(CompletionRequest, body)
        assert err["param"] == "best_of"


def test_chat_template_fields():
    req = ChatCompletionRequest.model_validate(CHAT)
    assert (req.add_generation_prompt, req.continue_final_message) == (True, False)
    req = ChatCompletionRequest.model_validate(
        {**CHAT, "add_generation_prompt": False, "continue_final_message": True})
    assert (req.add_generation_prompt, req.continue_final_message) == (False, True)
    err = rejected(ChatCompletionRequest, {**CHAT, "continue_final_message": True})
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"]


def test_completion_add_special_tokens_defaults_on():
    assert CompletionRequest.model_validate(COMPLETION).add_special_tokens is True
    assert CompletionRequest.model_validate({**COMPLETION, "add_special_tokens": False}) \
        .add_special_tokens is False


# ----------------------------------------------------------------- /tokenize, /detokenize bodies


def test_tokenize_bodies():
    assert tokenize_request_model({"prompt": "x"}) is TokenizePromptRequest
    assert tokenize_request_model({"messages": MSGS}) is TokenizeChatRequest
    p = TokenizePromptRequest.model_validate({"prompt": ""})
    assert (p.add_special_tokens, p.return_token_strs) == (True, False)
    c = TokenizeChatRequest.model_validate({"messages": MSGS})
    assert (c.add_generation_prompt, c.continue_final_message) == (True, False)
    for field, value in [("add_special_tokens", True), ("chat_template", "x"), ("tools", [{}]),
                         ("continue_final_message", True)]:
        assert rejected(TokenizeChatRequest, {"messages": MSGS, field: value})["param"].startswith(field)
    assert rejected(TokenizeChatRequest, {"messages": []})["param"] == "messages"
    assert rejected(TokenizePromptRequest, {})["param"] == "prompt"


@pytest.mark.parametrize("tokens", [[1, True], [1, "2"], [1.5], "1 2", None])
def test_detokenize_wants_integer_ids(tokens):
    assert rejected(DetokenizeRequest, {"tokens": tokens})["param"] == "tokens"
