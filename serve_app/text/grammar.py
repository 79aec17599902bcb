"""Structured outputs in the front end: what a request constrains its output to, checked
and compiled with xgrammar (a grammar engine with token masks per step).

A constraint is a spec (kind, text): "json_schema" (a JSON schema), "json_object" (any
JSON object), "regex", "choice" (a JSON list of strings, one of which is the whole
output) or "grammar" (EBNF, as xgrammar and vLLM take it). The front end checks it (a
400 naming the field if it does not parse, or if a JSON schema asks for something the
engine does not enforce), compiles it off the event loop into a serialized grammar the
ranks deserialize (actors/sampling/grammar_rows.py), and caches both. JSON kinds compile
with compact whitespace or any (JSON_WHITESPACE).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

GrammarSpec = tuple[str, str]
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_KINDS = ("json_schema", "json_object")
# "compact": one line, no whitespace but one space after each "," and ":" (Python's
# json.dumps; SmolLM2 writes `": "` rather than `":"`, and sampled at temperature 1 without
# the space it filled json_object's keys with prose more often, in 10 requests);
# "any": any run of whitespace, which a small sampled model fills until max_tokens cuts
# the document. Strings keep their own spaces either way.
JSON_WHITESPACE = ("compact", "any")
COMPACT_SEPARATORS = (", ", ": ")
_CACHED_GRAMMARS = 256
# xgrammar (0.2.9) writes the characters of a string with minLength or maxLength as
# _BOUNDED_STRING_CHAR, which lets a raw tab or other control character through: JSON
# forbids them in a string, so such an output did not parse. _JSON_STRING_CHAR is JSON's.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'
# xgrammar's errors start "[hh:mm:ss] /path/file.cc:123: "; the rest is for the client.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")

# What xgrammar (0.2.9) makes of a JSON schema's keywords, found by compiling schemas and
# matching strings (tests/unit/test_json_grammar_bounds.py checks each enforced bound).
# A keyword outside ENFORCED and ANNOTATIONS is a 400 naming it: the engine would drop it
# and the output could break it. docs/serve.md repeats these lists.
ENFORCED_KEYWORDS = frozenset({
    "type", "enum", "const",
    "properties", "required", "additionalProperties", "unevaluatedProperties",
    "patternProperties", "propertyNames", "minProperties", "maxProperties",
    "items", "prefixItems", "unevaluatedItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
})
# Describe, constrain nothing: accepted as they are.
ANNOTATION_KEYWORDS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly",
})
# Known and ignored by the engine (the output could break them): refused, by name.
REFUSED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains",
                    "dependentRequired", "dependentSchemas", "not", "if", "then", "else",
                    "contentEncoding", "contentMediaType", "contentSchema", "$anchor",
                    "$dynamicRef", "nullable", "discriminator")
# "format" values the engine turns into a pattern; others it ignores.
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4",
                     "ipv6", "uri", "uri-reference", "uri-template", "uuid", "json-pointer",
                     "relative-json-pointer"})
# A bound applies only to its type (JSON Schema): without that type named beside it the
# engine ignores it, so it needs "type" to name one of these.
_BOUND_TYPES = {**dict.fromkeys(("minLength", "maxLength", "pattern", "format"), {"string"}),
                **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                 "multipleOf"), {"integer", "number"}),
                **dict.fromkeys(("minItems", "maxItems"), {"array"}),
                **dict.fromkeys(("minProperties", "maxProperties"), {"object"})}
# Beside these the engine ignores the other constraints of the same schema.
_ALONE = ("enum", "const", "anyOf", "oneOf", "allOf", "$ref")
_BESIDE_ALONE = ANNOTATION_KEYWORDS | {"type", "$defs", "definitions"}
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
              "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def _types(schema: dict[str, Any]) -> set[str]:
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _refusal(schema: dict[str, Any], keyword: str) -> str | None:
    """Why the engine would not enforce `keyword` of `schema`, or None if it does."""
    if keyword in ANNOTATION_KEYWORDS:
        return None
    if keyword in REFUSED_KEYWORDS:
        return "ignored by Kestrel's grammar engine"
    if keyword not in ENFORCED_KEYWORDS:
        return "not known to Kestrel's grammar engine"
    needs = _BOUND_TYPES.get(keyword)
    if needs and not needs & _types(schema):
        return f"ignored without \"type\" naming {' or '.join(sorted(needs))} beside it (add that type)"
    if keyword == "format" and schema["format"] not in FORMATS:
        return (f"ignored for the format {schema['format']!r} (the grammar engine enforces "
                f"{', '.join(sorted(FORMATS))})")
    if keyword in ("minLength", "maxLength"):
        beside = [k for k in ("pattern", "format") if k in schema]
        if beside:
            return f"ignored beside \"{beside[0]}\""
    if keyword == "allOf" and isinstance(schema["allOf"], list) and len(schema["allOf"]) > 1:
        return "ignored with more than one schema in it"
    if keyword == "items" and isinstance(schema["items"], list):
        return "a list, which the grammar engine ignores (send prefixItems)"
    if keyword not in _ALONE and keyword not in _BESIDE_ALONE:
        alone = next((k for k in _ALONE if k in schema), None)
        if alone is not None:
            return f"ignored beside \"{alone}\""
    return None


def _walk(schema: Any, path: str) -> None:
    if not isinstance(schema, dict):
        return  # true, false (and anything else the compiler refuses)
    for keyword in schema:
        why = _refusal(schema, keyword)
        if why is not None:
            raise ValueError(f"the JSON schema's \"{keyword}\" (at {path or '/'}) is {why}; "
                             "remove it")
    for k in _SUBSCHEMA:
        if k in schema:
            _walk(schema[k], f"{path}/{k}")
    for k in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(k), dict):
            for name, sub in schema[k].items():
                _walk(sub, f"{path}/{k}/{name}")
    for k in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(k), list):
            for i, sub in enumerate(schema[k]):
                _walk(sub, f"{path}/{k}/{i}")


def refuse_unenforced(schema: Any) -> None:
    """Raises ValueError naming the first keyword of `schema` (a parsed JSON schema) that
    the engine would not enforce, with its place as a JSON pointer."""
    _walk(schema, "")


def _xgrammar():
    import xgrammar
    return xgrammar


def _message(e: Exception) -> str:
    text = _CPP_PREFIX.sub("", str(e).strip())
    return text.replace("Check failed: (error.empty()) is false: ", "").strip()


def choice_ebnf(choices: list[str]) -> str:
    """One of `choices`, exactly: an EBNF alternation of string literals (JSON's escapes
    are EBNF's)."""
    return "root ::= " + " | ".join(f"({json.dumps(c, ensure_ascii=False)})" for c in choices)


def _grammar(spec: GrammarSpec, whitespace: str = "compact"):
    xgr = _xgrammar()
    kind, text = spec
    layout = ({"any_whitespace": False, "separators": COMPACT_SEPARATORS} if whitespace == "compact"
              else {"any_whitespace": True})
    if kind == "json_schema":
        grammar = xgr.Grammar.from_json_schema(text, strict_mode=True, **layout)
        ebnf = str(grammar)
        if _BOUNDED_STRING_CHAR not in ebnf:
            return grammar
        return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
    if kind == "json_object":  # an object, as OpenAI's json_object (xgrammar's builtin JSON allows arrays)
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **layout)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def check_spec(spec: GrammarSpec) -> None:
    """Raises ValueError with the grammar engine's reason when `spec` does not parse, or
    naming the keyword of a JSON schema the engine would not enforce."""
    if spec[0] == "json_schema":
        try:
            schema = json.loads(spec[1])
        except ValueError as e:
            raise ValueError(f"the json schema is not JSON: {e}") from None
        refuse_unenforced(schema)
    check_parses(spec)


def check_parses(spec: GrammarSpec) -> None:
    """Raises ValueError with the grammar engine's reason when `spec` does not parse."""
    try:
        _grammar(spec)
    except RuntimeError as e:
        raise ValueError(f"the {spec[0].replace('_', ' ')} does not compile: {_message(e)}") from None


class GrammarCompiler:
    """xgrammar's compiler over one tokenizer, with the compiled grammars cached
    (serialized, as they travel to the ranks)."""

    def __init__(self, tokenizer: Any):
        xgr = _xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self._vocab_json: str | None = None
        self._cache: OrderedDict[tuple[GrammarSpec, str], str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_json(self) -> str:
        """The tokenizer as xgrammar knows it, serialized (about 1.6 MB for SmolLM2): each
        rank deserializes its grammars against it."""
        with self._lock:
            if self._vocab_json is None:
                self._vocab_json = self.info.serialize_json()
            return self._vocab_json

    def compile(self, spec: GrammarSpec, whitespace: str = "compact") -> str:
        """The serialized compiled grammar (about 20 ms for a small JSON schema the first
        time on the 2-core CPU; cached after), JSON kinds with `whitespace` (one of
        JSON_WHITESPACE). Call it off the event loop."""
        if whitespace not in JSON_WHITESPACE:
            raise ValueError(f"whitespace is one of {JSON_WHITESPACE}, not {whitespace!r}")
        key = (spec, whitespace if spec[0] in JSON_KINDS else "")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self.compiler.compile_grammar(_grammar(spec, whitespace)).serialize_json()
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled


_COMPILERS: dict[int, GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any) -> GrammarCompiler:
    """One compiler per tokenizer object (building xgrammar's vocabulary takes 0.6 s)."""
    with _COMPILERS_LOCK:
        c = _COMPILERS.get(id(tokenizer))
        if c is None:
            c = _COMPILERS[id(tokenizer)] = GrammarCompiler(tokenizer)
        return c
