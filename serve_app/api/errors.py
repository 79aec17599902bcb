"""API errors in OpenAI's body shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

# OpenAI-style `type` per HTTP status; clients (the official SDK included) pick their
# exception class from the status, the type/code are for humans and logs.
_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "overloaded_error",
}
_CODE_BY_STATUS: dict[int, str] = {
    401: "invalid_api_key",
    404: "model_not_found",
    429: "rate_limit_exceeded",
    503: "overloaded",
}


def error_type_for(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "invalid_request_error" if 400 <= status < 500 else "internal_error"


def error_body(status: int, message: str, type: str | None = None,  # noqa: A002 - OpenAI's name
               param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """The JSON body for an error response; type/code default from the status."""
    return {
        "error": {
            "message": message,
            "type": type or error_type_for(status),
            "param": param,
            "code": code if code is not None else _CODE_BY_STATUS.get(status),
        }
    }


class KestrelAPIError(Exception):
    """Raised anywhere in the request path; the ingress turns it into (status, body)."""

    def __init__(self, status: int, message: str, type: str | None = None,  # noqa: A002
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type or error_type_for(self.status)
        self.param = param
        self.code = code if code is not None else _CODE_BY_STATUS.get(self.status)
        self.headers = dict(headers or {})  # e.g. Retry-After on 429/503

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"KestrelAPIError({self.status}, {self.message!r}, param={self.param!r})"

    # Constructors for the cases the ingress raises, so status/type/code stay consistent.
    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> "KestrelAPIError":
        return cls(400, message, param=param)

    @classmethod
    def unauthorized(cls, message: str = "Invalid or missing API key") -> "KestrelAPIError":
        return cls(401, message)

    @classmethod
    def model_not_found(cls, model: str) -> "KestrelAPIError":
        return cls(404, f"The model '{model}' does not exist", param="model")

    @classmethod
    def overloaded(cls, status: int = 503, retry_after_s: int | None = None,
                   message: str = "The server is overloaded; retry later") -> "KestrelAPIError":
        headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
        return cls(status, message, headers=headers)

    @classmethod
    def internal(cls, message: str = "Internal server error") -> "KestrelAPIError":
        return cls(500, message)


# Pydantic inserts the name of the union member / validator it tried into `loc`
# (e.g. ("stop", "list[str]", 0) or ("x", "function-after[...]")); these are not field
# names, so they are dropped from the param a client sees.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "tuple"}


def _is_type_tag(part: str) -> bool:
    return part.lower() in _TYPE_TAGS or any(c in part for c in "[]()-,")


def loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """("messages", 0, "content") -> "messages.0.content"; () -> None."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and _is_type_tag(p))]
    return ".".join(parts) or None


def _short_input(value: Any) -> str | None:
    # Echo small scalar inputs back ("got -1") - it makes the message self-explaining,
    # but never echo whole objects or long strings (could be a prompt).
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return repr(value) if value is not None else "null"
    if isinstance(value, str) and len(value) <= 40:
        return repr(value)
    return None


def _one_message(err: dict[str, Any]) -> tuple[str | None, str]:
    param = loc_to_param(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid value"))
    if err.get("type") == "value_error" and msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    elif err.get("type") == "missing":
        msg = "field required"
    elif err.get("type") == "extra_forbidden":
        # A field no model declares: neither OpenAI's nor vLLM's (request_field_policy.py).
        msg = (f"{param or 'this field'} is not supported by Kestrel (not a field of this "
               "request in the OpenAI or vLLM API); remove it")
    elif err.get("type") not in ("value_error", "assertion_error"):
        got = _short_input(err.get("input"))
        if got is not None:
            msg = f"{msg} (got {got})"
    # Validators that already start with the field's name ("stop must be ...") need no prefix.
    if not param or msg.startswith(param):
        return param, msg
    return param, f"{param}: {msg}"


def validation_error_body(exc: ValidationError, max_listed: int = 3) -> tuple[int, dict[str, Any]]:
    """A pydantic ValidationError as a 400 body; `param` is the first offending field."""
    errors = exc.errors(include_url=False)
    if not errors:
        return 400, error_body(400, "Invalid request")
    described = [_one_message(e) for e in errors]
    text = "; ".join(m for _, m in described[:max_listed])
    if len(described) > max_listed:
        text += f" (and {len(described) - max_listed} more errors)"
    return 400, error_body(400, f"Invalid request: {text}", param=described[0][0])
