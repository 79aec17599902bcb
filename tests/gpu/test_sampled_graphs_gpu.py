"""Seeded sampling on the CUDA graph paths (attention.feature_graphs; the h200 preset's
engine in fp32): the sampled decode graphs (plain) and the step graph's sampled variants
(tree) replay, with their coins from a static buffer and each row's sampling parameters
from the processing table, and give the tokens of the eager paths they replace (the plain
graph then eager sampling; the per-phase runners then the eager accept), with the same
seeds: greedy and sampled rows in one batch, penalties and logprobs on, padded lanes."""
import torch

from test_feature_graphs_gpu import same_or_all_but_one, spy_step_graph
from test_prefill_graph_gpu import engine

from actors.spec.step_graph import Variant
from serve_app.engine.request import SamplingParams

MAX = 64
FP32 = "model.dtype=float32"
ON = "attention.feature_graphs=true"  # explicit: what this file tests, whatever the preset says
OFF = "attention.feature_graphs=false"


def mixed(n: int) -> list[SamplingParams]:
    """Per prompt: greedy, top-p sampling as users ask for it, and penalized sampling with
    logprobs; every sampled request with its own seed."""
    kinds = [dict(),
             dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.0, top_k=50, presence_penalty=0.5, repetition_penalty=1.1, logprobs=3)]
    return [SamplingParams(max_tokens=MAX, ignore_eos=True, seed=i, **kinds[i % 3]) for i in range(n)]


def temperature_only(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX, ignore_eos=True, temperature=0.8, seed=100 + i) for i in range(n)]


def spy_sampled_decode(eng) -> list:
    """Log the (processed, filtered) set of each sampled decode graph replay."""
    w, seen = eng.workers[0], []
    for key, runner in w.sampled_decode_graphs.items():
        assert runner.use_cuda_graph
        replay = runner.replay
        runner.replay = lambda b, _key=key, _replay=replay, **kw: seen.append(_key) or _replay(b, **kw)
    return seen


def test_sampled_decode_graphs_equal_eager_sampling(tokenizer, chat_prompts):
    prompts = chat_prompts[:5]  # 5 lanes padded to 8
    eager = engine(tokenizer, FP32, OFF, "draft.enabled=false")
    graphs = engine(tokenizer, FP32, ON, "draft.enabled=false")
    w = graphs.workers[0]
    # The plain and unprocessed sampled sets write their logits into the one buffer at
    # every size (the temperature-only run below reads them from it).
    for runner in (w.decode_graphs, w.sampled_decode_graphs[False, False], w.sampled_decode_graphs[False, True]):
        outs = [g.output if isinstance(g.output, torch.Tensor) else g.output[0] for g in runner._graphs.values()]
        assert {o.data_ptr() for o in outs} == {w.decode_logits.data_ptr()}
    seen = spy_sampled_decode(graphs)
    for params, key in ((mixed(len(prompts)), (True, True)), (temperature_only(len(prompts)), (False, False))):
        want = eager.generate(prompts, params)
        got = graphs.generate(prompts, params)
        assert key in seen
        same_or_all_but_one([r.output_ids for r in got], [r.output_ids for r in want], f"sampled decode graph {key}")


def test_sampled_step_graphs_equal_the_per_phase_path(tokenizer, chat_prompts):
    prompts = chat_prompts[:5]
    eager = engine(tokenizer, FP32, OFF)
    graphs = engine(tokenizer, FP32, ON)
    seen = spy_step_graph(graphs)
    for params, variant in ((mixed(len(prompts)), Variant(True, True, True, True)),
                            (temperature_only(len(prompts)), Variant(False, False, True, False))):
        want = eager.generate(prompts, params)
        got = graphs.generate(prompts, params)
        assert ("whole", variant) in seen
        same_or_all_but_one([r.output_ids for r in got], [r.output_ids for r in want], f"sampled step graph {variant}")
        assert sum(a for r in got for a in r.accept_lengths) > sum(len(r.accept_lengths) for r in got)  # drafts accepted
