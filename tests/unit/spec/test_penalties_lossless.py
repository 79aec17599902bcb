"""Logit processing under speculation (kernels/penalties.py): presence, frequency and
repetition penalties, logit bias and min_tokens keep greedy speculative output equal to
greedy plain output with the same processing, token for token.

Each tree node is processed with the counts along its own path. A random head rarely gets
past the root, where the path is empty, so the engine tests also run an oracle draft that
proposes the known answer among decoys: long accepts, where a node's path holds ids the
emitted counts do not. The per-node reference below pins the tree processing down alone.
"""
from __future__ import annotations

import pytest
import torch
from spec_helpers import CHAIN, TREE, random_prompts, tiny_engine
from test_c22_greedy_lossless import OracleDraft

from kernels.penalties import Processing, _penalize, apply_processing
from kernels.spec_tree import build_tree
from serve_app.request import SamplingParams

PENALIZED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                 logit_bias={5: 2.5, 7: -1.5, 11: 4.0})
MAX = 24


def processing(B: int, V: int, min_tokens: int = 0, stops=(2,)) -> Processing:
    f = lambda v: torch.full((B,), v, dtype=torch.float32)
    bias = [(b, t, v) for b in range(B) for t, v in PENALIZED["logit_bias"].items()]
    stop = [(b, t) for b in range(B) for t in stops]
    return Processing(f(0.7), f(0.4), f(1.3), torch.full((B,), min_tokens, dtype=torch.int64),
                      torch.tensor([b for b, _, _ in bias]), torch.tensor([t for _, t, _ in bias]),
                      torch.tensor([v for _, _, v in bias]), torch.tensor([b for b, _ in stop]),
                      torch.tensor([t for _, t in stop]))


def test_tree_nodes_are_processed_with_their_paths_counts():
    torch.manual_seed(0)
    B, N, V = 3, 8, 16
    parents = torch.tensor([[0, 0, 1, 1, 2, 4, 5], [0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 3]])
    draft = torch.randint(0, 6, (B, N - 1))  # few ids: paths repeat them
    tree = build_tree(torch.tensor([3, 4, 5]), draft, parents, torch.tensor([10, 20, 30]))
    path = tree.tree_mask.clone()
    path[:, :, 0] = False
    logits = torch.randn(B, N, V) * 3
    counts = torch.randint(0, 3, (B, V), dtype=torch.int32)
    num_out = torch.tensor([1, 4, 6])
    prompt = torch.rand(B, V) < 0.3
    p = processing(B, V, min_tokens=6)
    got = apply_processing(logits, p, counts, num_out, prompt, tree.tokens, path)
    for b in range(B):
        for i in range(N):
            x = logits[b, i].clone()
            for t, v in PENALIZED["logit_bias"].items():
                x[t] += v
            depth = int(path[b, i].sum())
            if num_out[b] + depth < 6:
                x[2] = float("-inf")
            c = counts[b].float().clone()
            for j in range(N):
                if path[b, i, j]:
                    c[tree.tokens[b, j]] += 1
            want = _penalize(x, c, prompt[b], torch.tensor(1.3), torch.tensor(0.4), torch.tensor(0.7))
            torch.testing.assert_close(got[b, i], want, msg=f"request {b} node {i}")


def greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=MAX, ignore_eos=True, **extra)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("draft", ["random", "oracle"])
def test_greedy_penalties_speculative_equals_plain(tiny_llama_dir, shape, draft, monkeypatch):
    prompts = random_prompts(4, seed=7)
    params = greedy(**PENALIZED)
    plain = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, params)]
    unpenalized = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, greedy())]
    assert plain != unpenalized  # the processing changes the answer
    eng = tiny_engine(tiny_llama_dir, *shape)
    reqs = [eng.add_request(p, params) for p in prompts]
    eng.step()  # the prefill: rows are assigned now
    if draft == "oracle":
        eagle = eng.workers[0].eagle
        refs = {r.row: r.prompt_ids + ref for r, ref in zip(reqs, plain)}
        monkeypatch.setattr(eagle, "_draft", OracleDraft(eagle, refs, 128))
    while eng.has_work:
        eng.step()
    assert [r.output_ids for r in reqs] == plain
    if draft == "oracle":
        assert max(a for r in reqs for a in r.accept_lengths) >= 3


@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_min_tokens_holds_back_a_forced_stop(tiny_llama_dir, shape):
    """The bias makes EOS (id 2) every position's choice; min_tokens bans it for the first
    five outputs, at tree depth too, so each request ends with EOS as its sixth token."""
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(max_tokens=MAX, logit_bias={2: 50.0}, min_tokens=5)
    eng = tiny_engine(tiny_llama_dir, *(shape or ()), spec=shape is not None)
    for r in eng.generate(prompts, params):
        assert len(r.output_ids) == 6 and r.output_ids[-1] == 2 and 2 not in r.output_ids[:5]
