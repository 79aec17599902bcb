"""The engine on a GPU (bf16): speculative equals plain up to bf16 near-ties, per backend,
and graph replay of target decode equals eager. Skipped without CUDA."""
import importlib.util

import pytest
import torch
from kestrel_testing import GPU_DRAFT

BASE = ["device=cuda", "draft.enabled=false", "model.dtype=bfloat16", "kv_cache.num_slots=65536",
        "scheduler.max_running_requests=16", *GPU_DRAFT]
CHAIN = ["draft.topk=1", "draft.num_steps=3", "draft.num_draft_tokens=4"]
TREE = ["draft.topk=4", "draft.num_steps=5", "draft.num_draft_tokens=8"]
MAX = 64
FLASHINFER = pytest.param("flashinfer", marks=pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"))


def run(tokenizer, prompts, *overrides):
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    eng = LLMEngine(load_config(overrides=BASE + list(overrides)), tokenizer=tokenizer)
    return [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=MAX, ignore_eos=True))]


def gap_at(model, ids) -> float:
    """Top-2 logit gap of the fp32 reference after `ids` (dense causal attention)."""
    import torch.nn.functional as F
    t = torch.tensor(ids, device="cuda")

    def attn(q, k, v, layer):
        dtype = q.dtype  # the model's: the output goes back into its layers
        q, k, v = (x.transpose(0, 1)[None].float() for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1).to(dtype)
    with torch.no_grad():
        h, _ = model.forward(t, torch.arange(len(ids), device="cuda"), attn)
        top2 = model.compute_logits(h[-1:])[0].topk(2).values
    return float(top2[0] - top2[1])


def check_near_ties(model, prompts, got, ref, tol=0.5):
    """Every divergence from the plain run sits at a bf16 near-tie; returns how many."""
    n = 0
    for p, a, b in zip(prompts, got, ref):
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is not None:
            gap = gap_at(model, p + b[:d])
            assert gap < tol, f"divergence at {d} with top-2 gap {gap:.3f} (not a bf16 near-tie)"
            n += 1
    return n


@pytest.mark.parametrize("backend", ["torch_native", "triton", FLASHINFER])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_spec_lossless_on_gpu(tokenizer, chat_prompts, fp32_ref, backend, shape):
    plain = run(tokenizer, chat_prompts, f"attention.backend={backend}")
    spec = run(tokenizer, chat_prompts, f"attention.backend={backend}", "draft.enabled=true",
               "draft.path=random", *shape)
    n = check_near_ties(fp32_ref, chat_prompts, spec, plain)
    print(f"{backend} {shape[0]}: {n}/{len(chat_prompts)} prompts diverged, all at near-ties")


@pytest.mark.parametrize("backend", ["triton", FLASHINFER])
def test_decode_graphs_equal_eager(tokenizer, chat_prompts, fp32_ref, backend):
    eager = run(tokenizer, chat_prompts[:5], f"attention.backend={backend}", "attention.cuda_graphs=false")
    graphs = run(tokenizer, chat_prompts[:5], f"attention.backend={backend}", "attention.cuda_graphs=true",
                 "attention.cuda_graph_batch_sizes=[1,2,4,8]")
    check_near_ties(fp32_ref, chat_prompts[:5], graphs, eager)
    assert sum(a == b for a, b in zip(graphs, eager)) >= 4


def test_few_row_gemv_serves_as_cublas_does(tokenizer, chat_prompts, fp32_ref):
    """model.gemv_max_rows sends the linears at 1-16 rows to the Triton GEMV: greedy output
    equals cuBLAS's up to bf16 near-ties, with graphs, and speculation on top of it equals
    plain decoding on it."""
    from kestrel_kernels import small_rows_linear
    graphs = ["attention.backend=triton", "attention.cuda_graphs=true"]
    cublas = run(tokenizer, chat_prompts, *graphs)
    gemv = run(tokenizer, chat_prompts, *graphs, "model.gemv_max_rows=16")
    assert small_rows_linear._gpu_max_rows == 16  # the rank worker set it
    spec = run(tokenizer, chat_prompts, *graphs, "model.gemv_max_rows=16", "draft.enabled=true",
               "draft.path=random", *TREE)
    for name, got, ref in (("gemv/cublas", gemv, cublas), ("spec/gemv", spec, gemv)):
        n = check_near_ties(fp32_ref, chat_prompts, got, ref)
        print(f"{name}: {n}/{len(chat_prompts)} prompts diverged, all at near-ties")


@pytest.mark.parametrize("backend", ["triton", FLASHINFER])
def test_eagle3_head_and_sampled_rows_on_gpu(tokenizer, chat_prompts, fp32_ref, backend):
    """An EAGLE-3 head (its own draft vocabulary, mapped back through d2t after the draft's
    top-k kernel) keeps greedy output plain up to near-ties; a batch mixing greedy and
    seeded sampled rows keeps the greedy rows and repeats itself run to run."""
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    prompts = chat_prompts[:6]
    spec = [f"attention.backend={backend}", "draft.enabled=true", "draft.path=random",
            "draft.arch=eagle3", *TREE]
    plain = run(tokenizer, prompts, f"attention.backend={backend}")
    check_near_ties(fp32_ref, prompts, run(tokenizer, prompts, *spec), plain)
    params = [SamplingParams(max_tokens=MAX, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=MAX, temperature=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = []
    for _ in range(2):
        eng = LLMEngine(load_config(overrides=BASE + spec), tokenizer=tokenizer)
        outs.append([r.output_ids for r in eng.generate(prompts, params)])
        del eng
    assert outs[0] == outs[1]  # seeded sampling: reproducible
    assert all(len(o) == MAX for o in outs[0])
    greedy = [i for i in range(len(prompts)) if i % 2 == 0]
    check_near_ties(fp32_ref, [prompts[i] for i in greedy], [outs[0][i] for i in greedy],
                    [plain[i] for i in greedy])
