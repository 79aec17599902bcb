"""Prefill graphs and the warm-up on the GPU (bf16, the h200 preset's engine).

Prompts prefilled alone and eight at once replay padded graphs; their outputs equal the
eager prefill's up to bf16 near-ties, plain and speculative. After start-up (graph capture and the prefill
warm-up), serving a mix of batch sizes and prompt lengths as HTTP traffic brings it
compiles no Triton kernel: each compile would stall the requests of its step."""
import pytest
from test_gpu_engine import MAX, check_near_ties

H200 = ["attention.cuda_graph_batch_sizes=[1,2,4,8,16]", "scheduler.max_running_requests=16",
        "kv_cache.num_slots=65536"]


def engine(tokenizer, *overrides):
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    return LLMEngine(load_config("configs/h200.yaml", H200 + list(overrides)), tokenizer=tokenizer)


def one_by_one_and_together(eng, prompts):
    from serve_app.engine.request import SamplingParams
    params = SamplingParams(max_tokens=MAX, ignore_eos=True)
    alone = [eng.generate([p], params)[0].output_ids for p in prompts]
    return alone + [r.output_ids for r in eng.generate(prompts, params)]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "tree"])
def test_prefill_graphs_equal_eager_on_gpu(tokenizer, chat_prompts, fp32_ref, spec):
    flags = [f"draft.enabled={str(spec).lower()}", "kv_cache.prefix_caching=false"]
    eager = one_by_one_and_together(engine(tokenizer, *flags, "attention.prefill_graph_tokens=[]"),
                                    chat_prompts)
    eng = engine(tokenizer, *flags)
    graphs = eng.workers[0].prefill_graphs
    assert graphs is not None and graphs.use_cuda_graph
    replays = []
    run = graphs.run
    graphs.run = lambda plan, shape: replays.append(shape) or run(plan, shape)
    got = one_by_one_and_together(eng, chat_prompts)
    assert {b for b, _ in replays} >= {1, 8}  # alone, and all eight in one padded step
    n = check_near_ties(fp32_ref, chat_prompts * 2, got, eager)
    assert n <= 4, f"{n} of {2 * len(chat_prompts)} runs diverged"


def test_serving_compiles_no_kernel_after_start_up(tokenizer, chat_prompts):
    from serve_app.engine.request import SamplingParams
    eng = engine(tokenizer)
    watch = eng.workers[0].compiles
    assert watch._armed
    prompts = chat_prompts * 3
    # Prompts alone and in bursts, cached prefixes (repeats) and fresh ones, sampled rows.
    for size in (1, 3, 1, 8, 5, 16, 2, 11):
        batch = prompts[:size]
        params = [SamplingParams(max_tokens=24 + 7 * i, ignore_eos=True,
                                 temperature=0.8 if i % 3 == 2 else 0.0, seed=i)
                  for i in range(size)]
        eng.generate(batch, params)
        prompts = prompts[size:] + prompts[:size]
    assert watch.count == 0, f"{watch.count} compiles while serving: {watch.kernels}"

