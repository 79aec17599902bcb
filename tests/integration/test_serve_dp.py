"""An Engine replica with two DP ranks: a placement group of 3 bundles (the replica and
one RankActor per rank), requests spread over both ranks, output unchanged.

It serves the 1-layer random model with SmolLM2's tokenizer (the tiny_model fixture): what
is under test is the ranks' placement, the spreading and the DP step, not the model, and
each of the two rank actors would spend seconds reading and loading SmolLM2."""
from __future__ import annotations

import asyncio

import openai
import pytest

from kestrel_testing import streamed_completion_text

pytestmark = pytest.mark.timeout(300)

APP = "dp2"
MODEL = "SmolLM2-135M-Instruct"


def test_two_dp_ranks_share_the_load_and_match_the_in_process_engine(server, tokenizer, tiny_model):
    from ray import serve

    from actors.worker.rank_worker import RankWorker
    from configs.schema import load_config
    from serve_app.app import build_app
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams

    # Also exercises batching of streamed tokens on an interval.
    cfg = load_config(overrides=server.overrides + [f"model.path={tiny_model}", "parallel.dp_size=2",
                                                    "serve.stream_interval_ms=100"])
    serve.run(build_app(cfg),
              name=APP, route_prefix="/dp")
    try:
        engine = serve.get_deployment_handle("EngineDeployment", app_name=APP)
        prompts = [f"Write a haiku about the number {i}." for i in range(6)]

        async def run_all():
            client = openai.AsyncOpenAI(base_url=server.base_url + "/dp/v1", api_key="x",
                                        max_retries=0, timeout=180)
            async with client:
                return await asyncio.gather(*(streamed_completion_text(client, MODEL, p, 12)
                                              for p in prompts))

        served = asyncio.run(run_all())
        ranks = engine.rank_stats.remote().result(timeout_s=30)
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["prompt_tokens_computed"] > 0 for r in ranks), ranks  # both ranks worked
        one_rank = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"dp_size": 1})})
        local = LLMEngine(one_rank, tokenizer=tokenizer, workers=[RankWorker(one_rank)])
        reqs = local.generate([tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=12))
        assert served == [r.text for r in reqs]
    finally:
        serve.delete(APP)
