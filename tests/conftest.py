"""Shared fixtures: the default model loaded once per test session (fp32 for exactness)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = ROOT.parent / "shared" / "data" / "mt_bench_questions.jsonl"


def mt_bench_first_turns(n: int) -> list[str]:
    rows = [json.loads(line) for line in SHARED_DATA.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from actors.models.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(smollm_path):
    from serve_app.tokenizer import load_tokenizer
    return load_tokenizer(smollm_path)


@pytest.fixture(scope="session")
def fp32_worker():
    """One fp32 RankWorker shared by engine tests: schedulers are cheap, weights are not."""
    from actors.rank_worker import RankWorker
    from configs.schema import load_config
    cfg = load_config(overrides=["model.dtype=float32", "kv_cache.num_slots=8192",
                                 "scheduler.max_running_requests=16", "device=cpu"])
    return RankWorker(cfg)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    from serve_app.tokenizer import apply_chat_template
    return [apply_chat_template(tokenizer, [{"role": "user", "content": q}])
            for q in mt_bench_first_turns(8)]
