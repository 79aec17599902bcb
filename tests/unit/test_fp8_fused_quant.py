"""FP8 activations quantized by the kernel that computes them: RMSNorm (alone and with the
residual add) and SiLU-and-mul writing an FP8 linear's codes and row scales (Fp8Rows)
bit-equal to the unquantized kernel followed by `quantize_rows_triton`; fp8_linear on
Fp8Rows equal to fp8_linear on the float rows; and an FP8 model's logits the same with
the fused quantization and without. On CPU in Triton's interpreter, on a GPU compiled
(tests/gpu/test_fp8_fused_quant_gpu.py adds model widths at prefill's row counts)."""
from tests.triton_interpreter import triton_setup  # noqa: I001 - before triton is imported
import json

import pytest
import torch

import kestrel_kernels.fp8_linear as fp8_linear_mod
from actors.models.fp8_linear import Fp8Linear, fuse_fp8_inputs
from actors.models.loader import build_model
from kestrel_kernels import activation, layer_ops, rmsnorm
from kestrel_kernels import triton_activation as tact
from kestrel_kernels import triton_rmsnorm as trms
from kestrel_kernels.fp8_linear import FP8, Fp8Rows, fp8_linear_scaled_mm, quantize_rows
from kestrel_kernels.triton_fp8_quant import MAX_BLOCK, quantize_rows_triton

INTERPRETED, DEV, needs_triton = triton_setup(trms, "_rmsnorm_kernel")

DTYPES = [torch.bfloat16, torch.float16]
ROWS = [1, 3, 64]
WIDTHS = [576, 3584, 18944]  # SmolLM2-135M's hidden size, Qwen2.5-7B's hidden and intermediate
# Every rows x width pair; 64 rows (seconds each in the interpreter) in `make test-long`
# only, 1 and 3 rows covering every width in `make test` (a program is one row).
SHAPES = [pytest.param(T, H, marks=pytest.mark.long) if T == max(ROWS) else (T, H)
          for T in ROWS for H in WIDTHS]


def rows(T, H, dtype, seed, scale=1.0):
    """[T, H] rows of magnitudes 1e-2..1e2 times `scale`, the third all zeros (every code 0,
    the smallest scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * torch.logspace(-2, 2, T).view(T, 1) * scale  # [T, H] fp32
    if T > 2:
        x[2] = 0.0
    return x.to(dtype).to(DEV)


def norm_weight(H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, generator=g) * 0.5 + 1).to(dtype).to(DEV)  # [H]


def assert_same(got: Fp8Rows, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    assert got.q.dtype == FP8 and got.shape == q.shape and got.scale.shape == scale.shape
    assert got.dtype == dtype
    assert torch.equal(got.scale, scale)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", SHAPES)
def test_rmsnorm_quant_is_the_norm_then_its_quantization(T, H, dtype):
    wide = rows(T, H + 64, dtype, seed=T * H)  # [T, H + 64]
    x = wide[:, :H]  # [T, H] rows of a wider tensor, read in place
    w = norm_weight(H, dtype, seed=H + 1)
    got = trms.rmsnorm_quant_triton(x, w, 1e-6)
    assert_same(got, *quantize_rows_triton(trms.rmsnorm_triton(x, w, 1e-6)), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", SHAPES)
def test_fused_add_rmsnorm_quant_writes_the_sum_and_the_norms_codes(T, H, dtype):
    x = rows(T, H, dtype, seed=T * H + 2)  # [T, H]
    res = rows(T, H, dtype, seed=T * H + 3, scale=4.0)  # [T, H]
    w = norm_weight(H, dtype, seed=H + 4)
    got, summed = trms.fused_add_rmsnorm_quant_triton(x, res, w, 1e-6)
    normed, want_sum = trms.fused_add_rmsnorm_triton(x, res, w, 1e-6)
    assert summed.dtype == want_sum.dtype and torch.equal(summed, want_sum)
    assert_same(got, *quantize_rows_triton(normed), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
# The last: rows longer than one program holds (the two kernels).
@pytest.mark.parametrize("T,I", SHAPES + [(1, MAX_BLOCK + 232), (3, MAX_BLOCK + 232)])
def test_silu_and_mul_quant_is_the_product_then_its_quantization(T, I, dtype):
    gate_up = rows(T, 2 * I, dtype, seed=T * I, scale=0.05)  # [T, 2I] one GEMM's output
    gate, up = gate_up.split(I, -1)  # [T, I] each, row stride 2I
    got = tact.silu_and_mul_quant_triton(gate, up)
    assert_same(got, *quantize_rows_triton(tact.silu_and_mul_triton(gate, up)), dtype)


@needs_triton
def test_leading_dims_and_no_rows():
    x = rows(6, 256, torch.bfloat16, seed=5).view(2, 3, 256)  # [B, T, H]
    w = torch.ones(256, dtype=torch.bfloat16, device=DEV)
    got = trms.rmsnorm_quant_triton(x, w, 1e-6)
    assert got.q.shape == (2, 3, 256) and got.scale.shape == (2, 3, 1)
    assert_same(got, *quantize_rows(trms.rmsnorm_triton(x, w, 1e-6)), torch.bfloat16)
    gate = up = x[:0]  # no rows
    none = tact.silu_and_mul_quant_triton(gate, up)
    assert none.q.shape == (0, 3, 256) and none.scale.shape == (0, 3, 1)


def test_references_are_the_compositions():
    """The CPU path (layer_ops on CPU tensors): quantize_rows of the unquantized reference."""
    x, res = rows(3, 64, torch.bfloat16, seed=6).cpu(), rows(3, 64, torch.bfloat16, seed=7).cpu()
    w = torch.randn(64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert_same(layer_ops.rmsnorm_quant(x, w, 1e-6), *quantize_rows(rmsnorm.rmsnorm(x, w, 1e-6)), torch.bfloat16)
    got, summed = layer_ops.fused_add_rmsnorm_quant(x, res, w, 1e-6)
    normed, want_sum = rmsnorm.fused_add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(summed, want_sum)
    assert_same(got, *quantize_rows(normed), torch.bfloat16)
    assert_same(layer_ops.silu_and_mul_quant(x, res), *quantize_rows(activation.silu_and_mul(x, res)), torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("M", [1, 3])
def test_the_gemv_takes_fp8_rows_as_the_float_rows(monkeypatch, M):
    """fp8_linear_scaled_mm's few-row product (the Triton GEMV) on Fp8Rows and on the float
    rows they quantize (on CPU: interpreted); tests/unit/test_fp8_linear.py has the GEMM's."""
    if DEV == "cpu":
        monkeypatch.setattr(fp8_linear_mod, "use_triton", lambda t, force_torch=False: True)
    g = torch.Generator().manual_seed(M)
    wq, ws = (t.to(DEV) for t in quantize_rows(torch.randn(64, 96, generator=g) * 0.05))  # [N, K], [N, 1]
    b = (torch.randn(64, generator=g) * 0.1).to(torch.bfloat16).to(DEV)  # [N]
    x = rows(M, 96, torch.bfloat16, seed=12)  # [M, K]
    fp8_linear_mod.set_gemv_max_rows(4)
    try:
        want = fp8_linear_scaled_mm(x, wq, ws, b)
        assert torch.equal(fp8_linear_scaled_mm(Fp8Rows(*quantize_rows_triton(x), x.dtype), wq, ws, b), want)
    finally:
        fp8_linear_mod.set_gemv_max_rows(0)


TINY = {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rope_theta": 1e6, "tie_word_embeddings": False,
        "eos_token_id": 2}


def attn(q, k, v, layer_id):
    """Dense causal attention (GQA) over the one sequence of the batch."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fp8_model_logits_fused_and_unfused_are_the_same(tmp_path, monkeypatch, kernels):
    """A tiny Qwen2 with FP8 linears: the norms and SiLU-and-mul feed qkv_proj, gate_up_proj
    and down_proj FP8 rows (one quantization a layer left, o_proj's), and the logits are
    bit-equal to the unfused model's. `triton`: the layer kernels (on CPU: interpreted)."""
    if kernels == "triton":
        if not trms.HAS_TRITON:
            pytest.skip("triton is not installed")
        if DEV == "cpu":
            monkeypatch.setattr(layer_ops, "use_triton", lambda *ts: True)
    elif DEV != "cpu":
        pytest.skip("the torch references: the CPU path")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, _ = build_model(str(tmp_path), torch.bfloat16, DEV, load_format="dummy", seed=3,
                           quantization="fp8")
    layers = model.model.layers
    assert all(isinstance(layers[0].get_submodule(p), Fp8Linear) for p in ("self_attn.qkv_proj", "mlp.down_proj"))
    assert all(m.quantize for lay in layers for m in (lay.input_layernorm, lay.post_attention_layernorm, lay.mlp))
    assert not model.model.norm.quantize  # the LM head is not FP8
    quantized = []
    real = fp8_linear_mod.quantize_rows

    def counted(x):
        quantized.append(x.shape[-1])
        return real(x)

    monkeypatch.setattr(fp8_linear_mod, "quantize_rows", counted)
    ids = torch.tensor([5, 17, 3, 88, 41, 9, 60], device=DEV)

    def logits():
        quantized.clear()
        with torch.no_grad():
            h, aux = model(ids, torch.arange(len(ids), device=DEV), attn, aux_layers=(1, 2))
            return model.compute_logits(h), aux, list(quantized)

    fused, fused_aux, fused_quantized = logits()
    fuse_fp8_inputs(model, False)
    assert not any(m.quantize for lay in layers for m in (lay.input_layernorm, lay.post_attention_layernorm, lay.mlp))
    plain, plain_aux, plain_quantized = logits()
    assert torch.isfinite(fused).all() and torch.equal(fused, plain)
    assert all(torch.equal(a, b) for a, b in zip(fused_aux, plain_aux))  # EAGLE-3's captured states
    if DEV == "cpu" and kernels == "triton":  # fp8_linear_ref's quantize_rows: o_proj's alone when fused
        assert fused_quantized == [TINY["hidden_size"]] * len(layers)
        assert len(plain_quantized) == 4 * len(layers)
