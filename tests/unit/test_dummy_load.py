"""model.load_format=dummy: random weights of a config.json's shape, built on the device in
the requested dtype; the shipped model shapes and their tokenizer; a random draft for them."""

import json
import os
from pathlib import Path

import pytest
import torch

from actors.models.dummy_weights import DUMMY_RANGE
from actors.models.eagle import load_eagle_head, resolve_draft_path
from actors.models.llama import LlamaForCausalLM
from actors.models.loader import build_model
from actors.models.model_config import LlamaArch
from configs.schema import ModelConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {  # folder: (hidden, layers, heads, kv heads, intermediate, parameters in billions)
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 7.62),
    "qwen2.5-32b": (5120, 64, 40, 8, 27648, 32.76),
    "qwen2.5-72b": (8192, 80, 64, 8, 29568, 72.71),
}
TINY_QWEN2 = {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rope_theta": 1e6, "tie_word_embeddings": False,
              "eos_token_id": 2}


@pytest.fixture
def shape_dir(tmp_path):
    """A folder with a config.json and nothing else: no checkpoint to read."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN2))
    return str(tmp_path)


def test_dummy_builds_the_config_shape_in_the_dtype(shape_dir):
    model, arch = build_model(shape_dir, torch.bfloat16, "cpu", load_format="dummy", seed=3)
    assert (arch.hidden_size, arch.num_layers, arch.vocab_size) == (32, 2, 96) and arch.attention_bias
    params = dict(model.named_parameters())
    assert params["model.layers.1.self_attn.qkv_proj.weight"].shape == (32 + 2 * 16, 32)
    assert params["lm_head.weight"].shape == (96, 32)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            # Uniform in the range: spread over it, never outside it.
            assert p.abs().max() <= DUMMY_RANGE and p.float().std() > DUMMY_RANGE / 4, name
    hidden, _ = model(torch.tensor([5, 6, 7]), torch.arange(3), lambda q, k, v, i: q)
    assert torch.isfinite(model.compute_logits(hidden)).all()


def test_dummy_is_deterministic_in_the_seed(shape_dir):
    a, _ = build_model(shape_dir, torch.float32, "cpu", load_format="dummy", seed=1)
    b, _ = build_model(shape_dir, torch.float32, "cpu", load_format="dummy", seed=1)
    c, _ = build_model(shape_dir, torch.float32, "cpu", load_format="dummy", seed=2)
    sa, sb, sc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_auto_format_without_weights_points_at_dummy(shape_dir):
    with pytest.raises(FileNotFoundError, match="load_format=dummy"):
        build_model(shape_dir, torch.float32, "cpu")
    with pytest.raises(ValueError, match="load_format"):
        build_model(shape_dir, torch.float32, "cpu", load_format="pt")


def test_dummy_target_gets_a_random_draft_on_its_device(shape_dir):
    assert resolve_draft_path(None, shape_dir, "dummy") == "random"
    assert resolve_draft_path("some/head", shape_dir, "dummy") == "some/head"
    with pytest.raises(ValueError, match="draft.path"):
        resolve_draft_path(None, shape_dir, "auto")
    model, _ = build_model(shape_dir, torch.bfloat16, "cpu", load_format="dummy")
    for arch in ("eagle", "eagle3"):
        head = load_eagle_head("random", model, arch, torch.bfloat16, torch.device("cpu"), seed=0)
        assert all(p.dtype == torch.bfloat16 for p in head.parameters())
        assert all(torch.isfinite(p).all() for p in head.parameters())
        if arch == "eagle3":
            assert head.d2t.dtype == torch.int64 and not head.d2t.any()


def test_dummy_engine_speculates_losslessly(shape_dir):
    """A served dummy target with no draft.path: the draft is random, and greedy speculative
    output equals plain output (fp32)."""
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    base = [f"model.path={shape_dir}", "model.load_format=dummy", "model.dtype=float32", "device=cpu",
            "kv_cache.num_slots=1024", "model.max_model_len=128", "scheduler.max_running_requests=4"]
    prompts = [[5, 9, 11, 40, 3], [7, 7, 60, 21]]
    outs = []
    for spec in (["draft.enabled=false"], ["draft.enabled=true", "draft.topk=2", "draft.num_steps=2",
                                           "draft.num_draft_tokens=4"]):
        eng = LLMEngine(load_config(overrides=base + spec), load_tokenizer=False)
        outs.append([r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert outs[0] == outs[1] and all(len(o) == 12 for o in outs[0])


@pytest.mark.parametrize("folder", sorted(SHAPES))
def test_shipped_shapes(folder):
    path = ROOT / "models" / folder
    cfg = ModelConfig(path=str(path), load_format="dummy")
    assert cfg.load_format == "dummy"
    arch = LlamaArch.from_hf_config(json.loads((path / "config.json").read_text()))
    hidden, layers, heads, kv, inter, billions = SHAPES[folder]
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads,
            arch.intermediate_size, arch.vocab_size) == (hidden, layers, heads, kv, inter, 152064)
    assert (arch.head_dim, arch.rope_theta, arch.rms_norm_eps) == (128, 1e6, 1e-6)
    assert arch.attention_bias and not arch.tie_word_embeddings and arch.sliding_window is None
    with torch.device("meta"):  # counted, not allocated
        n = sum(p.numel() for p in LlamaForCausalLM(arch).parameters())
    assert abs(n / 1e9 - billions) < 0.01, n


def test_shipped_tokenizer_and_chat_template():
    from serve_app.text.tokenizer import apply_chat_template, load_tokenizer, stop_token_ids
    folders = [ROOT / "models" / f for f in sorted(SHAPES)]
    # One tokenizer for the three shapes.
    assert len({(f / "tokenizer.json").read_bytes() for f in folders}) == 1
    tok = load_tokenizer(str(folders[0]))
    ids = apply_chat_template(tok, [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is 2+2? 你好"}])
    assert ids[0] == 151646 and ids[-1] == 151645  # <｜begin▁of▁sentence｜> ... <｜Assistant｜>
    assert tok.decode(ids) == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2? 你好"
                               "<｜Assistant｜>")
    assert max(ids) < 152064
    text = "def f(x):\n    return x ** 2  # twelve: 12"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    arch = LlamaArch.from_hf_config(json.loads((folders[0] / "config.json").read_text()))
    assert stop_token_ids(tok, arch) == {151643}  # <｜end▁of▁sentence｜>


def test_shape_folder_has_no_weights():
    for folder in SHAPES:
        names = os.listdir(ROOT / "models" / folder)
        assert not any(n.endswith((".safetensors", ".bin", ".gguf")) for n in names)


def test_a_sliding_window_shorter_than_the_context_is_refused_before_loading(tmp_path):
    """Mistral-style local attention is not implemented: a context past the window would be
    served wrong, so the worker refuses it, naming both fields, before reading weights."""
    from actors.worker.rank_worker import RankWorker
    folder = tmp_path / "windowed"
    folder.mkdir()
    cfg = {**TINY_QWEN2, "model_type": "mistral", "sliding_window": 64}
    (folder / "config.json").write_text(json.dumps(cfg))
    over = [f"model.path={folder}", "model.load_format=dummy", "device=cpu", "draft.enabled=false",
            "kv_cache.num_slots=1024", "scheduler.max_running_requests=4"]
    with pytest.raises(ValueError, match=r"sliding_window=64 .*model.max_model_len=128"):
        RankWorker(load_config(overrides=over + ["model.max_model_len=128"]))
    RankWorker(load_config(overrides=over + ["model.max_model_len=64"]))  # within the window: served
