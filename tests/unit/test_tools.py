"""serve_app/api/tools.py: tool calls out of a model's text (streamed in any split), the
prompt for a template without a tool format, and the constraint of required and named
tool_choice, which compiles and admits exactly the calls it should."""
from __future__ import annotations

import json

import pytest

from serve_app.text.grammar import check_spec
from serve_app.api.tools import OPEN, CLOSE, AutoParser, ToolOutput, constraint, template_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
TEXT = (f'Let me check.{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}\n'
        f'{OPEN}{{"name": "nope", "arguments": {{}}}}{CLOSE} and <tool a{OPEN}{{"name": "get_time", '
        f'"arguments": {{"zone": "UTC"}}}}{CLOSE}done <tool_c')


def run(parser: AutoParser, pieces: list[str]):
    content, calls = "", []
    for p in pieces:
        c, k = parser.feed(p)
        content += c
        calls += k
    rest, more = parser.finish()
    return content + rest, calls + more


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_auto_calls_come_out_whatever_the_split(step):
    content, calls = run(AutoParser(TOOLS), [TEXT[i:i + step] for i in range(0, len(TEXT), step)])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    # An unknown tool's block, a lone "<tool" and an unclosed tag stay content.
    assert content == (f'Let me check.{OPEN}{{"name": "nope", "arguments": {{}}}}{CLOSE} and '
                       '<tool adone <tool_c')


def test_streamed_content_is_never_held_longer_than_a_possible_tag():
    p = AutoParser(TOOLS)
    assert p.feed("Hello <to") == ("Hello ", [])
    assert p.feed("ast>") == ("<toast>", [])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_hold_the_call_and_parse_it_at_the_end(choice):
    out = ToolOutput(TOOLS, choice)
    text = ('[{"name": "get_time", "arguments": {"zone": "CET"}}]' if choice == "required"
            else '{"zone": "CET"}')
    assert out.feed(text[:5]) == ("", []) and out.feed(text[5:]) == ("", [])
    content, calls = out.finish("stop")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "CET"})]
    assert out.finish_reason("stop") == "tool_calls"
    cut = ToolOutput(TOOLS, choice)
    cut.feed(text[:9])
    assert cut.finish("length") == (text[:9], []) and cut.finish_reason("length") == "length"


def test_none_passes_text_through():
    out = ToolOutput(TOOLS, "none")
    assert out.feed(TEXT) == (TEXT, []) and out.finish("stop") == ("", [])
    assert out.finish_reason("stop") == "stop"


def test_required_constraint_compiles_and_matches_the_calls():
    import jsonschema
    kind, text = constraint(TOOLS, "required", parallel=True)
    check_spec((kind, text))
    schema = json.loads(text)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "x", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(constraint(TOOLS, "required", parallel=False)[1])
    assert one["maxItems"] == 1
    assert constraint(TOOLS, "auto", True) is None and constraint(TOOLS, "none", True) is None
    named = constraint(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True)
    assert json.loads(named[1]) == WEATHER["function"]["parameters"]


def test_history_and_tools_for_a_template_without_a_tool_format():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    out = template_messages(msgs, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"get_time"' in out[0]["content"]
    assert json.loads(out[2]["content"].removeprefix(OPEN).removesuffix(CLOSE)) == {
        "name": "get_weather", "arguments": {"city": "Rome"}}
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    assert template_messages([{"role": "user", "content": "x"}], TOOLS)[0]["role"] == "system"
