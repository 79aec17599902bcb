"""A rank's grammar state set up ahead of the step that needs it (actors/sampling/grammar_rows.py):
the vocabulary sent at start-up is kept when the first grammar plan brings it again, and
a compiled grammar is deserialized once for the requests that share it (on the step
thread each costs 1.7-2.4 ms for a JSON schema), within a bound."""
from __future__ import annotations

import actors.sampling.grammar_rows as grammar_rows
from actors.sampling.grammar_rows import GrammarRows
from serve_app.text.grammar import GrammarCompiler

SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'


def test_vocab_kept_and_compiled_grammars_shared(tokenizer, monkeypatch):
    c = GrammarCompiler(tokenizer)
    rows = GrammarRows()
    rows.set_vocab(c.vocab_json)
    info = rows.info
    rows.set_vocab(str(c.vocab_json))  # the first grammar plan's copy: kept, not rebuilt
    assert rows.info is info
    schema, regex = c.compile(("json_schema", SCHEMA)), c.compile(("regex", "[ab]+"))
    rows.reset(1, schema, [])
    rows.reset(2, "" + schema, [])  # another request, the same grammar
    rows.reset(3, regex, [])
    assert rows._compiled[schema] is rows._grammar(schema)
    assert len(rows._compiled) == 2
    # Each row still has a matcher of its own: row 1 moves, row 2 stays at the start.
    m1, m2 = rows.matchers[1], rows.matchers[2]
    assert m1 is not m2
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    assert m1.accept_token(brace)
    assert not m1.accept_token(brace)  # the schema's object does not open twice
    assert m2.accept_token(brace)
    # The bound: the least recently used grammar goes first.
    monkeypatch.setattr(grammar_rows, "_KEPT_GRAMMARS", 2)
    rows._grammar(schema)  # regex is now the oldest
    rows.reset(4, c.compile(("regex", "[cd]+")), [])
    assert regex not in rows._compiled and schema in rows._compiled and len(rows._compiled) == 2


def test_a_rank_without_xgrammar_starts_and_says_so(monkeypatch, caplog):
    """A GPU machine that only trains draft heads has no xgrammar: the engine's ranks
    (the trainer's measurement) start anyway, and the start-up log names what is missing."""
    def missing():
        raise ModuleNotFoundError("No module named 'xgrammar'", name="xgrammar")
    monkeypatch.setattr(grammar_rows, "_xgrammar", missing)
    with caplog.at_level("WARNING", logger="kestrel.grammar"):
        GrammarRows.preload()
    assert "structured outputs unavailable: No module named 'xgrammar'" in caplog.text
