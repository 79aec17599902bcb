"""torch's weight-only CPU kernels against their torch references, and the packed model
(model.cpu_weights=packed) against its float path and the GGUF's own Q4_1 blocks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors.models.loader import build_model, default_model_path
from kestrel_kernels.weight_only import (GROUP, int4_linear, int4_linear_ref, int8_linear,
                                         int8_linear_ref, quantize_int4, quantize_int8)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's bfloat16 spacing."""
    b = b.float()
    ulp = torch.finfo(torch.bfloat16).eps * b.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    return (a.float() - b).abs() / ulp


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_int4_kernel_equals_reference(rows):
    g = torch.Generator().manual_seed(rows)
    w = quantize_int4(torch.randn(96, 4 * GROUP, generator=g))
    x = torch.randn(rows, 4 * GROUP, generator=g)
    out, ref = int4_linear(x, w), int4_linear_ref(x, w)
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == (rows, 96)
    # The same function up to the order of the float32 sums: at most one bfloat16 step apart.
    assert _bf16_ulps(out, ref).max() <= 1
    assert (out != ref).float().mean() < 0.02


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_int8_kernel_equals_reference(rows):
    g = torch.Generator().manual_seed(10 + rows)
    w = quantize_int8(torch.randn(200, 64, generator=g))
    x = torch.randn(rows, 64, generator=g)
    for limit in (None, 120):
        out, ref = int8_linear(x, w, limit), int8_linear_ref(x, w, limit)
        assert out.shape == (rows, limit or 200)
        assert _bf16_ulps(out, ref).max() <= 1


def test_kernels_compute_each_row_alone():
    """A row's result does not depend on the other rows of the forward: a decode step of one
    request and a verify of four rows agree bit for bit (what losslessness rests on)."""
    g = torch.Generator().manual_seed(3)
    w4 = quantize_int4(torch.randn(64, 2 * GROUP, generator=g))
    w8 = quantize_int8(torch.randn(80, 2 * GROUP, generator=g))
    x = torch.randn(7, 2 * GROUP, generator=g)
    for fn, w in ((int4_linear, w4), (int8_linear, w8)):
        whole = fn(x, w)
        for i in range(7):
            assert torch.equal(fn(x[i:i + 1], w)[0], whole[i])


def test_int4_groups_recover_q4_1_blocks():
    """Weights dequantized from Q4_1 (llama.cpp's format, via gguf-py) quantize back to the
    same 4-bit codes: the packed weights differ from the GGUF's only by their scale and
    offset in bfloat16 (hundredths of a 4-bit step, against the half step of Q4_1's own
    rounding)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((48, 8 * GROUP)).astype(np.float32)
    gguf_w = torch.from_numpy(dequantize(quantize(w, GGMLQuantizationType.Q4_1),
                                         GGMLQuantizationType.Q4_1).reshape(w.shape))
    packed = quantize_int4(gguf_w)
    blocks = gguf_w.view(48, 8, GROUP)
    step = ((blocks.amax(-1) - blocks.amin(-1)) / 15)[..., None]  # [48, 8, 1] the blocks' d
    err = (packed.dequantized.view(48, 8, GROUP) - blocks).abs() / step
    assert err.max() < 0.1 and err.mean() < 0.02
    # and a float weight that is not on a 4-bit grid is within half a step of it
    plain = torch.from_numpy(w)
    p = quantize_int4(plain)
    d = ((plain.view(48, 8, GROUP).amax(-1) - plain.view(48, 8, GROUP).amin(-1)) / 15)[..., None]
    assert ((p.dequantized.view(48, 8, GROUP) - plain.view(48, 8, GROUP)).abs() / d).max() < 0.52


def test_int8_rows_round_to_their_scale():
    w = torch.randn(30, 64, generator=torch.Generator().manual_seed(4))
    q = quantize_int8(w)
    s = q.scales.float()[:, None]
    assert q.codes.abs().max() <= 127
    assert ((q.dequantized - w).abs() / s).max() < 0.52
    assert torch.equal(q.dequantized, q.codes.float() * s)


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
    model: same greedy tokens, logits a bfloat16 step or so apart, and within the refine
    margin of the top, the float rows' logits."""
    model = packed_model
    ids = torch.tensor([1, 9519, 314, 253, 5356, 1145, 30, 378, 2358, 282, 4649, 314])
    pos = torch.arange(ids.numel())
    out = {}
    with torch.inference_mode():
        for on in (True, False):
            model.kernel_switch.on = on
            out[on] = model.compute_logits(model(ids, pos, _attn)[0])
    model.kernel_switch.on = True
    # equal picks, or a near-tie (the int4 layers' bfloat16 sums may order it either way)
    pick = out[True].argmax(-1)
    gap = out[False].amax(-1) - out[False].gather(1, pick[:, None])[:, 0]
    assert (gap < 0.1).all() and (pick == out[False].argmax(-1)).float().mean() > 0.8
    assert (out[True] - out[False]).abs().max() < 1.0
    near = out[True] >= out[True].amax(-1, keepdim=True) - 1.0
    assert ((out[True] - out[False]).abs()[near]).max() < 0.5  # the int4 layers' rounding only


def test_refined_head_picks_the_float_rows_top():
    """Near-ties the int8 rows and bfloat16 logits would break their own way are decided on
    the float rows: the pick equals a float32 GEMM's over the same hidden states."""
    from actors.models.packed_cpu_weights import Int8LMHead, KernelSwitch
    from actors.models.llama import LMHead

    g = torch.Generator().manual_seed(5)
    head = LMHead(64, 3000, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(3000, 64, generator=g) * 0.3)
    packed = Int8LMHead(head, KernelSwitch())
    hidden = torch.randn(16, 64, generator=g)
    with torch.no_grad():
        exact = head(hidden)
        got = packed(hidden)
        assert torch.equal(got.argmax(-1), exact.argmax(-1))
        near = got >= got.amax(-1, keepdim=True) - 1.0
        assert torch.allclose(got[near], exact[near], atol=1e-4)
        assert packed(hidden, 100).shape == (16, 100)


def test_packed_model_holds_its_values_in_the_float_parameters(packed_model):
    from actors.models.packed_cpu_weights import Int4Linear, Int8LMHead

    layer = packed_model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Int4Linear) and isinstance(packed_model.lm_head, Int8LMHead)
    proj = layer.mlp.gate_up_proj
    assert proj.int4.dequantized.data_ptr() == proj.weight.data_ptr()  # one float copy
    # the embedding (the tied head's float rows) keeps the GGUF's values: the int8 rows are apart
    float_model, _ = build_model(default_model_path(), torch.float32, "cpu")
    assert torch.equal(packed_model.model.embed_tokens.weight, float_model.model.embed_tokens.weight)
    assert packed_model.lm_head.rows.data_ptr() == packed_model.model.embed_tokens.weight.data_ptr()
    names = set(packed_model.checkpoint_state())
    assert "model.layers.0.mlp.up_proj.weight" in names and "lm_head.weight" not in names


def test_packed_settings_that_cannot_run_are_refused():
    path = default_model_path()
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
    (["model.quantization=fp8"], False)])
def test_the_worker_packs_where_it_applies(overrides, applies):
    """model.cpu_weights=packed packs on a CPU; where packing cannot run, or an explicit
    dtype asks for float weights, the rank keeps them float (and says so), so one preset
    with it also serves GPUs, FP8 targets and the fp32 model compared with transformers."""
    from actors.worker.rank_worker import RankWorker
    from configs.schema import load_config

    cfg = load_config(overrides=["device=cpu", "model.cpu_weights=packed", *overrides])
    assert load_config(overrides=["device=cpu"]).model.cpu_weights == "float"  # the default preset
    worker = RankWorker.__new__(RankWorker)
    worker.device, worker.rank = torch.device("cpu"), 0
    assert (worker._cpu_weights(cfg) == "packed") == applies
    worker.device = torch.device("cuda")
    assert worker._cpu_weights(cfg) == "float"
