"""An Engine replica whose two DP ranks step in lockstep (parallel.dp_attention=true),
speculating: over HTTP its greedy output equals the in-process engine's on one rank;
prompt_logprobs is refused; a killed rank fails the in-flight stream within 30 s with an
error, Serve replaces the replica and the next request succeeds. On the 1-layer random
model with SmolLM2's tokenizer (the tiny_model fixture): the ranks' group and steps are
under test."""
from __future__ import annotations

import asyncio

import openai
import pytest
from fault_scenario import kill_mid_stream_and_recover
from kestrel_testing import streamed_completion_text

pytestmark = pytest.mark.timeout(300)

APP = "dpattn"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def dp_attention_cfg(server, tiny_model):
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    # Speculative (the preset's chain, a random EAGLE-1 head drafting below draft.max_token_id):
    # the draft phases and the LM head's vocabulary cut run their collectives too.
    cfg = load_config(overrides=server.overrides + [f"model.path={tiny_model}", "parallel.dp_size=2",
                                                    "parallel.dp_attention=true", "draft.enabled=true",
                                                    "draft.path=random", "draft.arch=eagle",
                                                    "draft.max_token_id=16384"])
    # A health check each second: the replacement after the kill starts sooner.
    serve.run(build_app(cfg, engine_options={"health_check_period_s": 1.0}), name=APP,
              route_prefix="/dpattn")
    try:
        yield cfg
    finally:
        serve.delete(APP)


# Long, for make test's budget: lockstep ranks are tests/unit/test_dp_attention.py's, and a
# replica of several ranks over Serve is test_serve_dp.py's, both in make test.
@pytest.mark.long
def test_lockstep_ranks_serve_the_tokens_of_one_rank(server, dp_attention_cfg, tokenizer):
    from ray import serve

    from actors.worker.rank_worker import RankWorker
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams

    prompts = [f"Write a haiku about the number {i}." for i in range(5)]
    lens = [12, 4, 12, 8, 12]  # some finish early: steps with an idle rank

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/dpattn/v1", api_key="x",
                                    max_retries=0, timeout=180)
        async with client:
            served = await asyncio.gather(*(streamed_completion_text(client, MODEL, p, n)
                                          for p, n in zip(prompts, lens)))
            with pytest.raises(openai.BadRequestError, match="dp_attention"):
                await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                extra_body={"prompt_logprobs": 1})
            return served

    served = asyncio.run(run_all())
    engine = serve.get_deployment_handle("EngineDeployment", app_name=APP)
    ranks = engine.rank_stats.remote().result(timeout_s=30)
    assert all(r["prompt_tokens_computed"] > 0 for r in ranks), ranks  # both ranks had requests
    cfg = dp_attention_cfg
    one_rank = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
        update={"dp_size": 1, "dp_attention": False})})
    local = LLMEngine(one_rank, tokenizer=tokenizer, workers=[RankWorker(one_rank)])
    reqs = local.generate([tokenizer.encode(p) for p in prompts],
                          [SamplingParams(max_tokens=n) for n in lens])
    assert served == [r.text for r in reqs]


@pytest.mark.long  # a killed rank and the replica's return: test_serve_faults.py's rank case in make test
def test_a_killed_rank_fails_the_stream_and_the_replica_comes_back(server, dp_attention_cfg):
    kill_mid_stream_and_recover(server.base_url + "/dpattn/v1/completions", APP, "rank1", "rank 1")
