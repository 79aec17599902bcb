"""The Serve engine's step path on the GPU: a RankWorker with CUDA graphs, the plan stream
and the step graph runs its steps on the step channel's own thread (as in a RankActor),
driven by an EngineCore over a real socket with two steps in flight, each launched on the
GPU behind the one running (RankWorker.launch), and must give exactly what the same
worker gives in-process, one step at a time (same batches, same graphs; greedy, and mixed
with seeded sampling and logprobs, whose paths copy to the host inside a step)."""
import asyncio

import pytest

H200 = ["device=cuda", "model.dtype=bfloat16", "kv_cache.num_slots=65536", "kv_cache.page_size=16",
        "scheduler.max_running_requests=16", "attention.backend=triton", "attention.cuda_graphs=true",
        "attention.plan_stream=true", "attention.cuda_graph_batch_sizes=[1,2,4,8,16]"]
TREE = ["draft.enabled=true", "draft.topk=4", "draft.num_steps=5", "draft.num_draft_tokens=8"]


def _params(mixed: bool, i: int) -> dict:
    kinds = [{}, dict(temperature=0.8, seed=100 + i), dict(logprobs=3)] if mixed else [{}]
    return dict(max_tokens=48, ignore_eos=True, **kinds[i % len(kinds)])


# Plain decode replays one graph whatever the sampling; a tree batch takes the one-graph
# iteration when greedy and the per-phase path when mixed.
@pytest.mark.parametrize("spec,mixed", [([], True), (TREE, False), (TREE, True)],
                         ids=["plain-mixed", "tree-greedy", "tree-mixed"])
def test_channel_thread_replays_graphs_as_in_process(tokenizer, chat_prompts, spec, mixed):
    import torch

    from actors.rank_worker import RankWorker
    from configs.schema import load_config
    from kestrel_testing import LocalEngine
    from serve_app.llm_engine import LLMEngine
    from serve_app.request import SamplingParams

    cfg = load_config(overrides=H200 + (spec or ["draft.enabled=false"]))
    worker = RankWorker(cfg)
    prompts = chat_prompts[:8]
    ref = LLMEngine(cfg, tokenizer=tokenizer, workers=[worker])
    params = [_params(mixed, i) for i in range(len(prompts))]
    want = [r.output_ids for r in ref.generate(prompts, [SamplingParams(**p) for p in params])]

    async def run():
        index = torch.cuda.current_device()  # the channel thread uses the worker's device
        eng = await LocalEngine.start(cfg, worker.info(), worker, tokenizer,
                                      on_start=lambda: torch.cuda.set_device(index))
        streams = [eng.client.add_request(p, params[i], f"g{i}") for i, p in enumerate(prompts)]

        async def ids(stream):
            return [t async for out in stream for t in out.new_token_ids]
        got = await asyncio.gather(*(ids(s) for s in streams))
        stats = await eng.client.stats()
        await eng.stop()
        return got, stats

    got, stats = asyncio.run(run())
    assert got == want
    steps = stats["steps"]
    per = lambda phase: 1000 * stats["step_seconds"][phase] / max(1, steps["pipelined"])
    print(f"{'tree' if spec else 'plain'}{' mixed' if mixed else ''}: {steps}, worker idle "
          f"{per('wait'):.3f} ms, GPU idle {per('gpu_idle'):.3f} ms per pipelined step")
