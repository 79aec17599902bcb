"""The packed CPU model (model.cpu_weights=packed): greedy speculative output equals its
own plain output token for token, at batch 1 and at batch 8 (every decode and verify step
runs the kernels, whatever its batch size). The block matmuls and the attention of decode and
verify forwards are batch-invariant (kestrel_kernels/cpu_q4.cpp, cpu_attention.cpp): a
token's logits do not depend on how many rows its step computes, so a verify and a decode
step agree bit for bit, near-ties included."""
import pytest

from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from spec_helpers import CHAIN, greedy

BASE = ["kv_cache.num_slots=8192", "scheduler.max_running_requests=16", "device=cpu",
        "model.cpu_weights=packed"]
MAX = 16  # a verify step that disagrees with decode shows in the first rounds of 8 rows


def run(cfg, tokenizer, prompts, batch):
    eng = LLMEngine(cfg, tokenizer=tokenizer)
    assert eng.workers[0].cpu_weights == "packed"
    return [r for i in range(0, len(prompts), batch) for r in eng.generate(prompts[i:i + batch], greedy(MAX))]


@pytest.mark.parametrize("batch,n", [
    # One request at a time is also held to packed plain output through Serve, with a grammar
    # (test_serve_default_spec.py, packed): long, for make test's budget.
    pytest.param(1, 4, marks=pytest.mark.long),
    (8, 8),
])
def test_packed_model_speculates_losslessly(tokenizer, chat_prompts, batch, n):
    cfg = load_config(overrides=BASE + ["draft.enabled=true", *CHAIN])
    plain = run(load_config(overrides=BASE + ["draft.enabled=false"]), tokenizer, chat_prompts[:n], batch)
    spec = run(cfg, tokenizer, chat_prompts[:n], batch)
    for s, p in zip(spec, plain):
        assert s.output_ids == p.output_ids
    acc = [a for r in spec for a in r.accept_lengths]
    assert sum(acc) / len(acc) > 1.2  # the shipped head drafts
