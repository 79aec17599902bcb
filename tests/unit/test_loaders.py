"""Weight loaders (HF folder sharded/unsharded/tied, GGUF helpers), rope scaling, tokenizer cache."""

import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from actors.models.gguf_loader import hf_name, permute_rows, unpermute_rows  # noqa: E402
from actors.models.llama import LlamaForCausalLM  # noqa: E402
from actors.models.loader import build_model, default_model_path, load_model_weights  # noqa: E402
from actors.models.model_config import LlamaArch  # noqa: E402
from actors.models.rope import rope_inv_freq  # noqa: E402
from serve_app.text.tokenizer import apply_chat_template, gguf_cache_dir, load_tokenizer, stop_token_ids  # noqa: E402

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}


def causal_attn(q, k, v, layer_id):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
    )
    return o[0].transpose(0, 1)


def tiny_hf_model(kind: str, tied: bool):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=tied)
        model = transformers.Qwen2ForCausalLM(cfg)
    # Random init leaves norms at 1 and biases at 0; perturb so they are actually tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize(
    "kind,shard,tied",
    [("llama", False, False), ("llama", True, False), ("llama", False, True),
     ("qwen2", False, False), ("qwen2", True, True)],
)
def test_hf_folder_matches_transformers(tmp_path, kind, shard, tied):
    ref_model = tiny_hf_model(kind, tied)
    ref_model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shard

    model, arch = build_model(str(tmp_path), torch.float32, "cpu")
    assert arch.architecture == kind and arch.tie_word_embeddings == tied
    assert arch.attention_bias == (kind == "qwen2")
    assert (arch.rope_scaling or {}).get("rope_type") == ("llama3" if kind == "llama" else None)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight

    torch.manual_seed(1)
    ids = torch.randint(0, 256, (24,))
    # Positions past original_max_position_embeddings exercise every llama3 frequency band.
    pos = torch.arange(100, 124)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, causal_attn)[0])
        ref = ref_model(ids[None], position_ids=pos[None]).logits[0].float()
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-5, rel


def test_inv_freq_matches_transformers():
    for scaling in (None, LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0}):
        cfg = transformers.LlamaConfig(**TINY, rope_scaling=scaling)
        hf = transformers.LlamaForCausalLM(cfg).model.rotary_emb.inv_freq
        arch = LlamaArch.from_hf_config(cfg.to_dict())
        assert torch.allclose(rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling), hf, rtol=1e-6, atol=0)


def test_llama_cpp_freq_factors_equal_llama3():
    # llama.cpp stores llama3 scaling as per-frequency divisors (rope_freqs.weight); both routes agree.
    dim, theta, s = 64, 500000.0, dict(LLAMA3_ROPE, original_max_position_embeddings=8192)
    base = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    lo_wl, hi_wl = 8192 / s["low_freq_factor"], 8192 / s["high_freq_factor"]
    factors = []
    for f in base.tolist():
        wl = 2 * math.pi / f
        if wl < hi_wl:
            factors.append(1.0)
        elif wl > lo_wl:
            factors.append(s["factor"])
        else:
            sm = (8192 / wl - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - sm) / s["factor"] + sm))
    a = rope_inv_freq(dim, theta, s)
    b = rope_inv_freq(dim, theta, {"rope_type": "freq_factors", "factors": factors})
    assert torch.allclose(a, b, rtol=1e-6) and not torch.allclose(a, base)


def test_from_hf_config_old_and_new_rope_keys():
    base = dict(TINY, model_type="llama", eos_token_id=[7, 9], bos_token_id=1)
    old = LlamaArch.from_hf_config(dict(base, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    new = LlamaArch.from_hf_config(
        dict(base, rope_parameters={"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0})
    )
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.eos_token_ids == [7, 9] and old.head_dim == 16 and not old.tie_word_embeddings
    plain = LlamaArch.from_hf_config(dict(base, rope_parameters={"rope_theta": 1e4, "rope_type": "default"}))
    assert plain.rope_scaling is None
    with pytest.raises(ValueError, match="yarn"):
        LlamaArch.from_hf_config(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="model_type"):
        LlamaArch.from_hf_config(dict(base, model_type="gemma"))


def test_load_weights_is_strict(tmp_path):
    tiny_hf_model("llama", False).save_pretrained(tmp_path)
    arch, state = load_model_weights(str(tmp_path))
    model = LlamaForCausalLM(arch)
    with pytest.raises(KeyError, match="missing.*lm_head.weight"):
        model.load_weights({k: v for k, v in state.items() if k != "lm_head.weight"})
    with pytest.raises(KeyError, match="unknown.*model.extra"):
        model.load_weights(dict(state, **{"model.extra.weight": torch.zeros(1)}))
    bad = dict(state)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(bad)


def test_model_cast_keeps_tie_and_rope_precision(tmp_path):
    tiny_hf_model("llama", True).save_pretrained(tmp_path)
    model, arch = build_model(str(tmp_path), torch.bfloat16, "cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.rotary.inv_freq.dtype == torch.float32  # angles stay exact in bf16 models
    model.float()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden, aux = model(torch.tensor([3, 4, 5]), torch.arange(3), causal_attn, aux_layers=(0, 1))
    assert hidden.shape == (3, 64) and [a.shape for a in aux] == [(3, 64), (3, 64)]


def test_gguf_qk_unpermute_inverts_llama_cpp():
    torch.manual_seed(0)
    for n_head, rows in ((9, 576), (3, 192)):
        w = torch.randn(rows, 40)
        gguf_w = permute_rows(w, n_head)
        assert not torch.equal(gguf_w, w)
        assert torch.equal(unpermute_rows(gguf_w, n_head), w)
        b = torch.randn(rows)
        assert torch.equal(unpermute_rows(permute_rows(b, n_head), n_head), b)
    # Per head, GGUF interleaves the two rotate_half halves: rows (0, D/2, 1, D/2+1, ...).
    w = torch.arange(8.0)[:, None]  # one head, D = 8
    assert permute_rows(w, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def _llama_cpp_rope_factors(head_dim, theta, s):
    # llama.cpp's converter turns llama3 rope_scaling into per-frequency divisors.
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    old = s["original_max_position_embeddings"]
    lo, hi = s["low_freq_factor"], s["high_freq_factor"]
    factors = []
    for f in base.tolist():
        wl = 2 * math.pi / f
        if wl < old / hi:
            factors.append(1.0)
        elif wl > old / lo:
            factors.append(s["factor"])
        else:
            sm = (old / wl - lo) / (hi - lo)
            factors.append(1 / ((1 - sm) / s["factor"] + sm))
    return factors


def write_tiny_gguf(path, ref_model, quantized=()):
    """Write an HF Llama as llama.cpp's converter would: renamed, Q/K permuted, rope_freqs."""
    import gguf

    cfg = ref_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    factors = _llama_cpp_rope_factors(cfg.head_dim, cfg.rope_parameters["rope_theta"], LLAMA3_ROPE)
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    sub = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
           "post_attention_layernorm": "ffn_norm"}
    for name, t in ref_model.state_dict().items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, i, mod = name.split(".", 3)
            mod, kind = mod.rsplit(".", 1)
            g = f"blk.{i}.{sub[mod]}.{kind}"
        if ".q_proj." in name:
            t = permute_rows(t, cfg.num_attention_heads)
        elif ".k_proj." in name:
            t = permute_rows(t, cfg.num_key_value_heads)
        arr = t.numpy()
        if g in quantized:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_matches_transformers(tmp_path):
    ref_model = tiny_hf_model("llama", False)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, ref_model, quantized=("blk.1.ffn_up.weight",))
    model, arch = build_model(str(path), torch.float32, "cpu")
    assert arch.rope_scaling["rope_type"] == "freq_factors" and not arch.tie_word_embeddings
    assert arch.eos_token_ids == [2, 3] and arch.bos_token_id == 1 and arch.vocab_size == 256
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)

    # The Q8_0 tensor dequantizes to the original within its 8-bit step; use it on both sides.
    up = model.checkpoint_state()["model.layers.1.mlp.up_proj.weight"]
    ref_up = ref_model.model.layers[1].mlp.up_proj.weight
    assert torch.allclose(up, ref_up, atol=ref_up.abs().max().item() / 100)
    with torch.no_grad():
        ref_up.copy_(up)

    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(100, 124)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, causal_attn)[0])
        ref = ref_model(ids[None], position_ids=pos[None]).logits[0].float()
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-5, rel


def test_gguf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    with pytest.raises(KeyError):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_default_model_path(monkeypatch):
    monkeypatch.delenv("KESTREL_DEFAULT_GGUF", raising=False)
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    monkeypatch.setenv("KESTREL_DEFAULT_GGUF", "/somewhere/else.gguf")
    assert default_model_path() == "/somewhere/else.gguf"


def test_gguf_tokenizer_chat_template_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default_model_path()
    cache = gguf_cache_dir(path)
    assert cache.startswith(str(tmp_path)) and not os.path.exists(cache)

    t0 = time.perf_counter()
    cold = load_tokenizer(path)  # transformers' own GGUF conversion
    t_cold = time.perf_counter() - t0
    assert os.path.isfile(os.path.join(cache, "tokenizer.json"))
    t0 = time.perf_counter()
    warm = load_tokenizer(path)  # from the saved folder
    t_warm = time.perf_counter() - t0
    assert t_warm < t_cold

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = cold.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    got = apply_chat_template(warm, messages)
    assert got == list(want) and all(type(t) is int for t in got)
    assert apply_chat_template(cold, messages) == got
    text = warm.decode(got)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")

    arch = LlamaArch.from_hf_config(dict(TINY, model_type="llama", eos_token_id=[2, 5]))
    assert stop_token_ids(warm, arch) == {2, 5} and warm.eos_token_id == 2

    # An HF folder's tokenizer loads as it is.
    folder = tmp_path / "hf_model"
    warm.save_pretrained(folder)
    assert apply_chat_template(load_tokenizer(str(folder)), messages) == got


@pytest.mark.parametrize("path", ["smollm2", "models/qwen2.5-7b"])
def test_chat_template_ids_equal_transformers_tokenizing(path):
    """apply_chat_template renders and then encodes with the Rust tokenizer itself; the ids
    equal transformers' own tokenize=True for every kind of conversation."""
    tok = load_tokenizer(default_model_path() if path == "smollm2" else str(Path(__file__).resolve().parents[2] / path))
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo wörld ✓ 東京 🙂"},
         {"role": "assistant", "content": "Hi!\n\n  spaced   out\t"}, {"role": "user", "content": "def f(x):\n    return x"}],
        [{"role": "user", "content": "text with <|im_end|> and <|endoftext|> inside"}],
        [{"role": "user", "content": ""}],
    ]
    for messages in convs:
        for gen, cont in ((True, False), (False, False), (False, True)):
            want = tok.apply_chat_template(messages, add_generation_prompt=gen, continue_final_message=cont,
                                           tokenize=True, return_dict=False)
            got = apply_chat_template(tok, messages, add_generation_prompt=gen, continue_final_message=cont)
            assert got == list(want) and all(type(t) is int for t in got), (messages, gen, cont)


def test_hf_load_holds_one_tensor_at_a_time(tmp_path):
    """Host memory while loading, in a fresh process (benchmarks/load_bench.py): on the CPU
    the model itself plus about one tensor, never the checkpoint a second time (a shard
    read whole, a memory map left resident, a state dict built before copying)."""
    import json
    import subprocess
    import sys

    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = dict(TINY, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
               model_type="llama", tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        shapes = LlamaForCausalLM(LlamaArch.from_hf_config(cfg)).checkpoint_state()
    state = {k: torch.randn(v.shape) for k, v in shapes.items()}
    save_file(state, tmp_path / "model.safetensors")
    total = sum(t.numel() * 4 for t in state.values())
    largest = max(t.numel() * 4 for t in state.values())
    assert total > 8 * largest  # the bound below would not tell the two apart otherwise
    out = subprocess.run([sys.executable, "-m", "benchmarks.load_bench", "--load-only", "--dir", str(tmp_path),
                          "--dtype", "float32", "--device", "cpu", "--no-verify"],
                         capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["gb"] * 1e9 == total
    beyond = r["peak_host_gb_beyond_model"] * 1e9
    assert beyond < 3 * largest, (beyond, total, largest)


def test_gguf_per_tensor_dequant_equals_whole_file_dequant():
    """GGUFCheckpoint reads each tensor's bytes into fresh memory and dequantizes it alone;
    the same values as dequantizing from the reader's memory map (SmolLM2, Q4_1 and F32)."""
    import gguf

    from actors.models import gguf_loader

    path = default_model_path()
    arch = gguf_loader.read_gguf(path)[0]
    tensors = {t.name: t for t in gguf.GGUFReader(path, "r").tensors}
    ck = gguf_loader.GGUFCheckpoint(path, tensors, arch, permuted=True)
    names = ["token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
             "blk.0.attn_v.weight", "blk.29.ffn_down.weight", "blk.29.ffn_norm.weight"]
    kinds = set()
    for name in names:
        t = tensors[name]
        kinds.add(t.tensor_type.name)
        whole = gguf_loader._dequantize(t)  # from the memory map
        key = hf_name(name)
        if ".q_proj." in key:
            whole = unpermute_rows(whole, arch.num_heads)
        elif ".k_proj." in key:
            whole = unpermute_rows(whole, arch.num_kv_heads)
        got = ck[key]
        assert got.dtype == torch.float32 and torch.equal(got, whole), name
    assert {"Q4_1", "F32"} <= kinds, kinds


def test_gguf_header_equals_gguf_readers(tmp_path):
    """read_gguf_header gives SmolLM2's GGUF (a 49k-token vocabulary and merges; Q4_1, Q8_0
    and F32 tensors) the fields and tensor views gguf-py's GGUFReader does; cut after its
    header, the fields still read; a file that is not a GGUF is refused, saying so."""
    import gguf

    from actors.models.gguf_header import read_gguf_header

    path = default_model_path()
    ours, theirs = read_gguf_header(path), gguf.GGUFReader(path, "r")

    def plain(v):
        return v.tolist() if isinstance(v, np.ndarray) else v

    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert {k: plain(v) for k, v in ours.fields.items()} == want
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    kinds = set()
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        kinds.add(a.tensor_type.name)
        assert (a.name, a.tensor_type, a.shape, a.data_offset) == \
            (b.name, b.tensor_type, tuple(b.shape.tolist()), b.data_offset)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, np.asarray(b.data))
    assert {"Q4_1", "Q8_0", "F32"} <= kinds, kinds

    cut = tmp_path / "header.gguf"
    cut.write_bytes(Path(path).read_bytes()[:ours.tensors[0].data_offset])
    assert {k: plain(v) for k, v in read_gguf_header(str(cut), tensors=False).fields.items()} == want
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(str(bad))
