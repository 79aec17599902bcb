"""The packed CPU model (model.cpu_weights=packed): greedy speculative output equals its
own plain output, at batch 1 and at the largest batch whose decode steps run the kernels
(cpu_packed_max_batch). The kernels compute each row alone, but attention over a verify's
tree and a decode step's one query may differ in the last float32 bit, and the kernels'
bfloat16 rounding can carry that to the logits: so equal token for token, or diverging
only where this model's own top two logits are a near-tie (as the fp32 tests allow against
transformers)."""
import pytest
import torch
import torch.nn.functional as F

from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from spec_helpers import CHAIN, greedy

BASE = ["kv_cache.num_slots=8192", "scheduler.max_running_requests=16", "device=cpu",
        "model.cpu_weights=packed"]
MAX = 24
TIE = 0.1  # logits: a few bfloat16 steps of the kernels' rounding


def run(cfg, tokenizer, prompts, batch):
    eng = LLMEngine(cfg, tokenizer=tokenizer)
    assert eng.workers[0].cpu_weights == "packed"
    reqs = [r for i in range(0, len(prompts), batch)
            for r in eng.generate(prompts[i:i + batch], greedy(MAX))]
    return reqs, eng.workers[0].model


def top2_gap(model, ids: list[int]) -> float:
    """The packed model's top-2 logit gap after `ids` (kernels on, dense causal attention)."""
    def attn(q, k, v, layer):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, enable_gqa=True)
        return o.transpose(0, 1)
    t = torch.tensor(ids)
    with torch.inference_mode():
        model.kernel_switch.on = True
        top = model.compute_logits(model(t, torch.arange(t.numel()), attn)[0][-1:])[0].topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("batch", [1, 4])
def test_packed_model_speculates_losslessly_but_for_near_ties(tokenizer, chat_prompts, batch):
    cfg = load_config(overrides=BASE + ["draft.enabled=true", *CHAIN])
    assert cfg.model.cpu_packed_max_batch >= batch
    plain, model = run(load_config(overrides=BASE + ["draft.enabled=false"]), tokenizer,
                       chat_prompts[:4], batch)
    spec, _ = run(cfg, tokenizer, chat_prompts[:4], batch)
    same = 0
    for prompt, s, p in zip(chat_prompts, spec, plain):
        if s.output_ids == p.output_ids:
            same += 1
            continue
        d = next(i for i, (a, b) in enumerate(zip(s.output_ids, p.output_ids)) if a != b)
        gap = top2_gap(model, prompt + p.output_ids[:d])
        assert gap < TIE, f"diverged at output {d} where the top-2 logit gap is {gap:.3f}"
    assert same >= 2
    acc = [a for r in spec for a in r.accept_lengths]
    assert sum(acc) / len(acc) > 1.2  # the shipped head drafts
