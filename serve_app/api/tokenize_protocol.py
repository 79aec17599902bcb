"""Request and response bodies of /tokenize and /detokenize, as vLLM's server has them."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_serializer

from serve_app.api.openai_protocol import ChatMessage, ChatTemplateFields
from serve_app.api.request_field_policy import RejectedTemplateFields, RequestModel


class TokenizePromptRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS etc., as /v1/completions adds them
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields, RejectedTemplateFields):
    """The prompt /v1/chat/completions would build from these messages."""

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    return_token_strs: bool = False


def tokenize_request_model(data: dict[str, Any]) -> type[RequestModel]:
    """vLLM tells the two bodies apart by their fields: `messages` or `prompt`."""
    return TokenizeChatRequest if "messages" in data else TokenizePromptRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None

    @model_serializer(mode="wrap")
    def _omit_unasked(self, handler: Any) -> dict[str, Any]:
        # token_strs only when return_token_strs asked for them.
        data = handler(self)
        if data.get("token_strs") is None:
            data.pop("token_strs", None)
        return data


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _ids(cls, v: Any) -> Any:
        # pydantic would read true as 1 and "7" as 7; neither is a token id.
        if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
            raise ValueError("tokens must be a list of integer token ids")
        return v


class DetokenizeResponse(BaseModel):
    prompt: str
