"""A request's JSON body, read before any field is looked at.

Every way a body can be unusable is a 4xx with an OpenAI error body, never a 500: too
large (413, counted as it arrives, so a huge body is refused rather than buffered), not
JSON by its Content-Type (415), not UTF-8, not JSON, nested deeper than the parser's
recursion limit, not an object, or holding a lone UTF-16 surrogate (400).
"""
from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from serve_app.api.errors import KestrelAPIError

# A \uD800-\uDFFF escape: only with one can a parsed string hold a surrogate (a pair
# becomes one character; a strictly decoded UTF-8 text holds none).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def is_json_media_type(content_type: str | None) -> bool:
    """application/json or application/<x>+json, parameters (charset) aside. A browser
    sends text/plain or form types cross-origin without a CORS preflight, so accepting
    them would let any web page drive a server that has no API keys."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(max_bytes: int) -> KestrelAPIError:
    return KestrelAPIError(413, f"The request body is larger than this server's limit of "
                                f"{max_bytes} bytes")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise KestrelAPIError.bad_request("The request body is not valid UTF-8") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise KestrelAPIError.bad_request("The request body is not valid JSON") from None
    except RecursionError:
        raise KestrelAPIError.bad_request("The request body's JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise KestrelAPIError.bad_request("The request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and not _is_text(data):
        raise KestrelAPIError.bad_request(
            "The request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without "
            "its pair), which is not text")
    return data


def _is_text(data: dict[str, Any]) -> bool:
    """No string (key or value) holds a lone surrogate: all of it encodes as UTF-8."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    if not is_json_media_type(request.headers.get("content-type")):
        raise KestrelAPIError(415, "The request body must be JSON: send "
                                   "'Content-Type: application/json'")
    return parse_json_object(await read_body(request, max_bytes))
