"""The prefill warm-up (run at start-up on a GPU, where it compiles prefill's kernels)
must leave a worker exactly as usable as before: run here on the CPU worker, then greedy
output is unchanged."""
from __future__ import annotations

import pytest

from actors.graphs.warmup import (CHUNK_LENS, prefill_shapes, warm_up_prefill, warm_up_processing,
                            warm_up_sampled_decode)
from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams


def test_shapes_cover_every_chunk_length_alone_and_batched_within_the_pools():
    shapes = prefill_shapes(num_rows=66, chunk_budget=4096, num_slots=200_000, page=16)
    assert {n for _, n in shapes} == set(CHUNK_LENS)
    assert (1, 64) in shapes and (64, 64) in shapes and (64, 1) in shapes
    small = prefill_shapes(num_rows=6, chunk_budget=100, num_slots=200, page=16)
    assert all(b <= 4 and b * n <= 100 and 16 + b * -(-n // 16) * 16 <= 200 for b, n in small), small


# The speculative worker's case below runs the same prefill warm-up on its target, and more:
# long, for make test's budget.
@pytest.mark.long
def test_warm_up_leaves_the_worker_serving_the_same_tokens(fp32_worker, tokenizer, chat_prompts):
    cfg = load_config(overrides=["model.dtype=float32", "kv_cache.num_slots=8192", "device=cpu",
                                 "scheduler.max_running_requests=16", "draft.enabled=false"])
    params = SamplingParams(max_tokens=12)

    def run():
        eng = LLMEngine(cfg, tokenizer=tokenizer, workers=[fp32_worker])
        return [r.output_ids for r in eng.generate(chat_prompts[:3], params)]

    before = run()
    warm_up_prefill(fp32_worker)
    assert run() == before


def test_warm_up_leaves_a_speculative_worker_serving_the_same_tokens(tokenizer, chat_prompts):
    from actors.worker.rank_worker import RankWorker
    cfg = load_config(overrides=["model.dtype=float32", "kv_cache.num_slots=8192", "device=cpu",
                                 "scheduler.max_running_requests=4", "scheduler.chunked_prefill_size=64"])
    assert cfg.draft.enabled  # the default preset's chain, with the shipped head
    worker = RankWorker(cfg)
    params = SamplingParams(max_tokens=12)

    def run():
        eng = LLMEngine(cfg, tokenizer=tokenizer, workers=[worker])
        reqs = eng.generate(chat_prompts[:2], params)
        return [r.output_ids for r in reqs], [r.accept_lengths for r in reqs]

    before = run()
    warm_up_prefill(worker)
    warm_up_sampled_decode(worker)
    warm_up_processing(worker)  # the plain row's and the tree's shapes, on row 0
    assert run() == before


def test_mixed_warm_up_leaves_a_speculative_worker_serving_the_same_tokens(tokenizer, chat_prompts):
    """warm_up_mixed runs every prefill shape as a mixed step beside a decoding row 1 (its
    tree, under speculation) and leaves the worker's output unchanged."""
    from actors.graphs.warmup import warm_up_mixed
    from actors.worker.rank_worker import RankWorker
    cfg = load_config(overrides=["model.dtype=float32", "kv_cache.num_slots=4096", "device=cpu",
                                 "scheduler.max_running_requests=4", "scheduler.chunked_prefill_size=64",
                                 "draft.path=random", "draft.topk=2", "draft.num_steps=3",
                                 "draft.num_draft_tokens=4", "scheduler.mixed_steps=true"])
    worker = RankWorker(cfg)
    params = SamplingParams(max_tokens=12)

    def run():
        eng = LLMEngine(cfg, tokenizer=tokenizer, workers=[worker])
        return [r.output_ids for r in eng.generate(chat_prompts[:2], params)]

    before = run()
    steps = []
    execute = worker.execute
    worker.execute = lambda plan: steps.append(plan.mode) or execute(plan)
    warm_up_mixed(worker)
    del worker.execute
    assert steps.count("mixed") == len(set(prefill_shapes(worker.num_rows - 1, 64, 4096, 16)))
    assert run() == before
