"""prompt_logprobs (vLLM's): every prompt token's log-probability under the model given the
tokens before it, with the top alternatives and the token's rank, from the raw logits.

Checked against transformers' own forward of the same random Llama (fp32): plain and
speculative engines (the prefill is the target's either way), prompts in several
chunks, a batch where only some requests ask, a prefix the cache holds (a request that
asks is prefilled whole), and the CPU stand-in of the prefill graphs (a plan that asks
runs eagerly). The generated tokens stay those of a request that does not ask."""
from __future__ import annotations

import pytest
import torch
from spec_helpers import TREE, random_prompts, tiny_engine

from serve_app.engine.request import SamplingParams

TOL = 5e-5


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # [P, V]
    return logprobs


def check(entries, prompt, ref_lp, k):
    assert entries[0] is None and len(entries) == len(prompt)
    for j in range(1, len(prompt)):
        lp, top_ids, top_lps, rank = entries[j]
        row = ref_lp[j - 1]  # position j - 1 predicts token j
        assert abs(lp - float(row[prompt[j]])) < TOL, (j, lp, float(row[prompt[j]]))
        assert rank == int((row > row[prompt[j]]).sum()) + 1 or abs(
            float(row.sort(descending=True).values[rank - 1]) - lp) < TOL
        ref_top = row.topk(k)
        assert len(top_ids) == k
        for got, want in zip(top_lps, ref_top.values.tolist()):
            assert abs(got - want) < TOL
        # Ids may swap only where their logprobs tie.
        assert all(abs(float(row[i]) - v) < TOL for i, v in zip(top_ids, top_lps))


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "tree"])
def test_prompt_logprobs_equal_the_reference(tiny_llama_dir, reference, spec):
    eng = tiny_engine(tiny_llama_dir, "scheduler.chunked_prefill_size=16", *(TREE if spec else ()),
                      spec=spec)
    prompts = [p + p for p in random_prompts(4, seed=5)]  # 10-78 tokens: one to five chunks
    base = random_prompts(1, seed=9)[0] * 3
    prompts += [base, base[:len(base) - 4] + [7, 8, 9]]  # the second shares a cached prefix
    asking = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    silent = eng.generate(prompts, plain)  # the same outputs without prompt logprobs
    eng.generate([base], plain)  # base's pages now sit in the prefix cache
    params = [asking if i % 2 == 0 or i >= 4 else plain for i in range(len(prompts))]
    reqs = eng.generate(prompts, params)
    for req, p, prompt, ref in zip(reqs, params, prompts, silent):
        assert req.output_ids == ref.output_ids
        if p.prompt_logprobs is None:
            assert req.prompt_logprobs == []
            continue
        check([None] + req.prompt_logprobs, prompt, reference(prompt), 3)
    # The asking requests ran every prompt position: none of them came from the cache.
    assert all(r.cached_tokens == 0 for r, p in zip(reqs, params) if p.prompt_logprobs is not None)


def test_prompt_logprobs_reach_the_first_output(tiny_llama_dir, reference):
    outs = []
    eng = tiny_engine(tiny_llama_dir, "scheduler.chunked_prefill_size=16", spec=False)
    prompt = random_prompts(1, seed=2)[0] * 2
    eng.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0),
                    on_output=outs.append)
    while eng.has_work:
        eng.step()
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    check(outs[0].prompt_logprobs, prompt, reference(prompt), 0)


def test_a_plan_that_asks_skips_the_prefill_graphs(tiny_llama_dir, reference):
    eng = tiny_engine(tiny_llama_dir, spec=False)
    worker = eng.workers[0]
    worker.capture_prefill_graphs([1, 2, 4], [16, 32, 64], 256, use_cuda_graph=False)
    prompt = random_prompts(1, seed=4)[0]
    req = eng.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1))[0]
    check([None] + req.prompt_logprobs, prompt, reference(prompt), 1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
