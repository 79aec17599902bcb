"""OpenAI API request/response models (chat, completions, models, errors, stream chunks)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (BaseModel, Field, StrictBool, TypeAdapter, ValidationInfo, field_validator,
                      model_serializer, model_validator)

from actors.protocol.sampling_params import MAX_REPETITION_PENALTY, MAX_TEMPERATURE
from actors.sampling.logprobs import MAX_TOP
from serve_app.text.grammar import GrammarSpec, check_parses, check_spec, refuse_unenforced
from serve_app.api.tools import constraint as tool_constraint
from serve_app.api.request_field_policy import (NoEffectChatFields, NoEffectFields,
                                            RejectedChatFields, RejectedCompletionFields,
                                            RejectedMessageFields, RejectedSamplingFields,
                                            RequestModel, unsupported)

MAX_N = 16
# OpenAI's bound for top_logprobs, vLLM's default for both endpoints: what the ranks compute.
MAX_TOP_LOGPROBS = MAX_TOP
MAX_STOP_STRINGS = 16
# The engine keeps seeds and top_k in int64 (torch): a larger one failed the rank's step,
# and with it every request on the replica.
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
# Temperatures below this sample greedily, as vLLM's do: in float32, logits / 1e-40 are
# infinite, and the sampler's distribution NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


def make_id(prefix: str) -> str:
    """Response ids as OpenAI shapes them: 'chatcmpl-...', 'cmpl-...'."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


def _no_bool(v: Any) -> Any:
    # pydantic would read true as 1; a bool where a number belongs is a client bug.
    if isinstance(v, bool):
        raise ValueError("expected a number, got a boolean")
    return v


class StreamOptions(RequestModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None

    _no_obfuscation = unsupported("include_obfuscation", "Kestrel's chunks carry no "
                                  "obfuscation field; omit it or send false", False)


class JsonSchemaFormat(RequestModel):
    """OpenAI's response_format.json_schema. The output validates against `schema` with or
    without `strict` (xgrammar's strict mode: no properties beyond those listed)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self

    def spec(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return ("json_object", "")
        if self.type == "json_schema":
            return ("json_schema", json.dumps(self.json_schema.json_schema))
        return None


class StructuredOutputs(RequestModel):
    """vLLM's structured_outputs: at most one constraint, and how JSON constraints (this
    one's or response_format's, as vLLM) lay out whitespace."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    # true: compact JSON, false: any whitespace; null: the server's processing.json_whitespace.
    disable_any_whitespace: StrictBool | None = None

    def spec(self) -> GrammarSpec | None:
        set_ = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) > 1:
            raise ValueError(f"set one constraint, not {len(set_)} ({', '.join(k.rstrip('_') for k in set_)})")
        if not set_:
            return None
        return _spec_of(set_[0].rstrip("_"), getattr(self, set_[0]))


def _spec_of(kind: str, value: Any) -> GrammarSpec:
    """A structured_outputs / guided_* value as a grammar spec."""
    if kind == "json":
        return ("json_schema", value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        return ("json_object", "")
    if kind == "choice":
        return ("choice", json.dumps(value))
    return (kind, value)  # regex, grammar


# vLLM's older guided_* fields, honoured as the structured_outputs they name.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


class SamplingFields(NoEffectFields, RejectedSamplingFields):
    """Fields shared by chat and text completions that Kestrel honours."""

    # Structured outputs (serve_app/text/grammar.py): at most one of these.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    @field_validator("response_format", "structured_outputs")
    @classmethod
    def _constraint_compiles(cls, v: Any) -> Any:
        spec = v.spec() if v is not None else None
        if spec is not None:
            check_spec(spec)
        return v

    @field_validator(*_GUIDED)
    @classmethod
    def _guided_compiles(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            check_spec(_spec_of(_GUIDED[info.field_name], v))
        return v

    def _constraints(self) -> list[tuple[str, GrammarSpec]]:
        """(field, spec) for each field that constrains the output."""
        found = []
        for f in ("response_format", "structured_outputs"):
            v = getattr(self, f)
            spec = v.spec() if v is not None else None
            if spec is not None:
                found.append((f, spec))
        return found + [(f, _spec_of(kind, getattr(self, f))) for f, kind in _GUIDED.items()
                        if getattr(self, f) is not None]

    @model_validator(mode="after")
    def _one_constraint(self) -> "SamplingFields":
        named = [f for f, _ in self._constraints()]
        if len(named) > 1:
            raise ValueError(f"at most one output constraint per request; this one sets {', '.join(named)}")
        return self

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's output constraint, or None."""
        found = self._constraints()
        return found[0][1] if found else None

    def json_whitespace(self, default: str) -> str:
        """How a JSON constraint lays out whitespace: structured_outputs'
        disable_any_whitespace if set, else `default` (the server's setting)."""
        so = self.structured_outputs
        if so is None or so.disable_any_whitespace is None:
            return default
        return "compact" if so.disable_any_whitespace else "any"

    model: str | None = None  # None = the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # extension (as vLLM): -1 or 0 = off
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] | None = None  # str or list of str on the wire; normalized to a list
    stop_token_ids: list[int] | None = None  # extension
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    # Logit processing (kestrel_kernels/penalties.py), lossless under speculation: OpenAI's, then
    # vLLM's extensions.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI) -> bias
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)
    bad_words: list[str] | None = None  # vLLM's: tokenized by the server (openai_server.py)

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be within [-100, 100], got {bias}")
        return v

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                     mode="before")
    @classmethod
    def _no_bool_floats(cls, v: Any) -> Any:
        return _no_bool(v)

    @field_validator("n", "max_tokens", "top_k", "seed", "min_tokens", mode="before")
    @classmethod
    def _no_bool_ints(cls, v: Any) -> Any:
        return _no_bool(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("stop must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_non_negative(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # `stream` is declared first, so it is already in info.data (absent if invalid).
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    # --- helpers for the ingress -------------------------------------------------------
    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, default_max_tokens: int) -> dict[str, Any]:
        """Engine sampling params with OpenAI defaults filled in.

        top_k is normalized to -1 for "off"; a temperature too small to divide logits by
        to 0 (greedy); stop strings are de-duplicated and empty ones dropped (an empty
        stop would end every request at once)."""
        top_k = self.top_k if self.top_k not in (None, 0) else -1
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        if temperature < GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0
        stops: list[str] = []
        for s in self.stop or []:
            if s and s not in stops:
                stops.append(s)
        requested = self._requested_max_tokens()
        return {
            "max_tokens": requested if requested is not None else int(default_max_tokens),
            "temperature": temperature,
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "top_k": top_k,
            "seed": self.seed,
            "stop": stops,
            "stop_token_ids": list(dict.fromkeys(self.stop_token_ids or [])),
            "ignore_eos": bool(self.ignore_eos),
            "presence_penalty": float(self.presence_penalty or 0.0),
            "frequency_penalty": float(self.frequency_penalty or 0.0),
            "repetition_penalty": 1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            "logit_bias": {int(k): float(b) for k, b in (self.logit_bias or {}).items()},
            "min_p": float(self.min_p or 0.0),
            "min_tokens": int(self.min_tokens or 0),
            "bad_words": [],  # token sequences, filled in where the tokenizer is
            "logprobs": self._logprobs_top(),
            "prompt_logprobs": self._prompt_logprobs_top(),
            "grammar": None,  # compiled where the tokenizer is (openai_server.py)
            "n": self.n,
        }

    def _prompt_logprobs_top(self) -> int | None:
        return None


# --------------------------------------------------------------------------- chat


class ChatMessage(RejectedMessageFields):
    """One input message. `content` is normalized to plain text: OpenAI also allows a list
    of parts, of which Kestrel accepts only {"type": "text", "text": ...}."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    @field_validator("role", mode="before")
    @classmethod
    def _developer_is_system(cls, v: Any) -> Any:
        # Newer OpenAI clients send "developer" where older ones sent "system".
        return "system" if v == "developer" else v

    @model_validator(mode="before")
    @classmethod
    def _assistant_may_omit_content(cls, data: Any) -> Any:
        # OpenAI lets an assistant turn carry content null or none (a turn of tool calls).
        if isinstance(data, dict) and data.get("role") == "assistant" and data.get("content") is None:
            data = {**data, "content": ""}
        return data

    @model_validator(mode="after")
    def _tool_fields_in_their_turns(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to an assistant message")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"content part {i} has type {kind!r}, which is not supported "
                                     "by Kestrel (it serves text models); send text parts only")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i} needs a string 'text'")
                extra = sorted(set(part) - {"type", "text"})
                if extra:
                    raise ValueError(f"content part {i} has {extra[0]!r}, which is not supported "
                                     "by Kestrel; send only 'type' and 'text'")
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError("content must be a string or a list of text parts")

    def for_template(self) -> dict[str, Any]:
        """What the chat template sees (the rejected fields are null or empty)."""
        out = self.model_dump(include={"role", "content", "name", "tool_calls", "tool_call_id"},
                              exclude_none=True)
        if not out.get("tool_calls", True):
            del out["tool_calls"]  # [] is no call
        return out


class ToolCallFunction(RequestModel):
    name: str
    arguments: str  # JSON text


class ToolCallIn(RequestModel):
    """An earlier call in the history (an assistant message's tool_calls)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDef(RequestModel):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the arguments validate against parameters either way

    @field_validator("parameters")
    @classmethod
    def _parameters_compile(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # Keywords the grammar engine ignores matter only where the arguments are
        # constrained (tool_choice required or named: ChatCompletionRequest).
        if v is not None:
            check_parses(("json_schema", json.dumps(v)))
        return v


class ToolDef(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(RequestModel):
    class _Name(RequestModel):
        name: str

    type: Literal["function"]
    function: _Name


class ChatTemplateFields(RequestModel):
    """How the messages become a prompt (extensions, as vLLM; also on /tokenize)."""

    add_generation_prompt: bool = True  # end with the assistant turn's header
    continue_final_message: bool = False  # end inside the last message, which generation extends
    tools: list[ToolDef] | None = None  # rendered into the prompt (serve_app/api/tools.py)

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("two tools have one name")
        return v

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_prompt(cls, v: bool, info: ValidationInfo) -> bool:
        # add_generation_prompt is declared first, so it is already in info.data.
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message extends the last message, so it needs "
                             "add_generation_prompt false")
        return v


class ChatCompletionRequest(SamplingFields, NoEffectChatFields, RejectedChatFields,
                            ChatTemplateFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (required, named)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name of max_tokens

    @field_validator("tool_choice")
    @classmethod
    def _constrained_arguments_enforced(cls, v: Any, info: ValidationInfo) -> Any:
        # tools is declared first (ChatTemplateFields), so it is already in info.data. A
        # required or named choice constrains the arguments to the parameters schema, so
        # a keyword the grammar engine would drop there is refused (with auto or none the
        # schema only goes into the prompt).
        if v != "required" and not isinstance(v, NamedToolChoice):
            return v
        for tool in info.data.get("tools") or []:
            fn = tool.function
            if fn.parameters is None or (isinstance(v, NamedToolChoice) and v.function.name != fn.name):
                continue
            try:
                refuse_unenforced(fn.parameters)
            except ValueError as e:
                raise ValueError(f"tool {fn.name!r}'s parameters: {e}") from None
        return v

    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _no_bool_top(cls, v: Any) -> Any:
        return _no_bool(v)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def _logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _no_bool_max(cls, v: Any) -> Any:
        return _no_bool(v)

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        # max_tokens is declared first (SamplingFields), so it is already in info.data.
        other = info.data.get("max_tokens")
        if v is not None and other is not None and v != other:
            raise ValueError(f"max_completion_tokens ({v}) and max_tokens ({other}) differ; "
                             "they are two names of one limit, send one of them")
        return v

    def _requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise ValueError("tool_choice required or a named function needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        if self.tool_constraint() is not None and self._constraints():
            raise ValueError("at most one output constraint per request; tool_choice "
                             f"{self.tool_choice_value()!r} is one, and so is response_format "
                             "or structured_outputs")
        return self

    def tool_choice_value(self) -> Any:
        c = self.tool_choice
        return c.model_dump() if isinstance(c, NamedToolChoice) else c

    def tool_constraint(self) -> GrammarSpec | None:
        return None if not self.tools else tool_constraint(
            self.tool_dicts(), self.tool_choice_value(), self.parallel_tool_calls is not False)

    def grammar_spec(self) -> GrammarSpec | None:
        return self.tool_constraint() or super().grammar_spec()


# --------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields, RejectedCompletionFields):
    # str | list[int] | list[str] (batch) | list[list[int]] (batch)
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_bool_logprobs(cls, v: Any) -> Any:
        return _no_bool(v)

    echo: bool | None = False  # the prompt before the completion, in the text and the logprobs
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _no_bool_prompt_logprobs(cls, v: Any) -> Any:
        return _no_bool(v)

    def _logprobs_top(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs_top(self) -> int | None:
        """What the engine computes: the asked count, and with echo and logprobs the
        echoed prompt's alternatives too."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None
    best_of: int | None = None  # accepted when it equals n: every sample is returned
    add_special_tokens: bool = True  # extension (as vLLM): tokenizer's BOS etc. on text prompts

    @field_validator("best_of", mode="before")
    @classmethod
    def _no_bool_best_of(cls, v: Any) -> Any:
        return _no_bool(v)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        # n is declared first (SamplingFields), so it is already in info.data.
        n = info.data.get("n")
        if v is not None and n is not None and v != n:
            raise ValueError(f"best_of ({v}) other than n ({n}) is not supported by Kestrel "
                             "(it returns every sample it draws); omit it or send best_of = n")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # Checked by hand so a bad prompt gives one clear error at "prompt" rather than
        # one per union member.
        def token_list(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("prompt must be a non-empty string, list of token ids, "
                             "list of strings or list of token-id lists")
        if token_list(v):
            if any(t < 0 for t in v):
                raise ValueError("prompt token ids must be non-negative")
            return v
        if all(isinstance(p, str) for p in v):
            if any(not p for p in v):
                raise ValueError("prompt strings must not be empty")
            return v
        if all(token_list(p) for p in v):
            if any(not p for p in v):
                raise ValueError("prompt token lists must not be empty")
            if any(t < 0 for p in v for t in p):
                raise ValueError("prompt token ids must be non-negative")
            return v
        raise ValueError("prompt must be a string, list of token ids, list of strings "
                         "or list of token-id lists (not a mix)")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {"id", "type": "function", "function": {name, arguments}}

    @model_serializer(mode="wrap")
    def _calls_when_there_are(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


# vLLM's prompt_logprobs: per prompt token, None for the first, then {token id: entry} for
# the token itself and the top alternatives.
class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


_PROMPT_LOGPROBS = TypeAdapter(PromptLogprobs)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: make_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its "index" among the choice's calls

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends {"role": "assistant"} once, then {"content": "..."}; absent keys,
        # not nulls, which is what some clients test for.
        return {k: v for k, v in handler(self).items() if v is not None}


class _Chunk(BaseModel):
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _omit_null_usage(self, handler: Any) -> dict[str, Any]:
        # `usage` appears only in the final chunk when stream_options.include_usage is set.
        data = handler(self)
        if data.get("usage") is None:
            data.pop("usage", None)
        return data

    def to_sse(self) -> str:
        return sse_event(self)


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Chunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(default_factory=list)


class CompletionStreamChoice(BaseModel):
    index: int
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionChunk(_Chunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice] = Field(default_factory=list)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kestrel"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --------------------------------------------------------------------------- SSE

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event line for a chunk (or an error body mid-stream)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n"


class StreamChunks:
    """The SSE chunks of one streamed response, formatted by hand.

    The delta chunk is the one sent per batch of tokens, per stream: pydantic's
    model_dump_json of a ChatCompletionChunk cost several times this string join (both
    measured in tests/unit/test_openai_protocol.py, which also checks that the two give
    the same JSON). The first and the usage chunk, once per response, use the models."""

    def __init__(self, kind: Literal["chat", "completion"], response_id: str, model: str):
        self.kind = kind
        self.response_id = response_id
        self.model = model
        self.created = _now()
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = (f'data: {{"id":{json.dumps(response_id)},"object":"{obj}",'
                      f'"created":{self.created},"model":{json.dumps(model, ensure_ascii=False)},'
                      '"choices":[')

    def _model(self, choices: list[Any], usage: UsageInfo | None = None) -> BaseModel:
        cls = ChatCompletionChunk if self.kind == "chat" else CompletionChunk
        return cls(id=self.response_id, model=self.model, created=self.created,
                   choices=choices, usage=usage)

    def first(self, index: int) -> str | None:
        """Chat opens each choice with the assistant role; completions send nothing."""
        if self.kind != "chat":
            return None
        return sse_event(self._model([ChatCompletionStreamChoice(
            index=index, delta=DeltaMessage(role="assistant", content=""))]))

    def tool_calls(self, index: int, calls: list[dict[str, Any]]) -> str:
        """A chat delta carrying whole tool calls (each with its index among the choice's)."""
        choice = ChatCompletionStreamChoice(index=index, delta=DeltaMessage(tool_calls=calls))
        return f"{self._head}{choice.model_dump_json()}]}}\n\n"

    def delta(self, index: int, text: str, finish_reason: str | None,
              logprobs: BaseModel | None = None, prompt_logprobs: list | None = None) -> str:
        reason = "null" if finish_reason is None else f'"{finish_reason}"'
        lp = "null" if logprobs is None else logprobs.model_dump_json()
        if self.kind == "chat":
            delta = f'{{"content":{json.dumps(text, ensure_ascii=False)}}}' if text else "{}"
            choice = f'{{"index":{index},"delta":{delta},"finish_reason":{reason},"logprobs":{lp}}}'
        else:
            plp = "" if prompt_logprobs is None else (
                ',"prompt_logprobs":' + _PROMPT_LOGPROBS.dump_json(prompt_logprobs).decode())
            choice = (f'{{"index":{index},"text":{json.dumps(text, ensure_ascii=False)},'
                      f'"finish_reason":{reason},"logprobs":{lp}{plp}}}')
        return f"{self._head}{choice}]}}\n\n"

    def usage(self, usage: UsageInfo) -> str:
        return sse_event(self._model([], usage))
