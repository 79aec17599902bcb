"""The FP8 target (model.quantization: fp8): which layers are FP8, quantization at load and
from a compressed-tensors FP8_DYNAMIC checkpoint (the same model either way), dummy FP8
weights, refused quantization_configs and settings, and greedy speculative output equal to
plain output with an FP8 target."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from actors.models.dummy_weights import DUMMY_RANGE
from actors.models.fp8_linear import FP8_LINEARS, Fp8Linear, check_fp8_device, is_fp8
from actors.models.llama import LlamaForCausalLM, projection_sizes
from actors.models.loader import build_model
from actors.models.model_config import LlamaArch
from configs.schema import ConfigError, load_config
import kestrel_kernels.fp8_linear as fp8_linear_module
from kestrel_kernels.fp8_linear import FP8, quantize_rows

TINY = {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rope_theta": 1e6, "tie_word_embeddings": False,
        "eos_token_id": 2}
FP8_DYNAMIC = {  # as llm-compressor writes it for the FP8_DYNAMIC scheme
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False, "group_size": None, "block_structure": None,
                    "observer": "minmax", "actorder": None},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True, "group_size": None, "observer": None}}},
}


def attn(q, k, v, layer):
    """Dense causal attention (GQA) over the one sequence of the batch."""
    import torch.nn.functional as F
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)


def logits(model, ids):
    with torch.no_grad():
        h, _ = model(torch.tensor(ids), torch.arange(len(ids)), attn)
        return model.compute_logits(h)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(bf16 checkpoint, the same quantized as compressed-tensors FP8_DYNAMIC), from random
    weights of a normal scale (q/k/v with Qwen2's bias)."""
    with torch.device("meta"):  # the names and shapes only
        names = LlamaForCausalLM(LlamaArch.from_hf_config(TINY)).checkpoint_state()
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in names.items():
        t = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.2
        state[name] = t.to(torch.bfloat16).contiguous()
    root = tmp_path_factory.mktemp("fp8")
    plain, quant = root / "bf16", root / "fp8"
    plain.mkdir(), quant.mkdir()
    (plain / "config.json").write_text(json.dumps(TINY))
    save_file(state, str(plain / "model.safetensors"))
    linears = tuple(p for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                    for p in [f"{proj}.weight"])
    stored = {}
    for name, t in state.items():
        if name.endswith(linears):
            q, s = quantize_rows(t)  # [out, in] fp8, [out, 1] fp32
            stored[name], stored[name + "_scale"] = q.contiguous(), s.contiguous()
        else:
            stored[name] = t
    (quant / "config.json").write_text(json.dumps(dict(TINY, quantization_config=FP8_DYNAMIC)))
    save_file(stored, str(quant / "model.safetensors"))
    return plain, quant


def test_fp8_layers_and_what_stays_in_the_model_dtype(folders):
    model, _ = build_model(str(folders[0]), torch.bfloat16, "cpu", quantization="fp8")
    assert is_fp8(model)
    for layer in model.model.layers:
        for path in FP8_LINEARS:
            lin = layer.get_submodule(path)
            assert isinstance(lin, Fp8Linear) and lin.weight.dtype == FP8
            assert lin.weight_scale.dtype == torch.float32 and lin.weight_scale.shape == (lin.out_features, 1)
    assert model.model.layers[0].self_attn.qkv_proj.bias.dtype == torch.bfloat16
    fp8_names = {n for n, p in model.named_parameters() if p.dtype in (FP8, torch.float32)}
    assert all(".self_attn." in n or ".mlp." in n for n in fp8_names)
    for p in (model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight):
        assert p.dtype == torch.bfloat16
    assert not is_fp8(build_model(str(folders[0]), torch.bfloat16, "cpu")[0])


def test_quantized_at_load_equals_the_fp8_checkpoint(folders):
    plain, quant = folders
    at_load, _ = build_model(str(plain), torch.float32, "cpu", quantization="fp8")
    stored, arch = build_model(str(quant), torch.float32, "cpu")  # quantization=none: FP8 wins
    assert arch.quantization == "fp8" and is_fp8(stored)
    a, b = dict(at_load.named_parameters()), dict(stored.named_parameters())
    assert all(torch.equal(a[name].float(), b[name].float()) for name in a)
    ids = [5, 17, 3, 88, 41, 9, 60]
    la, lb = logits(at_load, ids), logits(stored, ids)
    assert torch.equal(la, lb)
    # Rows of fused q/k/v and gate/up are quantized one by one: the scales of the
    # checkpoint's parts are the rows of the fused scale.
    sizes = projection_sizes(arch.q_size, arch.kv_size, arch.intermediate_size)["self_attn.qkv_proj"]
    assert [t.shape[0] for t in b["model.layers.0.self_attn.qkv_proj.weight_scale"].split(sizes)] == sizes
    # Also with model.quantization=fp8 said twice, and close to the unquantized model.
    again, _ = build_model(str(quant), torch.float32, "cpu", quantization="fp8")
    assert torch.equal(logits(again, ids), lb)
    full = logits(build_model(str(plain), torch.float32, "cpu")[0], ids)
    # (Random weights of this scale compound each of the 8 GEMMs' few-percent error.)
    assert (la - full).norm() <= 0.2 * full.norm()
    assert (la.argmax(-1) == full.argmax(-1)).float().mean() >= 0.7


def test_fp8_checkpoint_is_strict(folders, tmp_path):
    _, quant = folders
    from safetensors.torch import load_file
    state = load_file(str(quant / "model.safetensors"))
    arch = LlamaArch.from_hf_config(dict(TINY, quantization_config=FP8_DYNAMIC))
    model, _ = build_model(str(quant), torch.float32, "cpu")
    with pytest.raises(KeyError, match="missing.*q_proj.weight_scale"):
        model.load_weights({k: v for k, v in state.items() if k != "model.layers.1.self_attn.q_proj.weight_scale"})
    mixed = dict(state, **{"model.layers.0.mlp.down_proj.weight": state["model.layers.0.mlp.down_proj.weight"].float()})
    with pytest.raises(ValueError, match="down_proj.weight"):
        model.load_weights(mixed)
    unquantized, _ = build_model(str(folders[0]), torch.float32, "cpu")
    with pytest.raises(KeyError, match="unknown.*weight_scale"):
        unquantized.load_weights(state)
    assert arch.quantization == "fp8"


def test_dummy_fp8_weights(folders):
    model, _ = build_model(str(folders[0]), torch.bfloat16, "cpu", load_format="dummy", seed=4,
                           quantization="fp8")
    lin = model.model.layers[1].mlp.down_proj
    values = lin.weight.float() * lin.weight_scale  # [N, K] dequantized
    assert values.abs().max() <= DUMMY_RANGE and values.std() > DUMMY_RANGE / 4
    again, _ = build_model(str(folders[0]), torch.bfloat16, "cpu", load_format="dummy", seed=4,
                           quantization="fp8")
    assert torch.equal(again.model.layers[1].mlp.down_proj.weight.float(), lin.weight.float())
    assert torch.isfinite(logits(model, [1, 2, 3])).all()


@pytest.mark.parametrize("qcfg,named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method='gptq'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "quant_method='awq'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method='fp8'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    (dict(FP8_DYNAMIC, config_groups={"group_0": dict(
        FP8_DYNAMIC["config_groups"]["group_0"],
        weights=dict(FP8_DYNAMIC["config_groups"]["group_0"]["weights"], strategy="tensor"),
        input_activations=dict(FP8_DYNAMIC["config_groups"]["group_0"]["input_activations"],
                               strategy="tensor", dynamic=False))}), "strategy='tensor'"),
    (dict(FP8_DYNAMIC, config_groups={"group_0": dict(
        FP8_DYNAMIC["config_groups"]["group_0"], format="pack-quantized",
        weights=dict(FP8_DYNAMIC["config_groups"]["group_0"]["weights"], num_bits=4, type="int",
                     strategy="group", group_size=128), input_activations=None)}), "num_bits=4"),
    (dict(FP8_DYNAMIC, kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (dict(FP8_DYNAMIC, ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "only lm_head"),
])
def test_other_quantization_configs_are_refused(tmp_path, qcfg, named):
    with pytest.raises(ValueError, match="quantization_config") as e:
        LlamaArch.from_hf_config(dict(TINY, quantization_config=qcfg))
    assert named in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, quantization_config=qcfg)))
    with pytest.raises(ValueError, match="quantization_config"):
        build_model(str(tmp_path), torch.bfloat16, "cpu", load_format="dummy")


def test_settings_that_cannot_run_are_refused(monkeypatch, folders):
    assert load_config().model.quantization == "none"
    assert load_config(overrides=["model.quantization=fp8"]).model.quantization == "fp8"
    with pytest.raises(ConfigError, match="model.quantization"):
        load_config(overrides=["model.quantization=int4"])
    with pytest.raises(ConfigError, match="dp_attention"):
        load_config(overrides=["model.quantization=fp8", "parallel.dp_attention=true", "parallel.dp_size=2"])
    with pytest.raises(ValueError, match="model.quantization"):
        build_model(str(folders[0]), torch.bfloat16, "cpu", quantization="int8")
    # CUDA: bf16 only (row-wise scaled FP8 matmuls write bf16), and compute capability 8.9+.
    dims = {"hidden_size": 4096, "intermediate_size": 11008}
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ValueError, match="model.dtype bfloat16"):
            check_fp8_device(dtype, "cuda", dims)
    with pytest.raises(ValueError, match="multiples of 16.*'intermediate_size': 1000"):
        check_fp8_device(torch.bfloat16, "cuda", dict(dims, intermediate_size=1000))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        check_fp8_device(torch.bfloat16, "cuda", dims)
    # The CPU runs the fp32 reference in any dtype and shape.
    check_fp8_device(torch.float32, "cpu", dict(dims, intermediate_size=1000))


def test_dp_attention_refuses_an_fp8_target(folders):
    from actors.dp.sharded_layers import shard_model
    model, _ = build_model(str(folders[1]), torch.float32, "cpu")
    with pytest.raises(ValueError, match="dp_attention"):
        shard_model(model, dp=None)


def test_fp8_engine_speculates_losslessly(folders, monkeypatch):
    """Greedy speculative output equals plain output with an FP8 target (fp32 on the CPU,
    the draft head unquantized)."""
    import actors.worker.rank_worker as rank_worker
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    real = rank_worker.build_model
    monkeypatch.setattr(fp8_linear_module, "_tensorwise", True)  # the rank workers set it; restored after
    # The rank builds its target with model.quantization (pinned here for this engine).
    monkeypatch.setattr(rank_worker, "build_model",
                        lambda *a, **k: real(*a, **dict(k, quantization="fp8")))
    base = [f"model.path={folders[0]}", "model.quantization=fp8", "model.dtype=float32", "device=cpu",
            "kv_cache.num_slots=1024", "model.max_model_len=128", "scheduler.max_running_requests=4",
            "draft.path=random"]
    prompts = [[5, 9, 11, 40, 3], [7, 7, 60, 21], [1, 2, 3, 4, 5, 6, 7, 8]]
    outs = []
    for spec in (["draft.enabled=false"], ["draft.enabled=true", "draft.topk=2", "draft.num_steps=3",
                                           "draft.num_draft_tokens=4"]):
        eng = LLMEngine(load_config(overrides=base + spec), load_tokenizer=False)
        worker = eng.workers[0]
        assert is_fp8(worker.model)
        # With a draft every row takes the row-scaled GEMM on CUDA (a verify's rows summed
        # as a plain step's); without, narrow products take the tensor-scaled one.
        assert fp8_linear_module._tensorwise == (worker.eagle is None)
        if worker.eagle is not None:  # the draft head stays in the model dtype
            assert all(p.dtype == torch.float32 for p in worker.eagle.head.parameters())
        outs.append([r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))])
    assert outs[0] == outs[1] and all(len(o) == 16 for o in outs[0])
    assert len({tuple(o) for o in outs[0]}) > 1  # the outputs depend on the prompts


def test_the_fp8_kernel_is_refused_with_a_draft(folders, monkeypatch):
    """Rows at or below model.fp8_gemv_max_rows take the Triton kernel and a verify's more
    rows cuBLASLt: their sums differ in the last bit, enough to move FP8 activation codes,
    so with a draft the setting is refused at start-up, naming it (GPU run: 3 of 8 prompts
    left plain output, one where the top two logits were 0.25 apart)."""
    import actors.worker.rank_worker as rank_worker
    from serve_app.engine.llm_engine import LLMEngine
    real = rank_worker.build_model
    monkeypatch.setattr(rank_worker, "build_model",
                        lambda *a, **k: real(*a, **dict(k, quantization="fp8")))
    base = [f"model.path={folders[0]}", "model.quantization=fp8", "model.dtype=float32", "device=cpu",
            "kv_cache.num_slots=256", "model.max_model_len=64", "scheduler.max_running_requests=2",
            "draft.path=random", "model.fp8_gemv_max_rows=16"]
    with pytest.raises(ValueError, match="model.fp8_gemv_max_rows=16 with a draft"):
        LLMEngine(load_config(overrides=base + ["draft.enabled=true"]), load_tokenizer=False)
    eng = LLMEngine(load_config(overrides=base + ["draft.enabled=false"]), load_tokenizer=False)
    assert is_fp8(eng.workers[0].model)  # plain decoding keeps the kernel
