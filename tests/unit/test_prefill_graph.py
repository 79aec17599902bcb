"""Prefill graphs (actors/graphs/prefill_graph.py) wired into the real engine on CPU.

On CPU the graphs are their bodies run eagerly on the static buffers, so these tests drive
the padded path a CUDA replay takes: each chunk padded to the next captured length and the
batch to the next captured size, padding written to slot 0 and hidden by causal attention,
padded lanes on row 0, first tokens sampled from each lane's last real row, the draft
extended over the chunks. Outputs equal the eager prefill's token for token, plain and
speculative, greedy and sampled, for chunks that need padding, one that fills its length
exactly, chunks of a longer prompt (not the last chunk: no token), a prompt that starts
from a cached prefix, and batches of several prompts of different lengths.
"""
from __future__ import annotations

import pytest
from spec_helpers import CHAIN, TREE, random_prompts, tiny_engine

from actors.graphs.prefill_graph import PrefillGraphs
from serve_app.engine.request import SamplingParams

BATCHES, TOKENS, BUDGET = [1, 2, 4], [8, 16], 64
CHUNK = "scheduler.chunked_prefill_size=16"


def spy(graphs: PrefillGraphs) -> list[tuple[int, int, int]]:
    """Log (chunk tokens, prefix, padded length) of every chunk of a single-request replay,
    and (requests, padded batch) of others."""
    seen = []

    def run(plan, shape):
        if len(plan.rows) == 1:
            seen.append((plan.extend_lens[0], plan.prefix_lens[0], shape[1]))
        else:
            seen.append((len(plan.rows), shape[0]))
        return PrefillGraphs.run(graphs, plan, shape)

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
    worker.capture_prefill_graphs(BATCHES, TOKENS, BUDGET)
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
    worker.capture_prefill_graphs([1], [4], 4)  # 16-token chunks do not fit: eager
    seen = spy(worker.prefill_graphs)
    assert one_by_one(eng, prompts, params) == want
    assert seen and all(n <= 4 and prefix > 0 for n, prefix, _ in seen)


@pytest.mark.parametrize("shape", ["plain", "tree"])
def test_batches_of_several_prompts_replay_padded(tiny_llama_dir, shape):
    prompts = random_prompts(3, seed=4)  # 5-40 tokens each, in one prefill step
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=t, seed=i)
              for i, t in enumerate((0.0, 1.0, 0.0))]
    whole = "scheduler.chunked_prefill_size=512"
    want = [r.output_ids for r in make_engine(tiny_llama_dir, shape, whole).generate(prompts, params)]
    eng = make_engine(tiny_llama_dir, shape, whole)
    eng.workers[0].capture_prefill_graphs([1, 4], [8, 16, 64], 256)
    seen = spy(eng.workers[0].prefill_graphs)
    assert [r.output_ids for r in eng.generate(prompts, params)] == want
    assert (3, 4) in seen  # three lanes padded to four


def test_steps_above_the_budget_run_eagerly(tiny_llama_dir):
    prompts = random_prompts(3, seed=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    whole = "scheduler.chunked_prefill_size=512"
    want = [r.output_ids for r in make_engine(tiny_llama_dir, "tree", whole).generate(prompts, params)]
    eng = make_engine(tiny_llama_dir, "tree", whole)
    eng.workers[0].capture_prefill_graphs([1, 4], [8, 16, 64], 64)  # 4 x 64 > 64
    seen = spy(eng.workers[0].prefill_graphs)
    assert [r.output_ids for r in eng.generate(prompts, params)] == want
    assert seen == []
