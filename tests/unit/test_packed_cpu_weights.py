"""The packed model (model.cpu_weights=packed) against its float path and the float model."""

import pytest
import torch
import torch.nn.functional as F

from actors.attention.torch_native import PagedInputs
from actors.models.eagle import load_eagle_head
from actors.models.loader import build_model, default_model_path
from actors.models.packed_cpu_weights import pack_draft_weights
from kestrel_kernels.cpu_attention import paged_attention
from kestrel_testing import q4_kernel_on


def _attn(q, k, v, layer):
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(0, 1)


@pytest.fixture(scope="module")
def packed_model():
    model, _ = build_model(default_model_path(), torch.float32, "cpu", cpu_weights="packed")
    return model


def test_packed_model_kernel_and_float_paths_agree(packed_model):
    """The kernels (decode steps) and the float GEMM (prefill, large batches) compute one
    model: the same greedy tokens but at near-ties, logits a few hundredths apart (the
    kernels' int8 activations), and within the refine margin of the top, close to the float
    rows' logits."""
    model = packed_model
    ids = torch.tensor([1, 9519, 314, 253, 5356, 1145, 30, 378, 2358, 282, 4649, 314])
    pos = torch.arange(ids.numel())
    out = {}
    with torch.inference_mode():
        for on in (True, False):
            model.kernel_switch.on = on
            out[on] = model.compute_logits(model(ids, pos, _attn)[0])
    model.kernel_switch.on = True
    # equal picks, or a near-tie (the int8 activations may order it either way)
    pick = out[True].argmax(-1)
    gap = out[False].amax(-1) - out[False].gather(1, pick[:, None])[:, 0]
    assert (gap < 0.1).all() and (pick == out[False].argmax(-1)).float().mean() > 0.8
    diff = (out[True] - out[False]).abs()
    assert diff.mean() < 0.3 and diff.max() < 1.5  # logits span about 30
    near = out[True] >= out[True].amax(-1, keepdim=True) - 1.0
    assert diff[near].max() < 0.5  # the layers' int8 activations only


def test_refined_head_picks_the_float_rows_top():
    """Near-ties the kernel's int8 activations would break their own way are decided on the
    float rows: the pick equals a float32 GEMM's over the same hidden states."""
    from actors.models.packed_cpu_weights import KernelSwitch, Q8LMHead
    from actors.models.llama import LMHead

    g = torch.Generator().manual_seed(5)
    head = LMHead(64, 3000, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(3000, 64, generator=g) * 0.3)
    packed = Q8LMHead(head, KernelSwitch())
    hidden = torch.randn(16, 64, generator=g)
    with torch.no_grad():
        exact = head(hidden)
        got = packed(hidden)
        assert torch.equal(got.argmax(-1), exact.argmax(-1))
        near = got >= got.amax(-1, keepdim=True) - 0.9  # the margin, less the kernel's error
        assert torch.allclose(got[near], exact[near], atol=1e-4)
        assert packed(hidden, 100).shape == (16, 100)


def test_packed_model_holds_the_ggufs_blocks(packed_model):
    """The GGUF's Q4_1 layers and Q8_0 embedding pack back into their own blocks: the packed
    model's float parameters, and the blocks' dequantized values, are the float model's."""
    from actors.models.packed_cpu_weights import Q4Linear, Q8LMHead

    layer = packed_model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Q4Linear) and isinstance(packed_model.lm_head, Q8LMHead)
    float_model, _ = build_model(default_model_path(), torch.float32, "cpu")
    for (name, p), (_, f) in zip(packed_model.named_parameters(), float_model.named_parameters()):
        assert torch.equal(p, f), name
    for proj in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        assert torch.equal(proj.q4.dequantize(), proj.weight)
    assert torch.equal(packed_model.lm_head.q8.dequantize(), float_model.model.embed_tokens.weight)
    assert packed_model.lm_head.rows.data_ptr() == packed_model.model.embed_tokens.weight.data_ptr()
    names = set(packed_model.checkpoint_state())
    assert "model.layers.0.mlp.up_proj.weight" in names and "lm_head.weight" not in names


def test_packed_settings_that_cannot_run_are_refused(monkeypatch):
    path = default_model_path()
    from kestrel_kernels import cpu_build

    monkeypatch.setattr(cpu_build, "unavailable_reason", lambda: "no compiler (a test)")
    with pytest.raises(ValueError, match="cpu_weights=packed needs the CPU block kernels.*no compiler"):
        build_model(path, torch.float32, "cpu", cpu_weights="packed")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cpu_weights=packed"):
        build_model(path, torch.bfloat16, "cpu", cpu_weights="packed")
    with pytest.raises(ValueError, match="cpu_weights=packed"):
        build_model(path, torch.float32, "cuda", cpu_weights="packed")
    with pytest.raises(ValueError, match="cpu_weights=packed"):
        build_model(path, torch.float32, "cpu", quantization="fp8", cpu_weights="packed")
    with pytest.raises(ValueError, match="not supported"):
        build_model(path, torch.float32, "cpu", cpu_weights="int3")


@pytest.mark.parametrize("overrides,applies", [
    ([], True), (["model.dtype=float32"], False), (["model.dtype=bfloat16"], False),
    (["model.quantization=fp8"], False), (["scheduler.mixed_steps=true"], False)])
def test_the_worker_packs_where_it_applies(overrides, applies):
    """model.cpu_weights=packed packs on a CPU; where packing cannot run, an explicit dtype
    asks for float weights, or mixed steps would put decode rows in prefill's GEMM, the
    rank keeps them float (and says so), so one preset with it also serves GPUs, FP8
    targets and the fp32 model compared with transformers."""
    from actors.worker.rank_worker import RankWorker
    from configs.schema import load_config

    cfg = load_config(overrides=["device=cpu", "model.cpu_weights=packed", *overrides])
    assert load_config(overrides=["device=cpu"]).model.cpu_weights == "auto"  # the default preset
    worker = RankWorker.__new__(RankWorker)
    worker.device, worker.rank = torch.device("cpu"), 0
    assert (worker._cpu_weights(cfg) == "packed") == applies
    worker.device = torch.device("cuda")
    assert worker._cpu_weights(cfg) == "float"


class _PagedAttn:
    """A decode/verify forward's attention over a given paged cache: layer by layer as the
    CPU backend runs it (store, then the kernel), or handed over whole (paged())."""

    def __init__(self, inputs, whole: bool):
        self.inputs, self.whole = inputs, whole

    def __call__(self, q, k, v, layer):
        p = self.inputs
        p.k_all[layer][p.loc], p.v_all[layer][p.loc] = k, v
        return paged_attention(q, p.k_all[layer], p.v_all[layer], p.kv_index, p.mask, p.q_batch, p.q_slot,
                               p.scale)

    def paged(self):
        return self.inputs if self.whole else None


def _decode_forward(model, tokens: int, whole: bool) -> tuple:
    """A decode or verify forward of `tokens` rows after a 6-token prefix (random K/V, fixed
    seed), the layers in one call (whole) or module by module -> (hidden, the streams
    captured at layers 0, 5 and the last, the caches after it)."""
    a, g = model.arch, torch.Generator().manual_seed(3)
    prefix = 6
    shape = (a.num_layers, prefix + tokens, a.num_kv_heads, a.head_dim)
    c = torch.randn(2, *shape, generator=g)  # [2, L, slots, Hkv, D]: the prefix's K and V
    kv_index = torch.arange(prefix + tokens)[None]  # [1, prefix + T] int64
    mask = torch.ones(1, 1, tokens, prefix + tokens, dtype=torch.bool).tril(prefix)  # causal over the new rows
    ids = torch.randint(0, a.vocab_size, (tokens,), generator=g)
    pos = torch.arange(prefix, prefix + tokens)
    inputs = PagedInputs(c[0], c[1], pos.clone(), kv_index, mask, torch.zeros(tokens, dtype=torch.int64),
                         torch.arange(tokens), a.head_dim ** -0.5)
    with torch.inference_mode():
        hidden, aux = model(ids, pos, _PagedAttn(inputs, whole), aux_layers=(0, 5, a.num_layers))
    return hidden, *aux, c


@pytest.mark.parametrize("tokens", [1, 4])
def test_one_call_forward_equals_the_modules_bit_for_bit(packed_model, q4_isa, tokens):
    """cpu_decoder.cpp runs the layers' kernels in the modules' order: the same hidden
    states, captured streams and stored K/V, bit for bit, at a decode step's one row and a
    verify's four, on each of the Q4_1 kernel's paths."""
    assert packed_model.stack is not None
    fused, modules = _decode_forward(packed_model, tokens, True), _decode_forward(packed_model, tokens, False)
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tokens", [1, 3, 8, 32])
def test_one_call_forward_on_avx_vnni_equals_avx2_bit_for_bit(packed_model, avx_vnni, tokens):
    """The decoder stack's 30 layers with the Q4_1 kernel on AVX-VNNI and on AVX2: every
    output the same bits."""
    vnni = _decode_forward(packed_model, tokens, True)
    with q4_kernel_on("avx2"):
        avx2 = _decode_forward(packed_model, tokens, True)
    for a, b in zip(vnni, avx2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["eagle", "eagle3"])
def test_packed_draft_head_stays_close_to_its_float_layers(packed_model, arch):
    """A draft head on the Q8_0 kernel (pack_draft_weights): with the switch on, hidden
    states within the int8 activations' rounding of its float32 layers'; off, the float
    layers themselves."""
    head = load_eagle_head("random", packed_model, arch, torch.float32, torch.device("cpu"))
    ids, pos = torch.tensor([5, 7, 9]), torch.arange(3)
    feats = torch.randn(3, head.spec.hidden_size * (3 if head.eagle3 else 1),
                        generator=torch.Generator().manual_seed(6))  # [T, F] target features
    attn = lambda q, k, v, layer: q  # the layers' projections are compared, not attention
    switch = packed_model.kernel_switch
    with torch.inference_mode():
        ref = head(ids, pos, attn, feats)  # [T, H]
        pack_draft_weights(head, switch)
        on = head(ids, pos, attn, feats)
        switch.on = False
        off = head(ids, pos, attn, feats)
        switch.on = True
        logits = head.compute_logits(on)
    assert torch.allclose(off, ref, atol=1e-5)
    assert (on - ref).abs().max() < 0.05 * ref.abs().max()
    assert logits.shape == (3, head.spec.draft_vocab_size)


def test_auto_serves_packed_where_the_kernels_load_and_float_with_a_warning_elsewhere(monkeypatch, caplog):
    from configs.schema import load_config
    from kestrel_kernels import cpu_build
    from serve_app.engine.llm_engine import LLMEngine

    overrides = ["model.cpu_weights=auto", "draft.enabled=false", "kv_cache.num_slots=8192"]
    eng = LLMEngine(load_config(overrides=overrides), load_tokenizer=False)
    assert eng.workers[0].info()["cpu_weights"] == "packed"
    assert eng.workers[0].info()["cpu_q4_isa"] in ("avxvnni", "avx512vnni", "avx2")
    assert eng.workers[0].model.kernel_switch is not None
    monkeypatch.setattr(cpu_build, "unavailable_reason", lambda: "no compiler (a test)")
    with caplog.at_level("WARNING", logger="kestrel.worker"):
        eng = LLMEngine(load_config(overrides=overrides), load_tokenizer=False)
    assert eng.workers[0].info()["cpu_weights"] == "float"
    assert eng.workers[0].info()["cpu_q4_isa"] is None
    assert eng.workers[0].model.kernel_switch is None
    assert "cpu_weights=auto: the CPU kernels do not load (no compiler (a test))" in caplog.text
