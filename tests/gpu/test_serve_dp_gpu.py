"""DP=2 over NCCL through the Serve app (issue 18): an Engine replica whose two RankActors
hold a GPU each (its placement group's bundles), independent ranks and dp_attention,
speculating (the h200 preset's tree and the shipped head) with CUDA graphs, in fp32: its greedy
completions over HTTP equal the in-process engine's on one GPU, token for token. Skipped
without two GPUs; tests/integration/test_serve_dp.py and test_serve_dp_attention.py are the
CPU (gloo) twins."""
from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
              pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
FP32 = ["model.dtype=float32", "kv_cache.num_slots=65536", "scheduler.max_running_requests=16",
        "attention.cuda_graph_batch_sizes=[1,2,4,8,16]"]


@pytest.mark.parametrize("attention", [False, True], ids=["independent", "dp_attention"])
def test_two_gpu_ranks_over_http_equal_one_gpu(h200_serve_port, tokenizer, attention):
    import openai
    from ray import serve

    from configs.schema import load_config
    from kestrel_testing import ROOT
    from serve_app.app import build_app
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams

    app = f"dp2-{'attn' if attention else 'ind'}"
    overrides = FP32 + ["parallel.dp_size=2", f"parallel.dp_attention={str(attention).lower()}"]
    cfg = load_config(path=str(ROOT / "configs" / "h200.yaml"), overrides=overrides)
    serve.run(build_app(cfg), name=app, route_prefix=f"/{app}")
    prompts = [f"Write a haiku about the number {i}." for i in range(12)]
    try:
        async def run_all():
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{h200_serve_port}/{app}/v1",
                                        api_key="x", max_retries=0, timeout=300)
            async with client:
                outs = await asyncio.gather(*(client.completions.create(
                    model=MODEL, prompt=p, max_tokens=32, temperature=0) for p in prompts))
            return [o.choices[0].text for o in outs]

        served = asyncio.run(run_all())
        engine = serve.get_deployment_handle("EngineDeployment", app_name=app)
        ranks = engine.rank_stats.remote().result(timeout_s=60)
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["prompt_tokens_computed"] > 0 for r in ranks), ranks  # both ranks worked
    finally:
        serve.delete(app)
    one = load_config(path=str(ROOT / "configs" / "h200.yaml"), overrides=FP32)
    local = LLMEngine(one, tokenizer=tokenizer)
    want = local.generate([tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=32))
    assert served == [r.text for r in want]
