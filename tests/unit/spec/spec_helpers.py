"""Builders shared by the spec-contract tests: engines on the tiny target or on SmolLM2."""
from __future__ import annotations

import random

from actors.worker.rank_worker import RankWorker
from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams

# Each the one shape every decode step drafts: without adaptive shapes or plain steps a test
# of a shape's path does not have the timed per-step choice (DraftPolicy) swap it for the
# root or a plain step.
FIXED = ("draft.adaptive_shapes=[]", "draft.plain_steps=false", "draft.eager_shapes=false")
CHAIN = ("draft.topk=1", "draft.num_steps=3", "draft.num_draft_tokens=4", *FIXED)
TREE = ("draft.topk=4", "draft.num_steps=5", "draft.num_draft_tokens=8", *FIXED)


def tiny_config(model_dir: str, *overrides: str, spec: bool = True):
    base = [f"model.path={model_dir}", "model.dtype=float32", "device=cpu",
            "kv_cache.num_slots=4096", "model.max_model_len=512",
            "scheduler.max_running_requests=8"]
    base += ["draft.enabled=true", "draft.path=random", *FIXED] if spec else ["draft.enabled=false"]
    return load_config(overrides=base + list(overrides))


def tiny_engine(model_dir: str, *overrides: str, spec: bool = True) -> LLMEngine:
    cfg = tiny_config(model_dir, *overrides, spec=spec)
    return LLMEngine(cfg, load_tokenizer=False)


def random_prompts(n: int, vocab: int = 128, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def outputs(engine: LLMEngine, prompts, max_tokens: int) -> list[list[int]]:
    return [r.output_ids for r in engine.generate(prompts, greedy(max_tokens))]


__all__ = ["FIXED", "CHAIN", "TREE", "tiny_config", "tiny_engine", "random_prompts", "greedy",
           "outputs", "RankWorker"]


def fixed_draft(drafts: list[list[int]], parents: list[list[int]]):
    """A test draft's tree as EagleWorker.draft_body returns it: (draft_tokens, parent_node,
    node_rank) [B, N-1] int64 each, its nodes ranked in node order (parents come first, so
    every prefix holds its ancestors, as a draft's selection by score does)."""
    import torch
    tokens = torch.tensor(drafts, dtype=torch.int64)  # [B, N-1]
    rank = torch.arange(tokens.shape[1], dtype=torch.int64).expand_as(tokens).contiguous()  # [B, N-1]
    return tokens, torch.tensor(parents, dtype=torch.int64), rank
