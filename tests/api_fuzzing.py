"""Fuzzing one route of the HTTP API with schemathesis, from the app's own OpenAPI
document: Hypothesis draws requests that fit the documented body (positive) and requests
that break it (negative), sends each over HTTP, and holds every answer to
tests/api_answer_contract.py and to the document's response schemas."""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import schemathesis
from api_answer_contract import assert_api_answer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                 response_schema_conformance)

# Every route of build_api, so that a new one cannot go unfuzzed (the tests compare).
ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics")]
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


def document_routes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(method.upper(), path) for path, ops in doc["paths"].items() for method in ops]


def fuzz_route(doc: dict[str, Any], method: str, path: str, base_url: str, examples: int,
               headers: dict[str, str] | None = None,
               edit: Callable[[Any], None] | None = None, timeout: float = 30) -> Counter:
    """Sends `examples` drawn requests (derandomized: the same ones every run);
    `edit(case)` may change a case before it is sent. Returns the count per status."""
    operation = schemathesis.openapi.from_dict(doc)[path][method]
    # A route without parameters or body has no way to break its document.
    modes = MODES if method == "POST" else MODES[:1]
    statuses: Counter = Counter()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(*(operation.as_strategy(generation_mode=m) for m in modes)))
    def one(case):
        if edit is not None:
            edit(case)
        response = case.call(base_url=base_url, headers=headers, timeout=timeout)
        statuses[response.status_code] += 1
        content_type = response.headers.get("content-type", [""])[0]  # a list per header
        assert_api_answer(response.status_code, content_type, response.content)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance,
                                                 content_type_conformance])

    one()
    return statuses
