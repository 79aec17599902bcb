"""Memory pressure through the Serve app: more concurrent long requests than the KV cache
holds, with speculation. Requests wait or are preempted and recomputed, none fails,
the replica stays the same, every greedy output equals the in-process engine's output
without pressure, and the free KV count returns to its start. A 1-layer random model with
SmolLM2's tokenizer keeps it fast (issue 16; docs/reliability.md)."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = "pressure"
REQUESTS, PROMPT, MAX_TOKENS = 8, 48, 48


# Speculation on; plain decoding under preemption is checked in process
# (tests/unit/test_engine.py, tests/unit/spec/test_penalties_lossless.py).
@pytest.mark.parametrize("spec", [True], ids=["tree"])
def test_more_requests_than_the_kv_holds_all_finish_exactly(server, tiny_model, spec):
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    model = tiny_model
    base = ["device=cpu", "model.dtype=float32", f"model.path={model}", "model.max_model_len=256",
            "kv_cache.prefix_caching=false", "scheduler.max_running_requests=16",
            f"draft.enabled={str(spec).lower()}", "draft.path=random",
            "draft.topk=4", "draft.num_steps=5", "draft.num_draft_tokens=8"]
    # 8 requests of 48 + 48 tokens want ~770 slots (more with speculation's windows).
    cfg = load_config(overrides=base + ["kv_cache.num_slots=420"])
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT)] for _ in range(REQUESTS)]
    ref_engine = LLMEngine(load_config(overrides=base + ["kv_cache.num_slots=8192"]))
    expected = [r.text for r in ref_engine.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    del ref_engine

    serve.run(build_app(cfg), name=APP, route_prefix="/pressure")
    url = server.base_url + "/pressure/v1/completions"
    try:
        engine = serve.get_deployment_handle("EngineDeployment", app_name=APP)
        replica = engine.stats.remote().result(timeout_s=30)["replica"]
        free0 = engine.kv_stats.remote().result(timeout_s=30)[0]["free"]

        async def one(client, p):
            r = await client.post(url, json={"prompt": p, "max_tokens": MAX_TOKENS,
                                             "temperature": 0, "ignore_eos": True})
            return r.status_code, r.json()

        async def run_all():
            async with httpx.AsyncClient(timeout=240) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        answers = asyncio.run(run_all())
        assert [s for s, _ in answers] == [200] * REQUESTS, [a for s, a in answers if s != 200][:2]
        got = [a["choices"][0]["text"] for _, a in answers]
        assert all(a["usage"]["completion_tokens"] == MAX_TOKENS for _, a in answers)
        stats = engine.stats.remote().result(timeout_s=30)
        ranks = engine.rank_stats.remote().result(timeout_s=30)
        assert stats["replica"] == replica  # no crash, no replacement
        assert ranks[0]["preemptions"] > 0  # the pressure was real
        assert got == expected
        assert engine.kv_stats.remote().result(timeout_s=30)[0]["free"] == free0
    finally:
        serve.delete(APP)
