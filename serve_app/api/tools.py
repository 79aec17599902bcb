"""Tool calling: OpenAI's `tools` and `tool_choice` on chat completions.

The prompt: a chat template that renders tools itself (it mentions `tools`) gets them;
for one that does not (SmolLM2's), Kestrel writes the tools' signatures into the system
message and asks for each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes format many models are trained on), and renders earlier calls and tool
results the same way.

The output, by tool_choice:
- "required": constrained (serve_app/text/grammar.py) to a JSON array of calls, each one of the
  tools with arguments valid for its parameters schema (one call without
  parallel_tool_calls); always parsed into tool_calls.
- a named function: constrained to that function's arguments.
- "auto" (the default with tools): free text; `<tool_call>` blocks that hold a call of a
  known tool become tool_calls, the rest stays content.
- "none": free text, nothing parsed (the tools stay in the prompt, as OpenAI's do).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from serve_app.text.grammar import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _signature(tool: dict[str, Any]) -> str:
    fn = tool["function"]
    sig = {"name": fn["name"], "description": fn.get("description") or "",
           "parameters": fn.get("parameters") or {"type": "object", "properties": {}}}
    return json.dumps(sig, ensure_ascii=False)


def system_text(tools: list[dict[str, Any]]) -> str:
    """The tool instructions Kestrel adds for a template without a tool format."""
    lines = "\n".join(_signature(t) for t in tools)
    return ("You can call functions to help with the user's request. Their signatures, "
            "one JSON object per line, are inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call one, reply with a JSON object holding the function's name and its "
            f"arguments inside {OPEN}{CLOSE} tags, one block per call:\n"
            f'{OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CLOSE}')


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments") or "{}"
    try:
        args_value = json.loads(args)
    except ValueError:
        args_value = args
    return f'{OPEN}\n{json.dumps({"name": fn.get("name"), "arguments": args_value}, ensure_ascii=False)}\n{CLOSE}'


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages (with assistant tool_calls and tool results) for a template without a
    tool format: calls as <tool_call> blocks in the assistant's text, results as user
    turns inside <tool_response>, the tools' instructions in the system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            m["content"] = "\n".join(filter(None, [m.get("content") or "", *map(_call_block, calls)]))
        if m["role"] == "tool":
            m = {"role": "user",
                 "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    if tools:
        text = system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def named(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


def mode(tools: list[dict[str, Any]] | None, tool_choice: Any) -> str:
    """"none" | "auto" | "required" | "named"."""
    if not tools or tool_choice == "none":
        return "none"
    if tool_choice in (None, "auto"):
        return "auto"
    return "required" if tool_choice == "required" else "named"


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def constraint(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> GrammarSpec | None:
    """The grammar a required or named tool_choice puts on the output (None for the rest)."""
    m = mode(tools, tool_choice)
    if m == "named":
        tool = next(t for t in tools if t["function"]["name"] == named(tool_choice))
        return ("json_schema", json.dumps(_parameters(tool)))
    if m != "required":
        return None
    one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)}}
           for t in tools]
    array = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    if not parallel:
        array["maxItems"] = 1
    return ("json_schema", json.dumps(array))


def _parse_block(body: str, known: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolOutput:
    """One choice's output as content and tool calls, fed as it streams: `feed` returns
    what can be sent now, `finish` the rest. "none" passes text through; "auto" parses
    blocks as they close (AutoParser); "required" and "named" hold everything, as the
    whole output is the call(s), and parse it at the end (an output cut by max_tokens is
    returned as content)."""

    def __init__(self, tools: list[dict[str, Any]] | None, tool_choice: Any):
        self.mode = mode(tools, tool_choice)
        self.name = named(tool_choice)
        self.auto = AutoParser(tools or []) if self.mode == "auto" else None
        self.held: list[str] = []
        self.called = False  # some call was returned

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.mode == "none":
            return text, []
        if self.auto is not None:
            content, calls = self.auto.feed(text)
            self.called |= bool(calls)
            return content, calls
        self.held.append(text)
        return "", []

    def finish(self, finish_reason: str | None) -> tuple[str, list[ToolCall]]:
        if self.auto is not None:
            return self.auto.finish()
        text = "".join(self.held)
        self.held = []
        if self.mode == "none":
            return "", []
        if finish_reason != "stop":  # cut short: the constrained JSON may be incomplete
            return text, []
        self.called = True
        if self.mode == "named":
            return "", [ToolCall(self.name, text)]
        return "", [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                    for c in json.loads(text)]

    def last(self, text: str, finish_reason: str | None) -> tuple[str, list[ToolCall]]:
        """`feed` of the output's last text, then `finish`, together."""
        content, calls = self.feed(text)
        rest, more = self.finish(finish_reason)
        return content + rest, calls + more

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools and stopped by itself."""
        return "tool_calls" if self.called and reason == "stop" else reason


class AutoParser:
    """tool_choice auto, streamed: content passes through as it comes, except text that
    may open a <tool_call> block, held until it is one or is not; a whole block that
    holds a call of a known tool becomes a ToolCall, any other stays content."""

    def __init__(self, tools: list[dict[str, Any]]):
        self.known = {t["function"]["name"] for t in tools}
        self.buf = ""
        self.inside = False
        self.after_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content, calls = [], []
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if end < 0:
                    break
                body, self.buf = self.buf[:end], self.buf[end + len(CLOSE):]
                self.inside = False
                call = _parse_block(body.strip(), self.known)
                if call is None:
                    content.append(f"{OPEN}{body}{CLOSE}")
                else:
                    calls.append(call)
                    self.after_call = True
                continue
            if self.after_call and self.buf:  # the newline after a call is the call's
                self.buf = self.buf[1:] if self.buf[0] == "\n" else self.buf
                self.after_call = False
            start = self.buf.find(OPEN)
            if start >= 0:
                content.append(self.buf[:start])
                self.buf = self.buf[start + len(OPEN):]
                self.inside = True
                continue
            keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                         if OPEN.startswith(self.buf[-k:])), 0)  # a possible opening, held
            content.append(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The output ended: what is held is content (an unclosed block too)."""
        rest = (OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return rest, []
