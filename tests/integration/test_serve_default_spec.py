"""The served default configuration speculates with the shipped head, and stays lossless:
greedy chat completions through Ray Serve and the official client equal the in-process
plain engine's, with a JSON schema too, and the app's /metrics counts speculative accept
lengths; with float32 weights, and with the packed weights the preset serves on a CPU."""
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


@pytest.mark.parametrize("weights", [
    # Speculation in float32 through Serve is held to the in-process engine exactly by
    # test_serve_memory_pressure (tree), and the default config with the shipped head by
    # the packed case: long, for make test's budget.
    pytest.param("float32", marks=pytest.mark.long),
    "packed",  # what the preset serves on a CPU
])
def test_default_config_speculates_losslessly_through_serve(server, tokenizer, fp32_worker, weights):
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.text.grammar import compiler_for
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template

    # The default preset as shipped, with a small cache; float32: the GGUF's values exactly.
    base = ["device=cpu", "kv_cache.num_slots=4096"] + (["model.dtype=float32"] if weights == "float32" else [])
    cfg = load_config(overrides=base)
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

        if weights == "float32":
            plain = LLMEngine(load_config(overrides=server.overrides), tokenizer=tokenizer,
                              workers=[fp32_worker])
        else:
            plain = LLMEngine(load_config(overrides=base + ["draft.enabled=false"]), tokenizer=tokenizer)
            assert plain.workers[0].cpu_weights == "packed"
        prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions]
        # One at a time, as the client sent them: prefill's GEMM and attention are not
        # batch-invariant (decode and verify steps are), and at a near-tie that shows.
        reqs = [plain.generate([p], SamplingParams(max_tokens=32, temperature=0))[0] for p in prompts]
        assert served == [r.text for r in reqs]
        grammar = compiler_for(tokenizer).compile(("json_schema", json.dumps(PERSON)))
        ref = plain.generate([apply_chat_template(tokenizer, [{"role": "user", "content": PERSON_ASK}])],
                             SamplingParams(max_tokens=48, temperature=0, grammar=grammar))[0]
        assert person == ref.text
        assert set(json.loads(person)) == {"name", "age"}
    finally:
        serve.delete(APP)
