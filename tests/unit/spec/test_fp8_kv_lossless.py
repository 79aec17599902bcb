"""The FP8 KV cache (kv_cache.dtype=fp8_e4m3) on real SmolLM2 weights in fp32: greedy
speculative output equals greedy plain output token for token, both over the FP8 cache
(speculation is lossless with respect to the FP8-KV target), in chain and tree shapes,
with the draft's KV in FP8 too and accepted tree nodes' KV moved as stored bytes."""
import pytest
import torch

from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from spec_helpers import CHAIN, TREE, greedy

FP8 = torch.float8_e4m3fn
BASE = ["model.dtype=float32", "kv_cache.num_slots=8192", "scheduler.max_running_requests=16",
        "device=cpu", "kv_cache.dtype=fp8_e4m3"]
MAX = 24
PROMPTS = 4


@pytest.fixture(scope="module")
def plain_fp8(tokenizer, chat_prompts) -> list[list[int]]:
    """Greedy plain output over the FP8 cache: the reference speculation must reproduce."""
    eng = LLMEngine(load_config(overrides=BASE + ["draft.enabled=false"]), tokenizer=tokenizer)
    assert eng.workers[0].kv_pool.k_all.dtype == FP8
    return [list(r.output_ids) for r in eng.generate(chat_prompts[:PROMPTS], greedy(MAX))]


def test_the_fp8_cache_keeps_the_model(plain_fp8, plain_chat_outputs):
    """E4M3 keeps 3 mantissa bits, so near-ties can turn (SmolLM2's K and V stay far inside
    the range at scale 1), but the model is the same: at least half the answers open with
    the fp32 cache's first 8 tokens."""
    shared = [next((i for i, (a, b) in enumerate(zip(p, ref)) if a != b), MAX)
              for p, ref in zip(plain_fp8, plain_chat_outputs)]
    assert sorted(shared)[PROMPTS // 2] >= 8, shared


@pytest.mark.parametrize("shape,page", [(CHAIN, 1), (TREE, 16)], ids=["chain", "tree"])
def test_fp8_kv_speculates_losslessly(tokenizer, chat_prompts, plain_fp8, shape, page, monkeypatch):
    cfg = load_config(overrides=BASE + ["draft.enabled=true", *shape, f"kv_cache.page_size={page}"])
    eng = LLMEngine(cfg, tokenizer=tokenizer)  # the shipped head: it drafts for real
    w = eng.workers[0]
    assert w.kv_pool.k_all.dtype == w.eagle.kv_pool.k_all.dtype == FP8
    moves = []
    real_move = w.kv_pool.move
    monkeypatch.setattr(w.kv_pool, "move", lambda s, d: (moves.append(len(s)), real_move(s, d)))
    reqs = eng.generate(chat_prompts[:PROMPTS], greedy(MAX))
    for r, ref in zip(reqs, plain_fp8):
        assert list(r.output_ids) == ref
    acc = [a for r in reqs for a in r.accept_lengths]
    assert sum(acc) / len(acc) > 1.2, f"mean accept length {sum(acc) / len(acc):.2f}"
    if shape is TREE:
        assert moves, "accepted off-position tree nodes: their KV must move"
