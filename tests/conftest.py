"""Shared fixtures: the default model loaded once per test session (fp32 for exactness)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit" / "spec"))  # spec_helpers
sys.path.insert(0, str(ROOT / "tests"))  # kestrel_testing

# Before any test module imports triton (actors import kernels.spec_ops): without CUDA the
# Triton kernels under test run in its interpreter, which is bound when they are decorated.
import triton_interpreter  # noqa: E402,F401
from kestrel_testing import mt_bench_first_turns  # noqa: E402


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
                                 "scheduler.max_running_requests=16", "device=cpu",
                                 "draft.enabled=false"])
    return RankWorker(cfg)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    from serve_app.tokenizer import apply_chat_template
    return [apply_chat_template(tokenizer, [{"role": "user", "content": q}])
            for q in mt_bench_first_turns(8)]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A small random Llama saved as an HF folder: fast stand-in target for spec tests.
    A wide init makes its logits peaked, so greedy ties (and fp32 flips) are rare."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, initializer_range=0.3, bos_token_id=1,
                      eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def hf_model(smollm_path):
    """transformers' own SmolLM2 from the same GGUF: the reference and the tie oracle."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path),
        dtype=torch.float32).eval()
