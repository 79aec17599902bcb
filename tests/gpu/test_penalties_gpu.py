"""Penalties, logit bias and min_tokens on the GPU (bf16, the h200 preset's engine: prefill
graphs, the per-phase speculative path that processing takes): the processing changes the
answer, and speculative output equals plain output with the same processing but for bf16
near-ties (a few prompts of eight at most)."""
from test_prefill_graph_gpu import engine

from serve_app.request import SamplingParams

MAX = 64


def test_penalties_on_gpu_keep_speculation_lossless(tokenizer, chat_prompts):
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, presence_penalty=0.6,
                            frequency_penalty=0.3, repetition_penalty=1.2,
                            logit_bias={13: -5.0}, min_tokens=4)
    plain = [r.output_ids for r in engine(tokenizer, "draft.enabled=false").generate(chat_prompts, params)]
    free = engine(tokenizer, "draft.enabled=false").generate(
        chat_prompts, SamplingParams(max_tokens=MAX, ignore_eos=True))
    assert plain != [r.output_ids for r in free]
    spec = [r.output_ids for r in engine(tokenizer).generate(chat_prompts, params)]
    same = sum(a == b for a, b in zip(spec, plain))
    assert same >= len(chat_prompts) - 2, f"only {same} of {len(chat_prompts)} prompts identical"
    # Where they part, they agree up to there: a near-tie, not a drift from the start.
    assert all(a[:8] == b[:8] for a, b in zip(spec, plain))
