"""JSON schemas as the grammar engine enforces them (serve_app/text/grammar.py): each bound
Kestrel accepts is one the compiled grammar's matcher holds the output to (a string that
breaks it is refused, one that meets it accepted), each one the engine would drop is a
ValueError naming it before anything compiles, and JSON outputs are compact unless the
request or the server asks for any whitespace."""
from __future__ import annotations

import json

import pytest
import xgrammar

from serve_app.text.grammar import (ANNOTATION_KEYWORDS, COMPACT_SEPARATORS, ENFORCED_KEYWORDS, FORMATS,
                                    REFUSED_KEYWORDS, GrammarCompiler, check_spec)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def accepts(compiler: GrammarCompiler, spec, text: str, whitespace: str = "compact") -> bool:
    """Whether the compiled grammar's matcher takes `text` whole and may end after it."""
    compiled = xgrammar.CompiledGrammar.deserialize_json(compiler.compile(spec, whitespace),
                                                         compiler.info)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def compact(text: str) -> str:
    """`text` (JSON) laid out as the compact grammar lays it out."""
    return json.dumps(json.loads(text), separators=COMPACT_SEPARATORS, ensure_ascii=False)


def schema_spec(schema) -> tuple[str, str]:
    return ("json_schema", json.dumps(schema))


# (keyword, schema, meets it, breaks it)
BOUNDS = [
    ("type", {"type": "integer"}, "7", '"7"'),
    ("maxLength", {"type": "string", "maxLength": 3}, '"abc"', '"abcd"'),
    ("minLength", {"type": "string", "minLength": 2}, '"ab"', '"a"'),
    ("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]$"}, '"ab-1"', '"ab-x"'),
    ("format", {"type": "string", "format": "date"}, '"2024-02-29"', '"Feb 29"'),
    ("enum", {"enum": ["red", 3, None]}, "3", '"blue"'),
    ("const", {"const": "fixed"}, '"fixed"', '"other"'),
    ("minimum", {"type": "integer", "minimum": 3}, "3", "2"),
    ("maximum", {"type": "number", "maximum": 1.5}, "1.5", "1.6"),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1.5}, "1.4", "1.5"),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, "6", "7"),
    ("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1,2]", "[1]"),
    ("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1,2]", "[1,2,3]"),
    ("items", {"type": "array", "items": {"type": "string"}}, '["a"]', "[1]"),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, '[1,"a"]', '["a",1]'),
    ("unevaluatedItems", {"type": "array", "prefixItems": [{"type": "integer"}],
                          "unevaluatedItems": False}, "[1]", "[1,2]"),
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1}', '{"a":"x"}'),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
     '{"a":1}', "{}"),
    ("additionalProperties", {"type": "object", "additionalProperties": {"type": "integer"}},
     '{"b":2}', '{"b":"x"}'),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                               "unevaluatedProperties": {"type": "integer"}}, '{"a":1,"b":2}', '{"a":1,"b":"x"}'),
    ("patternProperties", {"type": "object", "patternProperties": {"^x.*$": {"type": "integer"}},
                           "additionalProperties": False}, '{"xa":2}', '{"ya":2}'),
    ("propertyNames", {"type": "object", "propertyNames": {"type": "string", "maxLength": 2},
                       "additionalProperties": {"type": "integer"}}, '{"xa":2}', '{"xaa":2}'),
    ("minProperties", {"type": "object", "additionalProperties": {"type": "integer"},
                       "minProperties": 1}, '{"b":2}', "{}"),
    ("maxProperties", {"type": "object", "additionalProperties": {"type": "integer"},
                       "maxProperties": 1}, '{"b":2}', '{"b":2,"c":3}'),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, '"ab"', '"abc"'),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"x"'),
    ("allOf", {"allOf": [{"type": "string", "maxLength": 2}]}, '"ab"', '"abc"'),
    ("$ref", {"$defs": {"n": {"type": "integer", "maximum": 9}}, "$ref": "#/$defs/n"}, "9", "10"),
    ("$defs", {"$defs": {"s": {"type": "string", "maxLength": 1}}, "type": "array",
               "items": {"$ref": "#/$defs/s"}}, '["a"]', '["ab"]'),
    ("definitions", {"definitions": {"s": {"type": "string", "maxLength": 1}},
                     "$ref": "#/definitions/s"}, '"a"', '"ab"'),
]


@pytest.mark.parametrize("keyword,schema,meets,breaks", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_each_supported_bound_holds_the_output(compiler, keyword, schema, meets, breaks):
    check_spec(schema_spec(schema))  # accepted, not refused
    assert accepts(compiler, schema_spec(schema), compact(meets))
    assert not accepts(compiler, schema_spec(schema), compact(breaks))


def test_every_enforced_keyword_has_its_test():
    assert {b[0] for b in BOUNDS} == ENFORCED_KEYWORDS


@pytest.mark.parametrize("fmt,meets", [
    ("date-time", '"2024-01-02T03:04:05Z"'), ("email", '"a@b.co"'), ("ipv4", '"10.0.0.1"'),
    ("uuid", '"123e4567-e89b-12d3-a456-426614174000"'), ("time", '"03:04:05Z"')])
def test_formats_hold_the_output(compiler, fmt, meets):
    spec = schema_spec({"type": "string", "format": fmt})
    assert fmt in FORMATS
    assert accepts(compiler, spec, meets) and not accepts(compiler, spec, '"not it"')


@pytest.mark.parametrize("whitespace", ["compact", "any"])
def test_a_bounded_string_holds_no_raw_control_character(compiler, whitespace):
    # xgrammar's own rule for a length-bounded string let a raw tab through: invalid JSON.
    spec = schema_spec({"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}})
    assert accepts(compiler, spec, '{"s": "a b"}', whitespace)
    for raw in ("\t", "\x01", "\n"):
        assert not accepts(compiler, spec, '{"s": "a' + raw + 'b"}', whitespace), repr(raw)


def test_annotations_are_accepted(compiler):
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "T",
              "type": "object", "properties": {"a": {"type": "integer", "description": "d",
                                                     "default": 1, "examples": [1]}}}
    assert set(ANNOTATION_KEYWORDS) >= {"$schema", "title", "description", "default", "examples"}
    check_spec(schema_spec(schema))
    assert accepts(compiler, schema_spec(schema), '{"a": 1}')


# (keyword named in the error, schema, a string that breaks the schema yet the engine takes)
REFUSED = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    ("not", {"not": {"type": "integer"}}, "1"),
    ("if", {"if": {"type": "integer"}, "then": {"type": "integer", "minimum": 3}}, "2"),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, '"!!"'),
    ("maxLength", {"maxLength": 2}, '"abc"'),                              # no type beside it
    ("minimum", {"minimum": 3}, "2"),
    ("minItems", {"minItems": 2}, "[1]"),
    ("maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcd"'),
    ("maxLength", {"type": "string", "format": "email", "maxLength": 6}, '"ab@b.co"'),
    ("maxLength", {"type": "string", "enum": ["abc", "a"], "maxLength": 2}, '"abc"'),
    ("minimum", {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "type": "integer",
                 "minimum": 3}, "2"),
    ("allOf", {"allOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}, '"abc"'),
    ("format", {"type": "string", "format": "idn-email"}, '"!! !!"'),
]


@pytest.mark.parametrize("keyword,schema,breaks", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_a_keyword_the_engine_drops_is_refused_by_name(compiler, keyword, schema, breaks):
    with pytest.raises(ValueError, match=f'"{keyword}"'):
        check_spec(schema_spec(schema))
    # Why: compiled anyway, the grammar lets through an output the schema forbids.
    assert accepts(compiler, schema_spec(schema), compact(breaks))


def test_refusals_name_the_place_and_unknown_keywords_too():
    nested = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(ValueError, match=r'"uniqueItems" \(at /properties/tags\)'):
        check_spec(schema_spec(nested))
    with pytest.raises(ValueError, match='"x-extension".*not known'):
        check_spec(schema_spec({"type": "string", "x-extension": 1}))
    assert "uniqueItems" in REFUSED_KEYWORDS and not set(REFUSED_KEYWORDS) & ENFORCED_KEYWORDS


PERSON = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"type": "array", "items": {"type": "string"}}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("spec", [schema_spec(PERSON), ("json_object", "")], ids=["json_schema", "json_object"])
def test_compact_whitespace_is_one_line_with_one_space_after_separators(compiler, spec):
    assert COMPACT_SEPARATORS == (", ", ": ")
    assert accepts(compiler, spec, '{"a": 1, "b": ["x  y", "z"]}')  # a string keeps its spaces
    for spaced in ['{ "a" : 1, "b": []}', '{"a":1,"b":[]}', '{"a": 1,  "b": []}', '{"a": 1, "b": [] }',
                   '{\n"a": 1, "b": []}', '{"a":  1, "b": []}']:
        assert not accepts(compiler, spec, spaced), spaced
        assert accepts(compiler, spec, spaced, "any"), spaced


def test_whitespace_is_part_of_the_cached_grammar(compiler):
    spec = schema_spec(PERSON)
    assert compiler.compile(spec, "compact") != compiler.compile(spec, "any")
    assert compiler.compile(spec) == compiler.compile(spec, "compact")
    assert compiler.compile(("regex", "[ab]+"), "any") == compiler.compile(("regex", "[ab]+"))
    with pytest.raises(ValueError, match="whitespace"):
        compiler.compile(spec, "tabs")
