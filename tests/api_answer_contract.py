"""What every answer of the HTTP API must look like, whatever was asked: a 2xx, or a 4xx
with OpenAI's error body; never a 5xx, and never a Python traceback or an exception's
class name in a body (they tell a client about the server's insides, and nothing it can
act on). Shared by the fuzz tests and the hostile-input tests."""
from __future__ import annotations

import builtins
import json
import re

import jinja2
import pydantic
import starlette.exceptions

from actors.worker import step_channel
from serve_app.engine import engine_client
from serve_app.api import errors
from serve_app.engine import rank_channel
from serve_app.engine import request_stream

TRACEBACK = re.compile(r'Traceback \(most recent call last\)|File "[^"]+", line \d+')
_EXCEPTION_CLASSES = {
    name for module in (builtins, errors, engine_client, rank_channel, request_stream,
                        step_channel, pydantic, jinja2, starlette.exceptions)
    for name, obj in vars(module).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}
EXCEPTION_NAME = re.compile(r"\b(%s)\b" % "|".join(sorted(_EXCEPTION_CLASSES)))


def assert_error_body(body: bytes | str) -> dict:
    """OpenAI's {"error": {"message", "type", "param", "code"}}, with a message that
    names no exception class and holds no traceback."""
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], (str, int)), err
    assert not TRACEBACK.search(err["message"]), err
    assert not EXCEPTION_NAME.search(err["message"]), err
    return err


def assert_api_answer(status: int, content_type: str, body: bytes) -> None:
    assert 200 <= status < 300 or 400 <= status < 500, (status, body[:500])
    assert not TRACEBACK.search(body.decode("utf-8", "replace")), body[:500]
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type)
        assert_error_body(body)
    elif content_type.startswith("text/event-stream"):
        # A stream that failed after its 200 reports the error in-band, as one event.
        for event in body.decode().split("\n\n"):
            if event.startswith("data: {") and '"error"' in event[:20]:
                assert_error_body(event[len("data: "):])
    elif content_type.startswith("application/json"):
        json.loads(body)
