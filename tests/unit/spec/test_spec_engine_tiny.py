"""Speculative engine on a tiny random target: many shapes fast, EAGLE-1 and EAGLE-3 heads."""
import pytest
import torch

from serve_app.engine.request import SamplingParams
from spec_helpers import CHAIN, TREE, outputs, random_prompts, tiny_engine

SHAPES = [CHAIN, TREE, ("draft.topk=2", "draft.num_steps=1", "draft.num_draft_tokens=3"),
          ("draft.topk=3", "draft.num_steps=4", "draft.num_draft_tokens=12")]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    eng = tiny_engine(tiny_llama_dir, spec=False)
    return outputs(eng, random_prompts(6, seed=11), 30)


@pytest.mark.parametrize("arch", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", SHAPES, ids=["chain", "tree", "k2s1", "k3s4n12"])
def test_spec_equals_plain(tiny_llama_dir, plain, arch, shape):
    eng = tiny_engine(tiny_llama_dir, *shape, f"draft.arch={arch}", "kv_cache.page_size=4")
    got = outputs(eng, random_prompts(6, seed=11), 30)
    assert got == plain
    sched = eng.schedulers[0]
    sched.cache.evict(sched.slots.capacity)
    assert sched.slots.free_slots == sched.slots.capacity


def test_mixed_greedy_and_sampled_batch(tiny_llama_dir, plain):
    eng = tiny_engine(tiny_llama_dir, *TREE)
    prompts = random_prompts(6, seed=11)
    params = [SamplingParams(max_tokens=30, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=30, temperature=0.9, seed=i, ignore_eos=True)
              for i in range(6)]
    reqs = eng.generate(prompts, params)
    for i, r in enumerate(reqs):
        assert len(r.output_ids) == 30
        if i % 2 == 0:
            assert r.output_ids == plain[i]  # greedy rows are unaffected by sampled neighbours
    again = tiny_engine(tiny_llama_dir, *TREE).generate(prompts, params)
    assert [r.output_ids for r in again] == [r.output_ids for r in reqs]  # seeded: reproducible


def test_stop_inside_accepted_tokens(tiny_llama_dir, plain):
    """A stop token in the middle of an accepted run ends the output right there."""
    eng = tiny_engine(tiny_llama_dir, *CHAIN)
    prompts = random_prompts(6, seed=11)
    stop = plain[0][7]
    r = eng.generate([prompts[0]], SamplingParams(max_tokens=30, stop_token_ids=[stop]))[0]
    assert r.output_ids == plain[0][:plain[0].index(stop) + 1] and r.finish_reason == "stop"
    r = eng.generate([prompts[0]], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    assert r.output_ids == plain[0][:9] and r.finish_reason == "length"


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_draft_max_token_id_is_lossless_and_drafts_below_it(tiny_llama_dir, plain, shape):
    """draft.max_token_id: an EAGLE-1 head proposes only ids below it (a slice of the LM
    head), and the output stays the plain output."""
    eng = tiny_engine(tiny_llama_dir, *shape, "draft.arch=eagle", "draft.max_token_id=40")
    head = eng.workers[0].eagle.head
    p, idx = head.topk(torch.randn(5, head.spec.hidden_size), 3)
    assert idx.max() < 40 and (p.sum(-1) <= 1 + 1e-6).all()
    assert outputs(eng, random_prompts(6, seed=11), 30) == plain


def test_draft_max_token_id_with_an_eagle3_head_is_refused(tiny_llama_dir):
    """An EAGLE-3 head drafts among its own vocabulary: the EAGLE-1 cut would not take
    effect, so the engine refuses it at load, naming the setting."""
    with pytest.raises(ValueError, match="draft.max_token_id=40 .* EAGLE-3 head drafts among its own"):
        tiny_engine(tiny_llama_dir, *CHAIN, "draft.arch=eagle3", "draft.max_token_id=40")
