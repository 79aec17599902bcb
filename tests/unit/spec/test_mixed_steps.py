"""Mixed steps (scheduler.mixed_steps): prefill chunks in the same target forward as the
running requests' decode rows, or their verify trees. Greedy output stays the plain
output token for token on real SmolLM2 weights (fp32; chain and tree, random and shipped
heads), seeded sampling gives the same tokens with and without mixing, and the steps
that must not mix (logprobs, grammars, dp_attention) do not."""
from __future__ import annotations

import pytest

from configs.schema import load_config
from kestrel_testing import assert_same_or_near_tie
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams
from spec_helpers import CHAIN, TREE, greedy, random_prompts, tiny_config

# Small chunks: prompts prefill over several steps while the first ones decode.
BASE = ["model.dtype=float32", "kv_cache.num_slots=8192", "scheduler.max_running_requests=16",
        "device=cpu", "scheduler.chunked_prefill_size=32", "scheduler.mixed_steps=true"]
MAX = 16


@pytest.fixture(scope="module")
def workers(fp32_worker):
    """SmolLM2 workers, one per draft setting (built on demand; plain: the session's);
    mixing is the scheduler's."""
    from actors.worker.rank_worker import RankWorker
    cache = {("draft.enabled=false",): fp32_worker}

    def get(*draft):
        if draft not in cache:
            cache[draft] = RankWorker(load_config(overrides=BASE + list(draft)))
        return cache[draft]
    return get


@pytest.mark.parametrize("draft", [
    ("draft.enabled=false",),
    # Long, for make test's budget: a chain is a tree of one branch, which the tree cases run.
    pytest.param(("draft.enabled=true", "draft.path=random", *CHAIN), marks=pytest.mark.long),
    ("draft.enabled=true", "draft.path=random", *TREE),
    # The shipped head's long accepts beside the chunks: long, for make test's budget (the
    # random tree above runs the same mixed steps).
    pytest.param(("draft.enabled=true", *TREE), marks=pytest.mark.long),
], ids=["plain", "chain", "tree", "shipped-tree"])
def test_mixed_steps_keep_greedy_output(workers, tokenizer, chat_prompts, plain_chat_outputs,
                                        hf_model, draft):
    """Against the session's plain reference (conftest.py; itself checked against
    transformers in test_engine.py)."""
    prompts = chat_prompts[:3]
    cfg = load_config(overrides=BASE + list(draft))
    eng = LLMEngine(cfg, tokenizer=tokenizer, workers=[workers(*draft)])
    reqs = eng.generate(prompts, greedy(MAX))
    assert eng.mode_steps.get("mixed", 0) >= 3, eng.mode_steps  # later prompts' chunks beside decodes
    for prompt, r, want in zip(prompts, reqs, plain_chat_outputs):
        assert_same_or_near_tie(hf_model, prompt, r.output_ids, want[:MAX])


def test_seeded_sampling_is_the_same_with_and_without_mixing(tiny_model):
    """Coins are drawn per request, not per step shape: a seed gives the same tokens
    whether its chunks rode beside decodes or not (plain and speculative)."""
    prompts = random_prompts(6, seed=3)
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
    for spec in (False, True):
        got = {}
        for mixed in (False, True):
            cfg = tiny_config(tiny_model, "scheduler.chunked_prefill_size=16",
                              f"scheduler.mixed_steps={str(mixed).lower()}", spec=spec)
            eng = LLMEngine(cfg, load_tokenizer=False)
            got[mixed] = [r.output_ids for r in eng.generate(prompts, params)]
            assert (eng.mode_steps.get("mixed", 0) > 0) == mixed, eng.mode_steps
        assert got[True] == got[False]


def test_logprobs_requests_keep_steps_apart(tiny_model):
    """A running request that asks for logprobs keeps prefill and decode in separate steps
    (its logprobs come from a decode forward); without it the same load mixes."""
    prompts = random_prompts(5, seed=4)
    for logprobs, mixes in ((None, True), (2, False)):
        eng = LLMEngine(tiny_config(tiny_model, "scheduler.chunked_prefill_size=16",
                                    "scheduler.mixed_steps=true", spec=False),
                        load_tokenizer=False)
        params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=logprobs)] + [greedy(10)] * 4
        reqs = eng.generate(prompts, params)
        assert ("mixed" in eng.mode_steps) == mixes, eng.mode_steps
        if logprobs:
            assert len(reqs[0].token_logprobs) == 10


def test_mixed_steps_do_not_apply_under_dp_attention(tiny_model, caplog):
    from serve_app.engine.scheduler import Scheduler
    info = {"window": 1, "max_context": 600, "num_slots": 4096, "num_rows": 10}
    cfg = tiny_config(tiny_model, "scheduler.mixed_steps=true", spec=False)
    assert Scheduler(cfg, info, [2]).mix
    assert not Scheduler(tiny_config(tiny_model, spec=False), info, [2]).mix  # off by default
    dp = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"dp_attention": True})})
    with caplog.at_level("INFO", logger="kestrel.scheduler"):
        assert not Scheduler(dp, info, [2]).mix
    assert "scheduler.mixed_steps does not apply (parallel.dp_attention" in caplog.text
