"""Helpers shared by test modules (a plain module: `conftest` names clash across folders)."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT / "benchmarks" / "data" / "mt_bench_questions.jsonl"  # MT-bench, Apache-2.0
# The schema's draft policy for GPU tests, which build on configs/default.yaml with
# device=cuda: that preset's plain steps and eager shape timing are for CPUs.
GPU_DRAFT = ["draft.adaptive_shapes=[[1,1]]", "draft.plain_steps=false", "draft.eager_shapes=false"]


def mt_bench_first_turns(n: int) -> list[str]:
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


async def streamed_completion_text(client, model: str, prompt: str, max_tokens: int) -> str:
    """A greedy completion streamed through the official client (AsyncOpenAI), its text
    joined from the chunks."""
    text = ""
    async for chunk in await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True):
        text += "".join(c.text for c in chunk.choices)
    return text


@contextmanager
def q4_kernel_on(name: str):
    """The Q4_1 kernel on `name` ("avx2", or "auto": VNNI where the CPU has it) inside
    the block, on auto again after it (the choice holds for the whole process)."""
    from kestrel_kernels.cpu_q4 import set_isa
    set_isa(name)
    try:
        yield
    finally:
        set_isa("auto")


def assert_same_or_near_tie(hf_model, prompt, ours, theirs, tol=1e-4):
    """Equal token for token, or the first divergence is at a near-tie of the reference
    (top-2 logit gap below tol), where fp32 rounding may pick either."""
    if ours == theirs:
        return
    n = min(len(ours), len(theirs))
    d = next((i for i in range(n) if ours[i] != theirs[i]), n)
    assert d < n, f"same tokens but different lengths ({len(ours)} vs {len(theirs)})"
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ours[:d]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < tol, f"diverged at output {d} where the top-2 logit gap is {gap:.2e} (not a tie)"


def assert_greedy_under_reference(hf_model, prompt, ours, tol=1e-4):
    """Every token of `ours` is the reference's greedy choice given the same prefix (its
    top logit there), or within tol of it (a near-tie, where fp32 rounding may pick
    either). One teacher-forced forward over prompt + ours checks every position at once,
    where comparing with the reference's own greedy generation costs a decode step per
    token and stops checking at the first tie."""
    assert ours, "no output tokens to check"
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:]
    assert logits.shape[0] == len(ours)
    gaps = logits.max(-1).values - logits.gather(1, torch.tensor(ours)[:, None])[:, 0]
    bad = (gaps >= tol).nonzero().flatten().tolist()
    assert not bad, (f"output {bad[0]} (token {ours[bad[0]]}) is {float(gaps[bad[0]]):.2e} below the "
                     f"reference's top logit (not a tie); {len(bad)} such positions")


def random_tree_mask(n: int, rng) -> torch.Tensor:
    """[n, n] bool: node i sees its ancestors and itself (parent[i] < i, node 0 the root)."""
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        m[i] |= m[rng.randrange(i)]
    return m


def random_draft_mask(K: int, step: int, rng) -> torch.Tensor:
    """[K, (step+1)*K] bool, as EagleWorker._draft builds it: ancestor bits over earlier
    levels' scratch columns (one lane per level), then the lane itself."""
    anc = torch.zeros(K, step * K, dtype=torch.bool)
    for lane in range(K):
        for lvl in range(step):
            anc[lane, lvl * K + rng.randrange(K)] = True
    return torch.cat([anc, torch.eye(K, dtype=torch.bool)], dim=1)


def require_compiled_triton(module, kernel_name: str) -> None:
    """Skip a GPU test unless `module`'s Triton kernel is compiled for the GPU (triton is
    installed and its interpreter, which CPU test runs switch on, is off)."""
    import pytest
    if not module.HAS_TRITON:
        pytest.skip("triton is not installed")
    if type(getattr(module, kernel_name)).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET=1: the kernels are not compiled for the GPU")


class LocalEngine:
    """The Serve engine without Serve, on the calling event loop: a StepServer running
    `runner`'s steps on its thread (a RankWorker, as a RankActor does, or a plain execute), an EngineCore driving it over the step
    channel, an EngineClient talking to the core over the front channel (real sockets)."""

    def __init__(self, client, core, server):
        self.client, self.core, self.server = client, core, server

    @classmethod
    async def start(cls, cfg, info: dict, runner, tokenizer, on_start=None) -> "LocalEngine":
        from actors.worker.step_channel import StepServer
        from serve_app.engine.engine_client import EngineClient
        from serve_app.engine.engine_core import EngineCore
        from serve_app.engine.rank_channel import RankChannel
        from serve_app.text.tokenizer import stop_token_ids
        server = StepServer(runner, on_start=on_start)
        channel = await RankChannel.connect(*server.address, server.token, 0)
        eos = sorted(stop_token_ids(tokenizer, info["eos_token_ids"]))
        core = EngineCore(cfg, [info], [channel], eos)
        host, port = await core.listen("127.0.0.1")
        client = await EngineClient.connect(cfg, 1, host, port, core.token, tokenizer)
        return cls(client, core, server)

    async def stop(self) -> None:
        self.client.stop()
        self.core.stop()
        # The steps already queued still run: wait until the server has read the closed
        # channel, since a process that exits while a thread is inside a torch op aborts
        # ("terminate called without an active exception").
        deadline = time.monotonic() + 60
        while self.server.serving and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not self.server.serving, "the step server still serves a closed channel"
        self.server.close()
        assert not self.server.thread.is_alive(), "the step server's thread outlived close()"


def alternately_long(rows, variants) -> list:
    """pytest params: every row with every variant (tuples, concatenated), those where the
    row's and the variant's positions add up odd marked `long`: in make test each row runs
    half its variants and each variant half the rows, the rest in make test-long."""
    return [pytest.param(*row, *v, marks=pytest.mark.long) if (i + j) % 2 else (*row, *v)
            for i, row in enumerate(rows) for j, v in enumerate(variants)]
