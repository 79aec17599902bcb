"""Adaptive draft shapes on the CPU with SmolLM2's real weights and its shipped head (the
default chain, so drafts are accepted and a switch drops real work): greedy output is the
plain output token for token whatever eager shape each step takes, whether the shapes
take turns or DraftPolicy switches them as the batch shrinks; /metrics counts the steps
per shape (and the plain steps) of a CPU rank served through the step channel."""
from __future__ import annotations

import pytest
import torch
from spec_helpers import CHAIN
from test_adaptive_draft import Cycle  # every shape in turn

from configs.schema import load_config
from kestrel_testing import assert_same_or_near_tie
from serve_app.engine.draft_policy import DraftPolicy
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams

# The plain reference's settings (conftest.plain_chat_outputs), with the default chain and
# every smaller chain shape; at most 4 running, so start-up times the shapes at 1, 2 and 4 only.
BASE = ["model.dtype=float32", "kv_cache.num_slots=8192", "scheduler.max_running_requests=4",
        "device=cpu", "draft.enabled=true", *CHAIN,
        "draft.adaptive_shapes=[[2,3],[1,2],[1,1]]", "draft.eager_shapes=true", "draft.plain_steps=true"]
MAX = 32


@pytest.fixture(scope="module")
def engine(tokenizer):
    eng = LLMEngine(load_config(overrides=BASE), tokenizer=tokenizer)
    assert [(s.S, s.N) for s in eng.workers[0].eagle.shapes] == [(3, 4), (2, 3), (1, 2), (1, 1)]
    assert eng.schedulers[0].draft_policy.eager  # measured eagerly at start-up
    return eng


# Batch 4 long, for make test's budget: test_plain_steps_between_shapes takes every shape in
# turn at batch 4 too (plain steps between), held to plain output, its drafts accepted.
@pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.long)])
def test_shapes_in_turn(engine, tokenizer, chat_prompts, plain_chat_outputs, hf_model, batch):
    policy = engine.schedulers[0].draft_policy = Cycle(4)
    engine.shape_steps.clear()
    reqs = engine.generate(chat_prompts[:batch], SamplingParams(max_tokens=MAX, ignore_eos=True))
    for prompt, r, ref in zip(chat_prompts, reqs, plain_chat_outputs):
        assert_same_or_near_tie(hf_model, prompt, r.output_ids, ref[:MAX])
    assert set(engine.shape_steps) == {0, 1, 2, 3}
    # The draft state each shape leaves is the next one's: the drafting shapes' steps
    # accept drafts (a random head, or a stale state, accepts ~1.0).
    drafted = [sum(lengths) / len(lengths) for s, lengths in policy.seen if s != 3]
    assert sum(drafted) / len(drafted) > 1.3
    shapes = engine.workers[0].eagle.shapes
    for s, lengths in policy.seen:  # each step ran the shape it was asked for
        assert max(lengths) <= shapes[s].N


def test_plain_steps_between_shapes(engine, tokenizer, chat_prompts, plain_chat_outputs, hf_model):
    """draft.plain_steps: every fifth step plain. The output does not change, and the
    drafts after plain steps are still accepted: a plain step writes the draft's KV for its
    token. Without it the draft attends over what an earlier request left in those slots,
    at its newest positions, and accepts about one token a step."""
    from actors.protocol.step_plan import PLAIN_STEP
    policy = engine.schedulers[0].draft_policy = Cycle(5, plain=True)
    engine.shape_steps.clear()
    engine.schedulers[0].cache.reset()  # no prompt's KV from the tests before: all computed here
    pool = engine.workers[0].eagle.kv_pool  # slots as other requests left them: not zeros
    g = torch.Generator().manual_seed(0)
    for buf in (pool.k_all, pool.v_all):
        buf.copy_(torch.randn(buf.shape, generator=g) * 4)
    reqs = engine.generate(chat_prompts[:4], SamplingParams(max_tokens=MAX, ignore_eos=True))
    for prompt, r, ref in zip(chat_prompts, reqs, plain_chat_outputs):
        assert_same_or_near_tie(hf_model, prompt, r.output_ids, ref[:MAX])
    assert set(engine.shape_steps) == {0, 1, 2, 3, PLAIN_STEP}
    # Shapes 1 and 2 run two and three steps after a plain one (shape 0, right after it,
    # drafts from the stale top-k and is not observed).
    drafted = [sum(lengths) / len(lengths) for s, lengths in policy.seen if s in (1, 2) and lengths]
    assert sum(drafted) / len(drafted) > 1.3  # without the write: 1.10


def test_policy_switches_as_the_batch_shrinks(engine, tokenizer, chat_prompts,
                                              plain_chat_outputs, hf_model):
    """Costs that make the chain win at 1-2 requests and the root at 3 or more; the
    requests end one after another, so the steps switch from the root to the chain."""
    shapes = engine.workers[0].eagle.shapes
    costs = [[1.0, 1.0, 9.0], [9.0] * 3, [9.0] * 3, [1.0, 1.0, 1.0]]  # [shape][size]
    engine.schedulers[0].draft_policy = DraftPolicy([(s.K, s.S, s.N) for s in shapes], costs,
                                                    [1, 2, 4], eager=True)
    engine.shape_steps.clear()
    lengths = [MAX, MAX - 8, MAX - 16, MAX - 24]
    reqs = engine.generate(chat_prompts[:4], [SamplingParams(max_tokens=n, ignore_eos=True)
                                              for n in lengths])
    for prompt, r, ref, n in zip(chat_prompts, reqs, plain_chat_outputs, lengths):
        assert_same_or_near_tie(hf_model, prompt, r.output_ids, ref[:n])
    assert engine.shape_steps[0] and engine.shape_steps[3]
    assert not engine.shape_steps[1] and not engine.shape_steps[2]


def test_cpu_steps_per_shape_reach_metrics(engine, tokenizer, chat_prompts):
    """Through the step channel and the engine core, as `kestrel serve` runs a CPU rank:
    the core counts the shape each step ran at, and /metrics exports the counts."""
    import asyncio

    from kestrel_testing import LocalEngine
    from serve_app.api.metrics import ServerMetrics
    from serve_app.engine.draft_policy import PLAIN_NAME, shape_name

    worker = engine.workers[0]

    async def run():
        local = await LocalEngine.start(worker.cfg, worker.info(), worker, tokenizer)
        local.core.schedulers[0].draft_policy = Cycle(5, plain=True)  # and plain steps
        stream = local.client.add_request(chat_prompts[0], dict(max_tokens=16, ignore_eos=True), "a")
        _ = [out async for out in stream]
        for _ in range(100):  # the last step comes back and is counted
            stats = await local.client.stats()
            if sum(stats["draft_shape_steps"].values()) == stats["steps"]["decode"]:
                break
            await asyncio.sleep(0.02)
        await local.stop()
        return stats

    stats = asyncio.run(run())
    names = [shape_name((s.K, s.S, s.N)) for s in worker.eagle.shapes] + [PLAIN_NAME]
    assert set(stats["draft_shape_steps"]) == set(names)  # k1s3n4, k1s2n3, k1s1n2, k1s1n1, plain
    m = ServerMetrics("m")
    m.update_engine({**stats, "replica": "r"})
    text = m.render()[0].decode()
    for name in names:
        assert f'kestrel_engine_draft_shape_steps_total{{model="m",replica="r",shape="{name}"}}' in text
    # The policy's estimates (here the stand-in's count of observed steps)
    [estimate] = stats["draft_accept"]
    assert estimate["value"] > 0
    assert 'kestrel_engine_draft_accept_estimate{model="m",rank="0",replica="r",shape="cycle"}' in text
