"""Sampled requests on the graph paths (attention.feature_graphs; CPU: the graphs' eager
stand-ins, the same bodies on the same padded lanes): the sampled decode graphs for plain
decoding and the step graph's sampled variants under speculation read each row's sampling
parameters from the processing table and its coins from a static buffer, and emit what the
eager sampling gave with the same seeds, token for token, in batches of greedy and
sampled rows, penalized or not, with logprobs, at batch sizes that need padded lanes, and
with grammars (the step graph's parts). The launch of such a step reads nothing on the
host.
"""
from __future__ import annotations

import pytest
import torch
from spec_helpers import CHAIN, TREE, fixed_draft, random_prompts, tiny_engine
from test_grammar_lossless import REGEX, compiled  # noqa: F401 (fixture)
from test_penalties_lossless import GRAPH_SIZES, PENALIZED, spy_variants

from actors.spec.step_graph import Variant
from serve_app.engine.request import SamplingParams

SHAPES = {"plain": None, "chain": CHAIN, "tree": TREE}
TOL = 5e-5  # logprobs: a padded graph batch and the eager batch round differently (fp32)


def batch(filtered: bool, logprobs: int | None = 3) -> list[SamplingParams]:
    """Five requests of different lengths (the batch shrinks: 5 -> 8 lanes, 3 -> 4): greedy,
    penalized greedy and sampled ones; two share a prompt's params but not their seed (the
    coins decide). `filtered`: the sampled rows truncate (top-p, top-k, min-p), else
    temperature only."""
    cut = [dict(top_p=0.9), dict(top_k=20), dict(min_p=0.05)] if filtered else [{}, {}, {}]
    p = lambda n, **kw: SamplingParams(max_tokens=n, ignore_eos=True, logprobs=logprobs, **kw)
    return [p(14, temperature=1.0, seed=1, **cut[0]),
            p(10, **PENALIZED),
            p(16, temperature=1.0, seed=2, **cut[0]),
            p(12, temperature=0.8, seed=3, **PENALIZED, **cut[1]),
            p(11, temperature=1.2, seed=4, **cut[2])]


def prompts_for(params: list) -> list[list[int]]:
    prompts = random_prompts(len(params), seed=21)
    prompts[2] = prompts[0]  # rows 0 and 2 differ only in their seed
    return prompts


class TargetDraft:
    """Drafts what the target finds likeliest after each row's tokens (the tiny model run by
    transformers): under sampling, accepts past the root, and rejected first children whose
    siblings are tried. Chain: the greedy continuation; tree: the two likeliest children of
    the root, two below each, one below the first grandchild."""

    def __init__(self, eagle, model, reqs):
        self.eagle, self.model = eagle, model
        self.reqs = {r.row: r for r in reqs}

    def top(self, ids: list[int], k: int) -> list[int]:
        key = (tuple(ids), k)  # the compared runs draft after the same tokens: once each
        if key not in self.model.tops:
            with torch.no_grad():
                self.model.tops[key] = self.model(torch.tensor([ids])).logits[0, -1].topk(k).indices.tolist()
        return self.model.tops[key]

    def __call__(self, batch):
        N, K = self.eagle.N, self.eagle.K
        drafts, parents = [], []
        for row in batch.req_pool_indices.tolist():
            r = self.reqs.get(row)  # None: a padded lane (row 0)
            ids = r.prompt_ids + r.output_ids if r is not None else [0]  # through the bonus token
            if K == 1:
                d = []
                for _ in range(N - 1):
                    d += self.top(ids + d, 1)
                p = list(range(N - 1))
            else:
                a, b = self.top(ids, 2)
                (c, e), (f, g) = self.top(ids + [a], 2), self.top(ids + [b], 2)
                d = [a, b, c, e, f, g, *self.top(ids + [a, c], 1)][:N - 1]
                p = [0, 0, 1, 1, 2, 2, 3][:N - 1]
            drafts.append(d)
            parents.append(p)
        return fixed_draft(drafts, parents)


def spy_decode_replays(worker) -> list:
    """Log which decode graph set each plain decode step replays: "plain", "processed" or a
    sampled set's (processed, filtered)."""
    seen = []
    sets = {"plain": worker.decode_graphs, "processed": worker.processed_decode_graphs,
            **worker.sampled_decode_graphs}
    for name, runner in sets.items():
        if runner is None:
            continue
        def replay(b, _name=name, _replay=runner.replay, **kw):
            seen.append(_name)
            return _replay(b, **kw)
        runner.replay = replay
    return seen


def run(tiny_llama_dir, shape, params, feature_graphs: bool, model, monkeypatch):
    """Generate on an engine whose graphs are captured (stand-ins), the feature graphs on
    or off (off: sampled steps replay the plain decode graph and sample eagerly, or take
    the per-phase runners and the eager accept) -> (requests, what replayed)."""
    flag = f"attention.feature_graphs={str(feature_graphs).lower()}"
    eng = tiny_engine(tiny_llama_dir, *(SHAPES[shape] or ()), flag, spec=shape != "plain")
    w = eng.workers[0]
    if shape == "plain":
        w.capture_decode_graphs(GRAPH_SIZES)
        seen = spy_decode_replays(w)
    else:
        w.eagle.capture_graphs(GRAPH_SIZES)
        seen = spy_variants(w.eagle)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts_for(params), params)]
    eng.step()  # the prefill: rows are assigned now
    if shape != "plain":
        draft = TargetDraft(w.eagle, model, reqs)
        monkeypatch.setattr(w.eagle, "_draft", draft)
        monkeypatch.setattr(w.eagle, "draft_body", draft)  # what the step graph's body calls
    while eng.has_work:
        eng.step()
    return reqs, seen


@pytest.fixture(scope="module")
def target_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir).float().eval()
    model.tops = {}  # TargetDraft's answers by (tokens, k)
    return model


@pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "temperature_only"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sampled_graphs_equal_eager_sampling(tiny_llama_dir, target_model, shape, filtered, monkeypatch):
    params = batch(filtered)
    want, old = run(tiny_llama_dir, shape, params, False, target_model, monkeypatch)
    got, seen = run(tiny_llama_dir, shape, params, True, target_model, monkeypatch)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert got[0].output_ids != got[2].output_ids  # the same request but for its seed: coins count
    for a, b in zip(got, want):
        assert [ids for _, ids, _ in a.token_logprobs] == [ids for _, ids, _ in b.token_logprobs]
        worst = max(abs(x[0] - y[0]) for x, y in zip(a.token_logprobs, b.token_logprobs))
        assert worst < TOL, worst
    if shape == "plain":
        assert "processed" not in old and (True, filtered) not in old  # before: the plain graph
        assert (True, filtered) in seen and "plain" not in seen  # every step picked in a graph
    else:
        assert not any(v.sampled for v in old)  # before: the per-phase path
        assert Variant(True, True, True, filtered) in seen
        assert max(a for r in got for a in r.accept_lengths) >= 3
        assert max(a for i in (0, 2, 3, 4) for a in got[i].accept_lengths) >= 2  # sampled rows accepted drafts


@pytest.mark.parametrize("path", ["plain_graphs", "plain_eager", "tree_graphs"])
def test_a_sampled_step_launches_without_reading_the_device(tiny_llama_dir, path, monkeypatch):
    """The launch of a sampled decode step (processing and logprobs in it too) reads no
    device value on the host (benchmarks/step_ops.py; on a GPU each read waits for the
    stream, so the step channel could not queue the next step behind it). Graph replays
    count as none (a captured graph cannot read); the eager path's model forward is left
    out too: torch_native attention plans on the host (the GPU backends do not)."""
    from benchmarks.step_ops import find_host_reads
    shape = "plain" if path.startswith("plain") else "tree"
    eng = tiny_engine(tiny_llama_dir, *(SHAPES[shape] or ()), spec=shape != "plain")
    w = eng.workers[0]
    if path == "plain_graphs":
        w.capture_decode_graphs(GRAPH_SIZES)
    elif path == "tree_graphs":
        w.eagle.capture_graphs(GRAPH_SIZES)
    params = batch(True)
    with find_host_reads([w]) as reads:
        if path == "plain_eager":
            forward = w._decode_logits

            def unwatched(*args):
                with reads.paused():
                    return forward(*args)
            monkeypatch.setattr(w, "_decode_logits", unwatched)
        reqs = eng.generate(prompts_for(params), params)
    assert all(len(r.output_ids) == sp.max_tokens for r, sp in zip(reqs, params))
    assert reads.reads == []


def test_a_row_samples_only_while_a_sampled_request_holds_it(tiny_llama_dir):
    """The processing table's sampling entry of a row follows its request: written when a
    sampled request is admitted, cleared when a greedy one takes the row after it (else the
    graphs would sample the greedy request)."""
    eng = tiny_engine(tiny_llama_dir, spec=False)
    w = eng.workers[0]
    w.capture_decode_graphs(GRAPH_SIZES)
    prompt = random_prompts(1, seed=3)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    want = eng.generate(prompt, greedy)[0].output_ids
    sampled = eng.add_request(prompt[0], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.5,
                                                        top_k=5, seed=7))
    eng.step()
    row = sampled.row
    assert w.processing.temperature[row].item() == 1.5 and w.processing.top_k[row].item() == 5
    while eng.has_work:
        eng.step()
    again = eng.add_request(prompt[0], greedy)
    eng.step()
    assert again.row == row and w.processing.temperature[row].item() == 0.0
    while eng.has_work:
        eng.step()
    assert again.output_ids == want
    assert torch.count_nonzero(w.processing.temperature) == 0



def test_sampled_grammar_batches_replay_the_sampled_accept_part(grammar_model, tokenizer, compiled):
    """Grammar batches replay the step graph in three parts, the accept part in a sampled
    variant when a row samples (the masks applied before the sampling): the per-phase
    path's tokens, every sampled output one the grammar allows."""
    import re

    from spec_helpers import tiny_config

    from serve_app.engine.llm_engine import LLMEngine
    g = compiled["regex"]
    plist = [SamplingParams(max_tokens=16, temperature=1.0, seed=1, grammar=g),
             SamplingParams(max_tokens=16, grammar=g),
             SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=2),
             SamplingParams(max_tokens=16, temperature=1.2, seed=3, grammar=g)]
    prompts = random_prompts(len(plist), vocab=len(tokenizer), seed=5)
    outs = {}
    for on in (False, True):
        eng = LLMEngine(tiny_config(grammar_model, *TREE, f"attention.feature_graphs={str(on).lower()}"),
                        tokenizer=tokenizer)
        eagle = eng.workers[0].eagle
        eagle.capture_graphs(GRAPH_SIZES)
        seen, accept = [], eagle.step_graph.run_accept
        eagle.step_graph.run_accept = lambda raw, variant: seen.append(variant) or accept(raw, variant)
        outs[on] = [r.output_ids for r in eng.generate(prompts, plist)], seen
    (want, old), (got, seen) = outs[False], outs[True]
    assert got == want
    assert old == [] and Variant(sampled=True, filtered=True) in seen
    for ids in (got[0], got[3]):
        text = tokenizer.decode(ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids)
        assert re.fullmatch(REGEX, text) or len(ids) == 16, text
