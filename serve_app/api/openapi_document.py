"""The OpenAPI document of the HTTP API: FastAPI's, plus the request bodies.

The handlers read and validate their bodies themselves (serve_app/api/request_body.py), so
that every malformed body gets OpenAI's error body and the checks run in Kestrel's order;
FastAPI therefore sees no body parameter and would document none. `install_openapi`
adds each POST route's request model, and marks the routes that need an API key.
`responses` is what a route declares it answers: its model on 200, OpenAI's error body
on any 4xx or 5xx.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

from serve_app.api.openai_protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
# JSON whatever the route's own media type (/metrics answers text/plain).
_ERROR = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"description": "OpenAI error body", "content": _ERROR},
    "5XX": {"description": "OpenAI error body (overloaded, unavailable)", "content": _ERROR},
}


def responses(model: type[BaseModel] | None = None, stream: bool = False,
              text: bool = False) -> dict[int | str, dict[str, Any]]:
    """`stream`: with "stream": true, server-sent events of chunks; `text`: plain text."""
    ok: dict[str, Any] = {"description": "Success"}
    if model is not None:
        ok["model"] = model
    if stream:
        ok["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    elif text:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return {200: ok, **_ERRORS}


# One server-sent event as OpenAPI 3.2 describes a text/event-stream item: its data is a
# JSON chunk, an in-band error body, or the final "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                             "id": {"type": "string"}, "retry": {"type": "integer"}}}


def install_openapi(app: FastAPI, bodies: dict[str, Any], keyed_paths: set[str]) -> None:
    """app.openapi() returns the document with `bodies` (path -> request model or union
    of models) as the POST routes' JSON bodies and `keyed_paths` needing a bearer key."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, bodies, keyed_paths)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document(app: FastAPI, bodies: dict[str, Any], keyed_paths: set[str]) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})

    def add(model: Any) -> dict[str, Any]:
        schema = TypeAdapter(model).json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        return schema

    schemas["ErrorResponse"] = add(ErrorResponse)
    for path, model in bodies.items():
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": add(model)}}}
    if keyed_paths:
        components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path in keyed_paths:
            for operation in doc["paths"][path].values():
                operation["security"] = [{"apiKey": []}]
    return doc
