"""Mixed steps on the GPU as the h200 preset runs them: Triton attention, CUDA graphs for the
decode phases, the plan stream, the verify trees beside causal prefill chunks in one
eager target forward. Greedy speculative output with mixing equals plain output without
it, up to bf16 near-ties, and mixed steps did run. Skipped without CUDA."""
import pytest

from test_gpu_engine import BASE, CHAIN, MAX, TREE, check_near_ties

GRAPHS = ["attention.backend=triton", "attention.cuda_graphs=true", "attention.plan_stream=true",
          "scheduler.chunked_prefill_size=32", "scheduler.mixed_steps=true"]


def run(tokenizer, prompts, *overrides):
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    eng = LLMEngine(load_config(overrides=BASE + GRAPHS + list(overrides)), tokenizer=tokenizer)
    reqs = eng.generate(prompts, SamplingParams(max_tokens=MAX, ignore_eos=True))
    return [r.output_ids for r in reqs], dict(eng.mode_steps), dict(eng.eager_steps)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_mixed_spec_equals_plain_on_gpu(tokenizer, chat_prompts, fp32_ref, shape):
    plain, steps, _ = run(tokenizer, chat_prompts, "scheduler.mixed_steps=false")
    assert "mixed" not in steps
    spec, steps, eager = run(tokenizer, chat_prompts, "draft.enabled=true", *shape)
    assert steps.get("mixed", 0) >= 3, steps
    assert not eager, eager  # the decode phases replayed their graphs
    n = check_near_ties(fp32_ref, chat_prompts, spec, plain)
    print(f"mixed {shape[0]}: {steps}; {n}/{len(chat_prompts)} prompts diverged, all at near-ties")


def test_mixed_plain_equals_alternating_on_gpu(tokenizer, chat_prompts, fp32_ref):
    ref, _, _ = run(tokenizer, chat_prompts, "scheduler.mixed_steps=false")
    got, steps, _ = run(tokenizer, chat_prompts)
    assert steps.get("mixed", 0) >= 3, steps
    check_near_ties(fp32_ref, chat_prompts, got, ref)
