"""Graphs for every batch the scheduler can form, and the steps that still leave them:
counted by reason (the engine's counter, /metrics), never silently, outputs unchanged."""
from __future__ import annotations

import logging

import pytest
from spec_helpers import TREE, outputs, random_prompts, tiny_config, tiny_engine

from actors.worker.eager_steps import REASONS, EagerSteps
from configs.schema import graph_sizes_up_to
from serve_app.api.metrics import ServerMetrics

MAX_TOKENS = 8


@pytest.mark.parametrize("max_bs", [1, 7, 8, 9, 64, 65, 100, 256, 512, 700])
def test_graph_sizes_cover_every_batch_with_bounded_padding(max_bs):
    sizes = graph_sizes_up_to(max_bs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_bs
    for b in range(1, max_bs + 1):
        padded = next(s for s in sizes if s >= b)
        step = 2 * b if b <= 8 else 8 if b <= 64 else 16 if b <= 128 else 32 if b <= 512 else 64
        assert padded - b < step, (b, padded)  # padding bounded by the spacing


def test_default_capture_sizes_follow_the_running_limit(tiny_llama_dir):
    cfg = tiny_config(tiny_llama_dir, "scheduler.max_running_requests=300")
    assert cfg.attention.cuda_graph_batch_sizes is None
    assert cfg.graph_batch_sizes() == graph_sizes_up_to(300)
    cfg = tiny_config(tiny_llama_dir, "attention.cuda_graph_batch_sizes=[4,1,2]")
    assert cfg.graph_batch_sizes() == [1, 2, 4]


@pytest.mark.parametrize("spec", [True, False], ids=["tree", "plain"])
@pytest.mark.parametrize("sizes,eager", [([1, 2], True), ([1, 2, 4, 8], False)],
                         ids=["too_small", "covering"])
def test_batches_past_the_largest_graph_are_counted(tiny_llama_dir, spec, sizes, eager):
    prompts = random_prompts(5, seed=5)
    shape = TREE if spec else ()
    want = outputs(tiny_engine(tiny_llama_dir, *shape, spec=spec), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *shape, spec=spec)
    w = eng.workers[0]
    w.capture_decode_graphs(sizes)
    if spec:
        w.eagle.capture_graphs(sizes)
    assert outputs(eng, prompts, MAX_TOKENS) == want
    if eager:
        assert eng.eager_steps["batch_size"] > 0 and set(eng.eager_steps) == {"batch_size"}
    else:
        assert not eng.eager_steps


def test_a_variant_without_a_graph_is_counted(tiny_llama_dir):
    """Sampled iterations with feature_graphs off leave the step graph (reason 'variant');
    greedy ones in the same engine do not."""
    from serve_app.engine.request import SamplingParams
    eng = tiny_engine(tiny_llama_dir, *TREE, "attention.feature_graphs=false")
    eng.workers[0].eagle.capture_graphs([1, 2, 4])
    prompts = random_prompts(3, seed=2)
    outputs(eng, prompts, MAX_TOKENS)
    assert not eng.eager_steps
    eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, seed=1))
    assert set(eng.eager_steps) == {"variant"}


def test_each_reason_is_logged_once_and_unknown_reasons_refused(caplog):
    steps = EagerSteps(rank=3)
    with caplog.at_level(logging.WARNING, logger="kestrel.worker"):
        for _ in range(3):
            steps.note("batch_size", "600 requests")
            steps.note("grammar")  # a second reason in the same step: the first names it
            assert steps.take() == "batch_size"
        assert steps.take() == ""
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "rank 3" in logged[0] and "batch_size" in logged[0]
    with pytest.raises(ValueError, match="unknown eager-step reason"):
        steps.note("slow")


def test_metrics_export_eager_steps_by_reason():
    m = ServerMetrics("m")
    m.update_engine({"replica": "r1", "running": 0, "waiting": 0, "kv": [],
                     "eager_steps": {"batch_size": 3, "grammar": 1}})
    text = m.render()[0].decode()
    assert 'kestrel_engine_eager_steps_total{model="m",reason="batch_size",replica="r1"} 3.0' in text
    assert 'reason="grammar"' in text
    assert set(REASONS) >= {"batch_size", "grammar"}
