"""Penalties, logit bias and min_tokens on the GPU (the h200 preset's engine in fp32: prefill
graphs, the processed decode and step graphs): the processing changes the answer, and
speculative output equals plain output with the same processing. In bf16 the
first run (2026-12-01) kept 2 of 8 prompts identical, parting as early as the third token,
against 8 of 8 for the same check in fp32 on the CPU: fp32 here tells precision from a
GPU-only fault."""
from test_prefill_graph_gpu import engine

from serve_app.engine.request import SamplingParams

MAX = 64


def test_penalties_on_gpu_keep_speculation_lossless(tokenizer, chat_prompts):
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, presence_penalty=0.6,
                            frequency_penalty=0.3, repetition_penalty=1.2,
                            logit_bias={13: -5.0}, min_tokens=4)
    fp32 = "model.dtype=float32"
    plain = [r.output_ids for r in engine(tokenizer, fp32, "draft.enabled=false").generate(chat_prompts, params)]
    free = engine(tokenizer, fp32, "draft.enabled=false").generate(
        chat_prompts, SamplingParams(max_tokens=MAX, ignore_eos=True))
    assert plain != [r.output_ids for r in free]
    spec = [r.output_ids for r in engine(tokenizer, fp32).generate(chat_prompts, params)]
    same = sum(a == b for a, b in zip(spec, plain))
    assert same >= len(chat_prompts) - 1, f"only {same} of {len(chat_prompts)} prompts identical"


def test_bad_words_and_prompt_logprobs_on_gpu(tokenizer, chat_prompts):
    """bad_words cut from the free answers: gone from the processed ones, and speculative
    output equals plain; prompt logprobs equal with speculation on and off (the prefill is
    the target's either way), fp32."""
    fp32 = "model.dtype=float32"
    free = [r.output_ids for r in engine(tokenizer, fp32, "draft.enabled=false").generate(
        chat_prompts, SamplingParams(max_tokens=MAX, ignore_eos=True))]
    words = [w for out in free for w in (out[5:6], out[10:12], out[20:23])]
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, bad_words=words, prompt_logprobs=2)
    plain = engine(tokenizer, fp32, "draft.enabled=false").generate(chat_prompts, params)
    spec = engine(tokenizer, fp32).generate(chat_prompts, params)
    for r in plain:
        assert not any(r.output_ids[k:k + len(w)] == w for w in words
                       for k in range(len(r.output_ids) - len(w) + 1))
    same = sum(a.output_ids == b.output_ids for a, b in zip(spec, plain))
    assert same >= len(chat_prompts) - 1, f"only {same} of {len(chat_prompts)} prompts identical"
    for a, b in zip(spec, plain):
        assert len(a.prompt_logprobs) == len(a.prompt_ids) - 1
        assert max(abs(x[0] - y[0]) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs)) < 1e-4


def test_json_schema_on_gpu_keeps_speculation_lossless(tokenizer, chat_prompts):
    """A JSON schema through the h200 preset's engine (fp32): speculative output equals
    plain under the grammar (per-node masks on the device), and every finished output
    validates."""
    import json

    from serve_app.text.grammar import compiler_for
    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "score"],
              "properties": {"answer": {"type": "string", "maxLength": 40},
                             "score": {"type": "integer", "minimum": 0, "maximum": 10}}}
    grammar = compiler_for(tokenizer).compile(("json_schema", json.dumps(schema)))
    params = SamplingParams(max_tokens=MAX, temperature=0.0, grammar=grammar)
    fp32 = "model.dtype=float32"
    plain = engine(tokenizer, fp32, "draft.enabled=false").generate(chat_prompts, params)
    spec = engine(tokenizer, fp32).generate(chat_prompts, params)
    same = sum(a.output_ids == b.output_ids for a, b in zip(spec, plain))
    assert same >= len(chat_prompts) - 1, f"only {same} of {len(chat_prompts)} prompts identical"
    finished = [r for r in spec if r.finish_reason == "stop"]
    assert finished
    for r in finished:
        value = json.loads(r.text)
        assert set(value) == {"answer", "score"} and 0 <= value["score"] <= 10
