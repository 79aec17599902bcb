"""FP8 activations quantized by the kernel that computes them, on CUDA at Qwen2.5-7B's
widths (hidden 3584, intermediate 18944) from a decode step's rows to a prefill chunk's:
RMSNorm, the residual add and RMSNorm, and SiLU-and-mul writing FP8 codes and row scales
bit-equal to the unquantized kernel followed by `quantize_rows_triton` (the same warps sum
the squares in the same order), also replayed in a CUDA graph; and a two-layer FP8 model
of that shape giving the same logits with the fused quantization and without, at few rows
(the FP8 GEMV) and many (cuBLASLt). Skipped without CUDA; the FP8 model needs compute
capability 8.9 (Ada, Hopper)."""
from __future__ import annotations

import json

import pytest
import torch

from kestrel_kernels import layer_ops
from kestrel_kernels import triton_activation as tact
from kestrel_kernels import triton_rmsnorm as trms
from kestrel_kernels.fp8_linear import FP8, Fp8Rows
from kestrel_kernels.triton_fp8_quant import MAX_BLOCK, quantize_rows_triton

HIDDEN, INTERMEDIATE = 3584, 18944  # Qwen2.5-7B


def randn(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def assert_same(got: Fp8Rows, unquantized: torch.Tensor):
    """got: unquantized's rows as quantize_rows_triton quantizes them."""
    q, scale = quantize_rows_triton(unquantized.view(-1, unquantized.shape[-1]))  # [M, K] fp8, [M, 1] fp32
    assert got.q.dtype == FP8 and got.dtype == unquantized.dtype and got.shape == unquantized.shape
    assert torch.equal(got.scale.view(-1, 1), scale)
    assert torch.equal(got.q.view(-1, q.shape[-1]).view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [HIDDEN, INTERMEDIATE])
@pytest.mark.parametrize("T", [1, 16, 64, 8192])
def test_rmsnorm_quant_equals_the_norm_then_its_quantization(T, H, dtype):
    x = randn(T, H, seed=T + H, scale=3.0, dtype=dtype)  # [T, H]
    res = randn(T, H, seed=T + H + 1, dtype=dtype)  # [T, H]
    w = randn(H, seed=H, scale=0.3, dtype=dtype) + 1  # [H]
    assert_same(trms.rmsnorm_quant_triton(x, w, 1e-6), trms.rmsnorm_triton(x, w, 1e-6))
    got, summed = trms.fused_add_rmsnorm_quant_triton(x, res, w, 1e-6)
    normed, want_sum = trms.fused_add_rmsnorm_triton(x, res, w, 1e-6)
    assert torch.equal(summed, want_sum)
    assert_same(got, normed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("I", [HIDDEN, INTERMEDIATE, MAX_BLOCK + 232])  # the last: the two kernels
@pytest.mark.parametrize("T", [1, 16, 64, 8192])
def test_silu_and_mul_quant_equals_the_product_then_its_quantization(T, I, dtype):
    gate, up = randn(T, 2 * I, seed=T + I, scale=2.0, dtype=dtype).split(I, -1)  # [T, I] each, row stride 2I
    assert_same(tact.silu_and_mul_quant_triton(gate, up), tact.silu_and_mul_triton(gate, up))


def test_fused_ops_in_a_cuda_graph():
    T = 16
    x, res = randn(T, HIDDEN, seed=1), randn(T, HIDDEN, seed=2)  # [T, H] static inputs
    gate_up = randn(T, 2 * INTERMEDIATE, seed=3)  # [T, 2I] static input
    w = randn(HIDDEN, seed=4, scale=0.3) + 1  # [H]

    def ops():
        gate, up = gate_up.split(INTERMEDIATE, -1)
        return (layer_ops.rmsnorm_quant(x, w, 1e-6), *layer_ops.fused_add_rmsnorm_quant(x, res, w, 1e-6),
                layer_ops.silu_and_mul_quant(gate, up))

    ops()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops()
    for seed in (5, 6):
        for i, t in enumerate((x, res, gate_up)):
            t.copy_(randn(*t.shape, seed=seed * 10 + i))
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(flat(captured), flat(ops())))


def flat(outs) -> list[torch.Tensor]:
    """The ops' outputs as tensors, FP8 codes as their bytes."""
    tensors = []
    for o in outs:
        tensors += [o.q.view(torch.uint8), o.scale] if isinstance(o, Fp8Rows) else [o]
    return tensors


def attn(q, k, v, layer_id):
    """Dense causal attention (GQA) over the one sequence of the batch."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("T", [1, 16, 300])
def test_fp8_model_logits_fused_and_unfused_are_the_same(tmp_path, T):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9")
    from actors.models.fp8_linear import fuse_fp8_inputs
    from actors.models.loader import build_model
    from kestrel_kernels import fp8_linear
    config = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
              "num_hidden_layers": 2, "num_attention_heads": 28, "num_key_value_heads": 4,
              "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": False,
              "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = build_model(str(tmp_path), torch.bfloat16, "cuda", load_format="dummy", seed=7, quantization="fp8")
    ids = torch.randint(0, 2048, (T,), generator=torch.Generator().manual_seed(T)).cuda()  # [T]

    def logits():
        with torch.no_grad():
            h, aux = model(ids, torch.arange(T, device="cuda"), attn, aux_layers=(1, 2))
            return model.compute_logits(h), aux

    fp8_linear.set_gemv_max_rows(16)  # as the 7B preset: 1-16 rows take the FP8 GEMV
    try:
        fused, fused_aux = logits()
        fuse_fp8_inputs(model, False)
        plain, plain_aux = logits()
    finally:
        fp8_linear.set_gemv_max_rows(0)
    assert torch.isfinite(fused).all() and torch.equal(fused, plain)
    assert all(torch.equal(a, b) for a, b in zip(fused_aux, plain_aux))
