"""Mixed steps and the adaptive draft shape through the Serve app: requests arrive while
others decode, so their prompt chunks ride in the running requests' steps, and the draft
policy picks each step's shape from its timed costs and the accept lengths it sees.
Greedy completions over HTTP equal the in-process plain engine's, for plain decoding, a
chain and a tree, and /metrics shows that steps mixed and that the policy took more than
one shape. A 1-layer random model with SmolLM2's tokenizer in float32 keeps it fast; the
same properties on SmolLM2's real weights are held in process by
tests/unit/spec/test_mixed_steps.py and test_adaptive_draft_lossless.py."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = "mixed-adaptive"
REQUESTS, MAX_TOKENS = 6, 24
BASE = ["device=cpu", "model.dtype=float32", "model.max_model_len=256",
        "kv_cache.num_slots=4096", "kv_cache.prefix_caching=false",
        "scheduler.max_running_requests=8", "scheduler.chunked_prefill_size=16"]
DRAFTS = {
    "plain": ["draft.enabled=false"],
    # the policy's choices: the configured shape, a smaller one, or a plain step
    "chain": ["draft.enabled=true", "draft.path=random", "draft.topk=1", "draft.num_steps=3",
              "draft.num_draft_tokens=4", "draft.adaptive_shapes=[[1,2]]"],
    "tree": ["draft.enabled=true", "draft.path=random", "draft.topk=4", "draft.num_steps=5",
             "draft.num_draft_tokens=8", "draft.adaptive_shapes=[[2,4],[1,1]]"],
}
# Shapes timed eagerly at start-up. No plain steps: on this model a plain step costs a fifth
# of a draft's, so the policy would take them throughout (the packed default serves them,
# test_serve_default_spec.py); among drafting shapes a random head's accept lengths move
# it from the configured shape to the smaller ones.
POLICY = ["draft.eager_shapes=true", "draft.plain_steps=false"]


# A replica's start-up each: make test's budget takes the tree (the adaptive shapes with
# the most to switch between); plain and chain mixed steps are held in process there too
# (test_mixed_steps.py, test_adaptive_draft_lossless.py).
@pytest.mark.parametrize("draft", [pytest.param("plain", marks=pytest.mark.long),
                                   pytest.param("chain", marks=pytest.mark.long), "tree"])
def test_mixed_steps_and_adaptive_shapes_over_http_equal_the_engine(server, tiny_model, draft):
    from ray import serve

    from benchmarks.http_client import parse_metrics
    from configs.schema import load_config
    from serve_app.app import build_app
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams

    served = BASE + [f"model.path={tiny_model}", "scheduler.mixed_steps=true", *DRAFTS[draft]]
    if draft != "plain":
        served += POLICY
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(30, 70))]
               for _ in range(REQUESTS)]
    # The reference: plain decoding, no mixing, one request at a time.
    ref = LLMEngine(load_config(overrides=BASE + [f"model.path={tiny_model}", "draft.enabled=false"]))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [ref.generate([p], params)[0].text for p in prompts]
    del ref

    serve.run(build_app(load_config(overrides=served)), name=APP, route_prefix="/mixed")
    url = server.base_url + "/mixed/v1/completions"
    try:
        async def one(client, i, p):
            await asyncio.sleep(0.05 * i)  # arrivals while the earlier requests decode
            r = await client.post(url, json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                                             "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        async def run_all():
            async with httpx.AsyncClient(timeout=240) as client:
                return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

        answers = asyncio.run(run_all())
        assert all(a["usage"]["completion_tokens"] == MAX_TOKENS for a in answers)
        assert [a["choices"][0]["text"] for a in answers] == expected
        metrics = parse_metrics(httpx.get(server.base_url + "/mixed/metrics", timeout=30).text)
        assert metrics.get("kestrel_engine_steps_total:mixed", 0) > 0, metrics  # chunks rode in decode steps
        if draft != "plain":
            shapes = {k: v for k, v in metrics.items()
                      if k.startswith("kestrel_engine_draft_shape_steps_total:")}
            assert sum(v > 0 for v in shapes.values()) >= 2, shapes  # the policy switched
    finally:
        serve.delete(APP)
