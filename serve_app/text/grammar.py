"""Structured outputs in the front end: what a request constrains its output to, checked
and compiled with xgrammar (a grammar engine with token masks per step).

A constraint is a spec (kind, text): "json_schema" (a JSON schema), "json_object" (any
JSON object), "regex", "choice" (a JSON list of strings, one of which is the whole
output) or "grammar" (EBNF, as xgrammar and vLLM take it). The front end checks it (a
400 naming the field if it does not parse), compiles it off the event loop into a
serialized grammar the ranks deserialize (actors/sampling/grammar_rows.py), and caches both.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

GrammarSpec = tuple[str, str]
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_CACHED_GRAMMARS = 256
# xgrammar's errors start "[hh:mm:ss] /path/file.cc:123: "; the rest is for the client.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


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


def _grammar(spec: GrammarSpec):
    xgr = _xgrammar()
    kind, text = spec
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, strict_mode=True)
    if kind == "json_object":  # an object, as OpenAI's json_object (xgrammar's builtin JSON allows arrays)
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def check_spec(spec: GrammarSpec) -> None:
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
        self._cache: OrderedDict[GrammarSpec, str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_json(self) -> str:
        """The tokenizer as xgrammar knows it, serialized (about 1.6 MB for SmolLM2): each
        rank deserializes its grammars against it."""
        with self._lock:
            if self._vocab_json is None:
                self._vocab_json = self.info.serialize_json()
            return self._vocab_json

    def compile(self, spec: GrammarSpec) -> str:
        """The serialized compiled grammar (about 20 ms for a small JSON schema the first
        time on the 2-core CPU; cached after). Call it off the event loop."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self.compiler.compile_grammar(_grammar(spec)).serialize_json()
        with self._lock:
            self._cache[spec] = compiled
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
