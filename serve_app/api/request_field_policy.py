"""Request fields of the OpenAI and vLLM APIs that Kestrel does not act on.

Every field a client may send is one of three kinds: honoured (declared in
serve_app/api/openai_protocol.py), accepted here because it changes nothing about the output,
or declared here and rejected with a 400 naming it unless it carries its neutral value.
Any other field is a 400 too (`extra="forbid"`). Nothing is dropped silently: a client
that asks for beam search must learn that it did not get it.
The lists follow OpenAI's Chat Completions and Completions references and vLLM's "Extra
Parameters" of its OpenAI-compatible server; docs/serve.md repeats them.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


def _accepted_values_in_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    # The JSON schema (the OpenAPI document's request bodies) of a field `unsupported`
    # guards lists the only values it accepts, so the document says what a client may send.
    for dec in cls.__pydantic_decorators__.field_validators.values():
        accepted = getattr(dec.func, "accepted", None)
        if accepted is None:
            continue
        for name in dec.info.fields:
            schema["properties"][name] = {"enum": [None, *accepted], "default": None,
                                          "description": dec.func.description}


class RequestModel(BaseModel):
    """A request body: a field Kestrel does not know is an error, never dropped."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_accepted_values_in_schema)


def _same(v: Any, neutral: Any) -> bool:
    # In Python True == 1 and False == 0: a bool only matches a bool.
    return isinstance(v, bool) == isinstance(neutral, bool) and v == neutral


def unsupported(name: str, hint: str, *neutral: Any):
    """Field validator rejecting every value but null and `neutral` (those that ask for
    nothing beyond what Kestrel does anyway): silently ignoring a penalty or a logprobs
    request would return something other than what the client asked for."""

    def check(cls, v: Any) -> Any:
        if v is None or any(_same(v, n) for n in neutral):
            return v
        raise ValueError(check.description)

    check.accepted = neutral
    check.description = f"{name} is not supported by Kestrel ({hint})"
    return field_validator(name, mode="before")(check)


# --------------------------------------------------------------------------- accepted


class NoEffectFields(RequestModel):
    """Both endpoints: an end-user id, for OpenAI's abuse monitoring."""

    user: str | None = None


class NoEffectChatFields(RequestModel):
    """Chat only: bookkeeping and routing hints of OpenAI's service; the output is the same
    with or without them; the prompt cache hints are moot as Kestrel's prefix cache is automatic."""

    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None


# --------------------------------------------------------------------------- rejected


class RejectedSamplingFields(RequestModel):
    """Both endpoints (OpenAI's, then vLLM's extra sampling and request fields)."""

    use_beam_search: bool | None = None
    length_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: list[Any] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    priority: int | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    _beam = unsupported("use_beam_search", "Kestrel samples; omit it or send false", False)
    _length_penalty = unsupported("length_penalty", "it applies to beam search only; "
                                  "omit it or send 1", 1)
    _allowed = unsupported("allowed_token_ids", "omit it")
    _processors = unsupported("logits_processors", "omit it", [])
    _stop_str = unsupported("include_stop_str_in_output", "the stop string is never part "
                            "of the output; omit it or send false", False)
    _skip_special = unsupported("skip_special_tokens", "special tokens are always left out "
                                "of the text; omit it or send true", True)
    _spaces_special = unsupported("spaces_between_special_tokens", "omit it or send true", True)
    _truncate = unsupported("truncate_prompt_tokens", "a prompt longer than the context is "
                            "a 400; omit it and shorten the prompt yourself")
    _truncation_side = unsupported("truncation_side", "Kestrel does not truncate prompts; "
                                   "omit it")
    _guided_backend = unsupported("guided_decoding_backend", "Kestrel's grammar engine is "
                                  "xgrammar; omit it or send \"xgrammar\"", "xgrammar")
    _guided_whitespace = unsupported("guided_whitespace_pattern", "JSON outputs are compact "
                                     "or allow any whitespace; omit it and send "
                                     "structured_outputs.disable_any_whitespace")
    _structural_tag = unsupported("structural_tag", "omit it; use response_format or "
                                  "structured_outputs")
    _tokens_as_ids = unsupported("return_tokens_as_token_ids", "logprobs show tokens as text; "
                                 "omit it or send false", False)
    _token_ids = unsupported("return_token_ids", "omit it or send false", False)
    _priority = unsupported("priority", "requests are served first come, first served; "
                            "omit it or send 0", 0)
    _request_id = unsupported("request_id", "Kestrel makes its own response ids; omit it")
    _cache_salt = unsupported("cache_salt", "the prefix cache is shared by all requests; "
                              "omit it")
    _kv_transfer = unsupported("kv_transfer_params", "Kestrel has no disaggregated prefill; "
                               "omit it")
    _xargs = unsupported("vllm_xargs", "omit it", {})


class RejectedTemplateFields(RequestModel):
    """vLLM's chat-template inputs (chat and /tokenize with messages)."""

    add_special_tokens: bool | None = None
    documents: list[Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    _special = unsupported("add_special_tokens", "the chat template adds the special tokens; "
                           "omit it or send false", False)
    _documents = unsupported("documents", "put the documents in a message; omit it")
    _template = unsupported("chat_template", "Kestrel uses the model's chat template; omit it")
    _template_kwargs = unsupported("chat_template_kwargs", "omit it", {})
    _mm_kwargs = unsupported("mm_processor_kwargs", "Kestrel serves text models; omit it", {})
    _media_kwargs = unsupported("media_io_kwargs", "Kestrel serves text models; omit it", {})


class RejectedChatFields(RejectedTemplateFields):
    """Chat only (OpenAI's, then vLLM's)."""

    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    echo: bool | None = None
    prompt_logprobs: int | None = None

    _functions = unsupported("functions", "the functions API is OpenAI's old one; send "
                             "tools", [])
    _function_call = unsupported("function_call", "the functions API is OpenAI's old one; "
                                 "send tool_choice", "none")
    _modalities = unsupported("modalities", "Kestrel generates text only; omit it or send "
                              "[\"text\"]", ["text"])
    _audio = unsupported("audio", "Kestrel generates text only; omit it")
    _prediction = unsupported("prediction", "omit it")
    _web_search = unsupported("web_search_options", "Kestrel has no web search; omit it")
    _reasoning = unsupported("reasoning_effort", "omit it")
    _verbosity = unsupported("verbosity", "omit it")
    _moderation = unsupported("moderation", "Kestrel runs no moderation; omit it")
    _echo = unsupported("echo", "omit it or send false", False)
    _prompt_logprobs = unsupported("prompt_logprobs", "it is served on /v1/completions; omit it")


class RejectedCompletionFields(RequestModel):
    """Completions only (OpenAI's, then vLLM's)."""

    suffix: str | None = None
    prompt_embeds: Any = None

    _suffix = unsupported("suffix", "Kestrel does not fill in the middle; omit it", "")
    _prompt_embeds = unsupported("prompt_embeds", "send the prompt as text or token ids")


class RejectedMessageFields(RequestModel):
    """Fields of a chat message beyond role, content and name: tool and audio turns."""

    function_call: Any = None
    refusal: str | None = None
    audio: Any = None

    _function_call = unsupported("function_call", "the functions API is OpenAI's old one; "
                                 "send tool_calls")
    _refusal = unsupported("refusal", "put the text in content; omit it")
    _audio = unsupported("audio", "Kestrel serves text models; omit it")
