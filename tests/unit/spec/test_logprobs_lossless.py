"""Logprobs under speculation (actors/sampling/logprobs.py): the logprob of every emitted token and
its alternatives, taken at the tree node that predicted it, equal plain decoding's, fp32,
greedy and with penalties, on chain and tree shapes (an oracle draft for long accepts)."""
from __future__ import annotations

import math

import pytest
from spec_helpers import CHAIN, TREE, random_prompts, tiny_engine
from test_c22_greedy_lossless import OracleDraft

from actors.spec.step_graph import Variant
from serve_app.engine.request import SamplingParams

MAX = 20
# fp32: a tree's verify batch and a plain decode step round differently; the tiny model's
# wide init gives logits in the tens, and their logprobs differed by up to ~1e-5.
TOL = 5e-5


def run(engine, prompts, params, oracle_refs=None, monkeypatch=None):
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.step()  # the prefill: rows assigned
    if oracle_refs is not None:
        eagle = engine.workers[0].eagle
        refs = {0: [], **{r.row: r.prompt_ids + ref for r, ref in zip(reqs, oracle_refs)}}  # 0: padded lanes
        oracle = OracleDraft(eagle, refs, 128)
        monkeypatch.setattr(eagle, "_draft", oracle)
        monkeypatch.setattr(eagle, "draft_body", oracle)  # what the step graph's body calls
    while engine.has_work:
        engine.step()
    return reqs


@pytest.mark.parametrize("shape,graphs", [(CHAIN, False), (TREE, False), (TREE, True)],
                         ids=["chain", "tree", "tree_graphs"])
@pytest.mark.parametrize("penalized", [False, True], ids=["greedy", "penalized"])
def test_logprobs_equal_plain(tiny_llama_dir, shape, graphs, penalized, monkeypatch):
    """With `graphs`, both engines replay their graphs' CPU stand-ins: plain decode's (the
    processed set when penalized) and the speculative step graph, which computes the
    logprobs of the accepted tokens inside (the (penalized, logprobs) variant)."""
    from test_penalties_lossless import GRAPH_SIZES, spy_variants
    prompts = random_prompts(3, seed=9)
    extra = dict(presence_penalty=0.5, repetition_penalty=1.2, logit_bias={5: 1.0}) if penalized else {}
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, logprobs=4, **extra)
    plain_engine, spec_engine = tiny_engine(tiny_llama_dir, spec=False), tiny_engine(tiny_llama_dir, *shape)
    if graphs:
        plain_engine.workers[0].capture_decode_graphs(GRAPH_SIZES)
        spec_engine.workers[0].eagle.capture_graphs(GRAPH_SIZES)
        seen = spy_variants(spec_engine.workers[0].eagle)
    plain = run(plain_engine, prompts, params)
    spec = run(spec_engine, prompts, params, [r.output_ids for r in plain], monkeypatch)
    assert max(a for r in spec for a in r.accept_lengths) >= 3
    if graphs:
        assert set(seen) == {Variant(penalized, True)}
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        assert len(s.token_logprobs) == len(p.token_logprobs) == MAX
        for tok, (lp, ids, lps), (lp2, ids2, lps2) in zip(p.output_ids, p.token_logprobs, s.token_logprobs):
            assert ids[0] == tok and len(ids) == 4  # greedy: the token is the likeliest
            assert math.isclose(lp, lps[0], abs_tol=1e-6) and lp <= 0
            assert ids2 == ids
            worst = max(abs(a - b) for a, b in zip([lp, *lps], [lp2, *lps2]))
            assert worst < TOL, worst
