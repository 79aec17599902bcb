"""The Serve engine's step path on the GPU: a RankWorker with CUDA graphs, the plan stream
and the step graph runs its steps on the step channel's own thread (as in a RankActor),
driven by an EngineCore over a real socket with two steps in flight, each launched on the
GPU behind the one running (RankWorker.launch), and must give exactly what the same
worker gives in-process, one step at a time (same batches, same graphs; greedy, and mixed
with seeded sampling and logprobs, whose paths copy to the host inside a step). With
grammar rows (structured outputs) beside free ones, the grammar plans are launched behind
the running step too, their masks made from its tokens once they are back
(actors/sampling/grammar_rows.py), and the JSON answers parse."""
import asyncio
import json

import pytest
import torch

from kestrel_testing import GPU_DRAFT, LocalEngine

H200 = ["device=cuda", "model.dtype=bfloat16", "kv_cache.num_slots=65536", "kv_cache.page_size=16",
        "scheduler.max_running_requests=16", "attention.backend=triton", "attention.cuda_graphs=true",
        "attention.plan_stream=true", "attention.cuda_graph_batch_sizes=[1,2,4,8,16]", *GPU_DRAFT]
TREE = ["draft.enabled=true", "draft.topk=4", "draft.num_steps=5", "draft.num_draft_tokens=8"]


def _params(mixed: bool, i: int) -> dict:
    kinds = [{}, dict(temperature=0.8, seed=100 + i), dict(logprobs=3)] if mixed else [{}]
    return dict(max_tokens=48, ignore_eos=True, **kinds[i % len(kinds)])


def one_at_a_time(cfg):
    """`cfg` for the reference engine: the in-process engine without launching ahead."""
    return cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"launch_ahead": False})})


# Plain decode replays one graph whatever the sampling; a tree batch takes the one-graph
# iteration when greedy and the per-phase path when mixed.

def through_channel(cfg, worker, tokenizer, prompts, params):
    """Serve `prompts` through the step channel's thread on `worker` -> (each request's
    token ids, the engine's stats)."""
    async def run():
        index = torch.cuda.current_device()  # the channel thread uses the worker's device
        eng = await LocalEngine.start(cfg, worker.info(), worker, tokenizer,
                                      on_start=lambda: torch.cuda.set_device(index))
        streams = [eng.client.add_request(p, params[i], f"r{i}") for i, p in enumerate(prompts)]

        async def ids(stream):
            return [t async for out in stream for t in out.new_token_ids]
        got = await asyncio.gather(*(ids(s) for s in streams))
        stats = await eng.client.stats()
        await eng.stop()
        return got, stats

    return asyncio.run(run())


@pytest.mark.parametrize("spec,mixed", [([], True), (TREE, False), (TREE, True)],
                         ids=["plain-mixed", "tree-greedy", "tree-mixed"])
def test_channel_thread_replays_graphs_as_in_process(tokenizer, chat_prompts, spec, mixed):
    from actors.worker.rank_worker import RankWorker
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams

    cfg = load_config(overrides=H200 + (spec or ["draft.enabled=false"]))
    worker = RankWorker(cfg)
    prompts = chat_prompts[:8]
    ref = LLMEngine(one_at_a_time(cfg), tokenizer=tokenizer, workers=[worker])
    params = [_params(mixed, i) for i in range(len(prompts))]
    want = [r.output_ids for r in ref.generate(prompts, [SamplingParams(**p) for p in params])]

    got, stats = through_channel(cfg, worker, tokenizer, prompts, params)
    assert got == want
    steps = stats["steps"]
    per = lambda phase: 1000 * stats["step_seconds"][phase] / max(1, steps["pipelined"])
    print(f"{'tree' if spec else 'plain'}{' mixed' if mixed else ''}: {steps}, worker idle "
          f"{per('wait'):.3f} ms, GPU idle {per('gpu_idle'):.3f} ms per pipelined step")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}
ASK = ["Describe a pet as JSON with its name and age n.", "Reply in JSON: a short name and a number n.",
       "Give me a user record as JSON.", "Name a fruit and how many you want, in JSON.",
       "Pick a city and its population n as JSON.", "Say hello.", "What is 2+3? Answer as JSON.",
       "Name a colour."]


def _grammar_params(grammar: str, i: int) -> dict:
    """JSON rows greedy and sampled, ending by the grammar or cut by length, beside free rows."""
    kinds = [dict(grammar=grammar), dict(), dict(grammar=grammar, temperature=0.8, seed=100 + i),
             dict(grammar=grammar, max_tokens=9), dict(temperature=0.8, seed=100 + i)]
    return {"max_tokens": 48, **kinds[i % len(kinds)]}


# Plain decode masks after its graph; a tree batch with a grammar replays the step graph in
# its three parts when greedy, and takes the per-phase path when mixed.
@pytest.mark.parametrize("spec,mixed", [([], True), (TREE, False), (TREE, True)],
                         ids=["plain-mixed", "tree-greedy", "tree-mixed"])
def test_grammar_plans_launch_ahead_as_in_process(tokenizer, spec, mixed):
    from actors.sampling.grammar_rows import GrammarRows
    from actors.worker.rank_worker import RankWorker
    from configs.schema import load_config
    from serve_app.text.grammar import GrammarCompiler
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template

    cfg = load_config(overrides=H200 + (spec or ["draft.enabled=false"]))
    worker = RankWorker(cfg)
    grammar = GrammarCompiler(tokenizer).compile(("json_schema", json.dumps(SCHEMA)))
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in ASK]
    params = [_grammar_params(grammar, i) for i in range(len(prompts))]
    if not mixed:
        params = [{**p, "temperature": 0.0} for p in params]
    ref = LLMEngine(one_at_a_time(cfg), tokenizer=tokenizer, workers=[worker])
    want = ref.generate(prompts, [SamplingParams(**p) for p in params])
    ended = [r for r in want if r.params.grammar is not None and r.finish_reason == "stop"]
    assert ended
    for r in ended:
        value = json.loads(tokenizer.decode(r.output_ids[:-1]))
        assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    worker.grammars = GrammarRows(cfg.processing.grammar_threads)  # none left from the reference
    calls = []  # ("launch", step id, grammar rows) / ("finish", step id), on the channel thread
    launch, finish = worker.launch, worker.finish

    def launch_recorded(plan):
        calls.append(("launch", plan.step_id, bool(plan.grammar_resets) or worker.grammars.any(plan.rows)))
        return launch(plan)

    def finish_recorded(step):
        calls.append(("finish", step.plan.step_id, None))
        return finish(step)

    worker.launch, worker.finish = launch_recorded, finish_recorded

    got, stats = through_channel(cfg, worker, tokenizer, prompts, params)
    assert got == [r.output_ids for r in want]
    at = {(kind, step): i for i, (kind, step, _) in enumerate(calls)}
    grammar_steps = [step for kind, step, g in calls if kind == "launch" and g]
    ahead = [s for s in grammar_steps if at["launch", s] < at.get(("finish", s - 1), -1)]
    assert ahead, calls  # some grammar plan went on the GPU before the step ahead of it ended
    steps = stats["steps"]
    per = lambda phase: 1000 * stats["step_seconds"][phase] / max(1, steps["pipelined"])
    print(f"{'tree' if spec else 'plain'}{' mixed' if mixed else ''} grammar: {len(ahead)}/"
          f"{len(grammar_steps)} grammar plans launched ahead, {steps}, GPU idle "
          f"{per('gpu_idle'):.3f} ms per pipelined step")
