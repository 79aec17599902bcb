"""The served default configuration speculates with the shipped head, and stays lossless:
greedy chat completions through Ray Serve and the official client equal the in-process
plain engine's, with a JSON schema too, and the app's /metrics counts speculative accept
lengths."""
import json
import re

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

APP = "kestrel-default-spec"
MODEL = "SmolLM2-135M-Instruct"
PERSON_ASK = "Invent a person. Reply with JSON."
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}


def test_default_config_speculates_losslessly_through_serve(server, tokenizer, fp32_worker):
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.text.grammar import compiler_for
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template

    # The default preset as shipped; only fp32 (token-for-token comparison) and a small cache.
    cfg = load_config(overrides=["device=cpu", "model.dtype=float32", "kv_cache.num_slots=4096"])
    assert cfg.draft.enabled and cfg.draft.path is None
    serve.run(build_app(cfg),
              name=APP, route_prefix="/spec")
    try:
        questions = ["Name three primary colors.", "What is the capital of France?"]
        with openai.OpenAI(base_url=server.base_url + "/spec/v1", api_key="x", max_retries=0,
                           timeout=180) as client:
            served = [client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=32,
                temperature=0).choices[0].message.content for q in questions]
            # A JSON schema: each tree node masked by the grammar state along its path.
            person = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PERSON_ASK}], max_tokens=48,
                temperature=0, response_format={"type": "json_schema", "json_schema": {
                    "name": "person", "schema": PERSON}}).choices[0].message.content
        metrics = httpx.get(server.base_url + "/spec/metrics", timeout=30).text
        count = re.search(r"^kestrel_spec_accept_length_count\{[^}]*\} (\S+)", metrics, re.M)
        assert count and float(count.group(1)) > 0, "no speculative iterations were counted"

        plain = LLMEngine(load_config(overrides=server.overrides), tokenizer=tokenizer,
                          workers=[fp32_worker])
        prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions]
        reqs = plain.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
        assert served == [r.text for r in reqs]
        grammar = compiler_for(tokenizer).compile(("json_schema", json.dumps(PERSON)))
        ref = plain.generate([apply_chat_template(tokenizer, [{"role": "user", "content": PERSON_ASK}])],
                             SamplingParams(max_tokens=48, temperature=0, grammar=grammar))[0]
        assert person == ref.text
        assert set(json.loads(person)) == {"name", "age"}
    finally:
        serve.delete(APP)
