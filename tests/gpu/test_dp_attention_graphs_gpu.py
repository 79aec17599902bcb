"""dp_attention with real CUDA graphs over NCCL: two ranks, a GPU each (tests/local_dp_engine.py,
one process per rank), capture their graphs with the sharded layers' NCCL collectives
inside once the group has formed, and replay them in lockstep, an idle rank with every
lane padded. The mixed run of tests/dp_scenario.py on the tiny target in fp32 gives one
rank's greedy tokens (the in-process engine on one GPU, graphs on), plain, chain (whole
iterations as one graph) and tree (one graph per phase); the steps both ranks recorded
show graph steps beside an idle rank and with a rank padded past its own size, each
replaying exactly the step's phases on every rank, and eager steps where a prefill runs.
Skipped without two GPUs (tests/unit/test_dp_attention.py checks the same on the CPU's
eager stand-in over gloo)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from kestrel_testing import GPU_DRAFT

import dp_rank_hooks
from dp_scenario import LENGTHS, SHAPES, check_graph_steps, greedy, mixed_run
from local_dp_engine import LocalDPEngine

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
              pytest.mark.timeout(1200)]

SIZES = [1, 2, 4]


def _cfg(model_dir: str, shape: str, *extra: str):
    from configs.schema import load_config
    base = [f"model.path={model_dir}", "model.dtype=float32", "device=cuda",
            "attention.backend=triton", "attention.cuda_graphs=true", "attention.plan_stream=true",
            f"attention.cuda_graph_batch_sizes={SIZES}", "kv_cache.num_slots=4096",
            "model.max_model_len=160", "scheduler.chunked_prefill_size=16",
            "scheduler.max_running_requests=8", *GPU_DRAFT]
    base += ["draft.enabled=true", "draft.path=random", *SHAPES[shape]] if shape != "plain" \
        else ["draft.enabled=false"]
    return load_config(overrides=base + list(extra))


@pytest.fixture(scope="module")
def one_gpu(tiny_llama_dir):
    """Every prompt's greedy tokens from one plain rank on GPU 0, graphs on."""
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    eng = LLMEngine(_cfg(tiny_llama_dir, "plain"), load_tokenizer=False)
    reqs = eng.generate([p for p, _ in LENGTHS], [SamplingParams(**greedy(n)) for _, n in LENGTHS])
    return {tuple(p): r.output_ids for (p, _), r in zip(LENGTHS, reqs)}


@pytest.mark.parametrize("shape", ["plain", "chain", "tree"])
def test_two_gpus_replay_graphs_with_nccl_inside(tiny_llama_dir, one_gpu, shape):
    per_phase = ("attention.spec_step_graph=false",) if shape == "tree" else ()
    cfg = _cfg(tiny_llama_dir, shape, "parallel.dp_size=2", "parallel.dp_attention=true",
               *per_phase)

    async def run():
        eng = await LocalDPEngine.start(cfg, hook=dp_rank_hooks.own_gpu, wait_s=600)
        try:
            got = await mixed_run(eng)
        finally:
            reports = await eng.stop()
        return got, reports

    got, reports = asyncio.run(run())
    for prompt, tokens in got:
        assert tokens == one_gpu[tuple(prompt)], prompt
    seen = check_graph_steps(reports, shape, SIZES, replays_per_step=3 if shape == "tree" else 1)
    assert {"graph beside an idle rank", "graph padded past a rank's own size",
            "eager prefill beside a decode"} <= seen, seen
