"""Prefill graphs (actors/prefill_graph.py) wired into the real engine on CPU.

On CPU the graphs are their bodies run eagerly on the static buffers, so these tests drive
the padded path a CUDA replay takes: a prompt chunk padded to the next captured size, its
padding written to slot 0 and hidden by causal attention, the first token sampled from the
last real row, the draft extended over the chunk. Outputs equal the eager prefill's token
for token, plain and speculative, greedy and sampled, for chunks that need padding, one
that fills its size exactly, chunks of a longer prompt (not the last chunk: no token) and
a prompt that starts from a cached prefix.
"""
from __future__ import annotations

import pytest
from spec_helpers import CHAIN, TREE, random_prompts, tiny_engine

from actors.prefill_graph import PrefillGraphs
from serve_app.request import SamplingParams

SIZES = [8, 16]
CHUNK = "scheduler.chunked_prefill_size=16"


def spy(graphs: PrefillGraphs) -> list[tuple[int, int, int]]:
    """Log (chunk tokens, prefix, padded size) of every replayed chunk."""
    seen = []

    def run(plan, T):
        seen.append((plan.extend_lens[0], plan.prefix_lens[0], T))
        return PrefillGraphs.run(graphs, plan, T)

    graphs.run = run
    return seen


def one_by_one(engine, prompts, params) -> list[list[int]]:
    """Each prompt alone, so every prefill chunk is a batch of one (the graph's case)."""
    return [engine.generate([p], params)[0].output_ids for p in prompts]


SHAPES = {"plain": None, "chain": CHAIN, "tree": TREE}


def make_engine(model_dir, shape, *extra):
    spec = SHAPES[shape] is not None
    return tiny_engine(model_dir, CHUNK, *(SHAPES[shape] or ()), *extra, spec=spec)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_prefill_graphs_equal_eager(tiny_llama_dir, shape, sampled):
    # 5 and 12 tokens pad (to 8 and 16), 16 fills its size, 37 runs as chunks 16+16+5.
    prompts = [p[:n] for p, n in zip(random_prompts(4, seed=3) * 2, (5, 12, 16, 37))]
    prompts = [p + p[:1] * (n - len(p)) for p, n in zip(prompts, (5, 12, 16, 37))]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0 if sampled else 0.0,
                            seed=11)
    want = one_by_one(make_engine(tiny_llama_dir, shape), prompts, params)
    eng = make_engine(tiny_llama_dir, shape)
    worker = eng.workers[0]
    worker.capture_prefill_graphs(SIZES)
    assert not worker.prefill_graphs.use_cuda_graph  # CPU: the eager stand-in
    seen = spy(worker.prefill_graphs)
    assert one_by_one(eng, prompts, params) == want
    assert {(n, T) for n, _, T in seen} == {(5, 8), (12, 16), (16, 16)}
    assert any(prefix > 0 for _, prefix, _ in seen)  # the later chunks of the long prompt


@pytest.mark.parametrize("shape", ["plain", "tree"])
def test_cached_prefix_and_eager_fallback(tiny_llama_dir, shape):
    base = random_prompts(1, seed=9)[0]
    base = (base * 3)[:24]
    prompts = [base, base[:20] + [5, 6, 7]]  # the second reuses a page-aligned cached prefix
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = one_by_one(make_engine(tiny_llama_dir, shape, "kv_cache.page_size=4"), prompts, params)
    eng = make_engine(tiny_llama_dir, shape, "kv_cache.page_size=4")
    worker = eng.workers[0]
    worker.capture_prefill_graphs([4])  # 16-token chunks do not fit: eager
    seen = spy(worker.prefill_graphs)
    assert one_by_one(eng, prompts, params) == want
    assert seen and all(n <= 4 and prefix > 0 for n, prefix, _ in seen)


def test_batches_of_several_requests_stay_eager(tiny_llama_dir):
    prompts = random_prompts(3, seed=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    whole = "scheduler.chunked_prefill_size=512"  # all three prompts in one prefill step
    want = [r.output_ids for r in make_engine(tiny_llama_dir, "tree", whole).generate(prompts, params)]
    eng = make_engine(tiny_llama_dir, "tree", whole)
    eng.workers[0].capture_prefill_graphs(SIZES)
    seen = spy(eng.workers[0].prefill_graphs)
    assert [r.output_ids for r in eng.generate(prompts, params)] == want
    assert seen == []
