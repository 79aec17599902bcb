"""Structured outputs under speculation (actors/sampling/grammar_rows.py): each tree node's target
logits are masked by the grammar state after the node's path, so greedy speculative
output equals greedy plain output under the same grammar, token for token, on chain and
tree shapes, with the random head and with an oracle draft (long accepts, so masks deep
in the tree decide), and every output the grammar lets end is one it accepts.

The target is a small random Llama with SmolLM2's vocabulary and tokenizer (conftest.py
grammar_model): the grammar engine needs a real tokenizer, and a random model shows the
grammar, not the model, shapes the output."""
from __future__ import annotations

import json
import re

import pytest
from spec_helpers import CHAIN, TREE, random_prompts, tiny_config
from test_penalties_lossless import speculate_and_compare

from actors.spec.step_graph import Variant
from serve_app.text.grammar import GrammarCompiler
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"]}
REGEX = r"[a-z]{2,6}(-[0-9]{2})?"
CHOICES = ["alpha", "beta gamma", "delta"]
SPECS = {"json_schema": ("json_schema", json.dumps(SCHEMA)), "json_object": ("json_object", ""),
         "regex": ("regex", REGEX), "choice": ("choice", json.dumps(CHOICES))}


@pytest.fixture(scope="module")
def compiled(tokenizer) -> dict[str, str]:
    c = GrammarCompiler(tokenizer)
    return {k: c.compile(spec) for k, spec in SPECS.items()}


@pytest.fixture(scope="module")
def plain_engine(grammar_model, tokenizer):
    return LLMEngine(tiny_config(grammar_model, spec=False), tokenizer=tokenizer)


def valid(kind: str, text: str) -> bool:
    if kind == "choice":
        return text in CHOICES
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    value = json.loads(text)  # raises if not JSON
    if kind == "json_object":
        return isinstance(value, dict)
    return set(value) == {"name", "n"} and isinstance(value["name"], str) \
        and len(value["name"]) <= 6 and isinstance(value["n"], int)


def params(grammar: str, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar)


@pytest.mark.parametrize("kind", list(SPECS))
def test_plain_outputs_follow_the_grammar(plain_engine, tokenizer, compiled, kind):
    prompts = random_prompts(6, vocab=len(tokenizer), seed=3)
    reqs = plain_engine.generate(prompts, params(compiled[kind], 40))
    ended = [r for r in reqs if r.finish_reason == "stop"]
    assert ended, [(r.finish_reason, tokenizer.decode(r.output_ids)) for r in reqs]
    for r in ended:
        text = tokenizer.decode(r.output_ids[:-1])  # without the stop token
        assert valid(kind, text), text
    free = plain_engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert not any(valid("regex", tokenizer.decode(r.output_ids)) for r in free)  # a random model


@pytest.mark.parametrize("draft", ["random", "oracle"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
def test_speculative_equals_plain_under_a_grammar(grammar_model, tokenizer, plain_engine, compiled,
                                                  kind, shape, draft, monkeypatch):
    prompts = random_prompts(4, vocab=len(tokenizer), seed=7)
    p = params(compiled[kind])
    plain = [r.output_ids for r in plain_engine.generate(prompts, p)]
    eng = LLMEngine(tiny_config(grammar_model, *shape), tokenizer=tokenizer)
    speculate_and_compare(eng, prompts, p, plain, draft, monkeypatch)


@pytest.mark.parametrize("kind", ["json_schema", "choice"])
def test_eager_draft_shapes_in_turn_under_a_grammar(grammar_model, tokenizer, plain_engine, compiled,
                                                    kind, monkeypatch):
    """Without graphs (the CPU) a grammar row's step may take a smaller draft shape,
    eagerly: its tree is masked as the configured one's (the oracle draws long accepts
    there, the smaller shapes' random head short ones)."""
    from test_adaptive_draft import Cycle
    prompts = random_prompts(4, vocab=len(tokenizer), seed=7)
    p = params(compiled[kind])
    plain = [r.output_ids for r in plain_engine.generate(prompts, p)]
    eng = LLMEngine(tiny_config(grammar_model, *TREE, "draft.adaptive_shapes=[[2,3],[1,1]]",
                                "draft.eager_shapes=true"),
                    tokenizer=tokenizer)
    eng.schedulers[0].draft_policy = Cycle(3)
    speculate_and_compare(eng, prompts, p, plain, "oracle", monkeypatch)
    assert set(eng.shape_steps) == {0, 1, 2}


def test_no_plain_step_while_a_grammar_row_runs(grammar_model, tokenizer, plain_engine, compiled,
                                                monkeypatch):
    """draft.plain_steps: a step the policy would take plain runs at the configured shape
    while a row has a grammar (the rank masks its rows per speculative tree)."""
    from test_adaptive_draft import Cycle
    prompts = random_prompts(3, vocab=len(tokenizer), seed=8)
    p = params(compiled["json_schema"])
    plain = [r.output_ids for r in plain_engine.generate(prompts, p)]
    eng = LLMEngine(tiny_config(grammar_model, *TREE, "draft.eager_shapes=true", "draft.plain_steps=true"),
                    tokenizer=tokenizer)
    eng.schedulers[0].draft_policy = Cycle(2, plain=True)  # the configured shape, then plain
    speculate_and_compare(eng, prompts, p, plain, "oracle", monkeypatch)
    assert set(eng.shape_steps) == {0}


def test_tree_walks_split_over_threads_equal_plain(grammar_model, tokenizer, plain_engine, compiled,
                                                   monkeypatch):
    """processing.grammar_threads > 1: the tree masks of a step's rows are walked on several
    threads; a row a thread skipped would stay unmasked and leave the grammar."""
    prompts = random_prompts(5, vocab=len(tokenizer), seed=11)
    p = params(compiled["json_schema"])
    plain = [r.output_ids for r in plain_engine.generate(prompts, p)]
    eng = LLMEngine(tiny_config(grammar_model, *TREE, "processing.grammar_threads=3"), tokenizer=tokenizer)
    assert eng.workers[0].grammars.threads == 3
    speculate_and_compare(eng, prompts, p, plain, "oracle", monkeypatch)
    assert eng.workers[0].grammars._pool is not None  # the threads walked


def test_a_preempted_request_keeps_its_grammar_state(grammar_model, tokenizer, compiled):
    """Out of KV, requests are preempted and re-prefilled with their outputs as prompt: the
    rank's matcher restarts from those outputs, so the constrained answer is unchanged."""
    prompts = random_prompts(8, vocab=len(tokenizer), seed=5)
    p = params(compiled["json_schema"], 40)
    over = ["model.max_model_len=128", *TREE]
    roomy = LLMEngine(tiny_config(grammar_model, *over), tokenizer=tokenizer)
    want = [r.output_ids for r in roomy.generate(prompts, p)]
    tight = LLMEngine(tiny_config(grammar_model, *over), tokenizer=tokenizer,
                      workers=roomy.workers, worker_info={"num_slots": 360})
    got = [r.output_ids for r in tight.generate(prompts, p)]
    assert tight.schedulers[0].stats["preemptions"] > 0
    assert got == want


@pytest.mark.parametrize("kind", ["choice", "regex", "json_schema"])
def test_sampled_tree_outputs_follow_the_grammar(grammar_model, tokenizer, compiled, kind):
    """Temperature 1 under the tree: verify's rejection sampling sees the masked target
    distribution, so no node the grammar forbids is ever accepted."""
    prompts = random_prompts(8, vocab=len(tokenizer), seed=11)
    eng = LLMEngine(tiny_config(grammar_model, *TREE), tokenizer=tokenizer)
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, grammar=compiled[kind])
              for s in range(len(prompts))]
    reqs = eng.generate(prompts, params)
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    for r in reqs:  # finished or cut, every token is one the grammar allows there
        m = xgr.GrammarMatcher(xgr.CompiledGrammar.deserialize_json(compiled[kind], info))
        assert all(m.accept_token(t) for t in r.output_ids), tokenizer.decode(r.output_ids)
        if r.finish_reason == "stop":
            assert m.is_terminated() and valid(kind, tokenizer.decode(r.output_ids[:-1]))
    assert kind == "json_schema" or any(r.finish_reason == "stop" for r in reqs)


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_step_graph_parts_under_a_grammar_equal_plain(grammar_model, tokenizer, plain_engine, compiled,
                                                      kind, monkeypatch):
    """Greedy grammar batches under the tree replay the step graph in its three parts (CPU:
    their eager stand-ins), the masks walked on the host between the draft and the accept
    part and read from its static buffer; a penalized grammar row makes it the processed
    accept part (the plain one once it has ended), and the rows without a grammar (all-ones
    masks) are unconstrained. An oracle draft for long accepts: speculative output equals
    eager plain output."""
    from test_penalties_lossless import GRAPH_SIZES
    prompts = random_prompts(4, vocab=len(tokenizer), seed=7)
    g = compiled[kind]
    penalized = SamplingParams(max_tokens=24, grammar=g, presence_penalty=0.5,
                               logit_bias={tokenizer.encode("1")[0]: 3.0})
    plist = [params(g), SamplingParams(max_tokens=24), penalized, SamplingParams(max_tokens=24)]
    plain = [r.output_ids for r in plain_engine.generate(prompts, plist)]
    eng = LLMEngine(tiny_config(grammar_model, *TREE), tokenizer=tokenizer)
    eagle = eng.workers[0].eagle
    eagle.capture_graphs(GRAPH_SIZES)
    seen, accept = [], eagle.step_graph.run_accept

    def spy(raw_bs, variant):
        seen.append(variant)
        return accept(raw_bs, variant)

    eagle.step_graph.run_accept = spy
    monkeypatch.setattr(eagle, "_accept", None)  # the per-phase path must not run
    speculate_and_compare(eng, prompts, plist, plain, "oracle", monkeypatch)
    assert Variant(processed=True) in seen and set(seen) <= {Variant(processed=True), Variant()}
