"""The FP8 linear's CUDA path (torch._scaled_mm with row-wise scales, or, for narrow outputs
at few rows, the tensor-scaled GEMM and the rescale kernel: both are among the cases)
against its fp32 reference at 7B shapes, in a CUDA graph, and an FP8 target served with speculation on the GPU
(triton backend, graphs): greedy output equals plain output up to bf16 near-ties.
Skipped without CUDA; needs compute capability 8.9 (Ada, Hopper)."""
from __future__ import annotations

import json

import pytest
import torch
from kestrel_testing import GPU_DRAFT

from kestrel_kernels.fp8_linear import fp8_linear, fp8_linear_ref, fp8_linear_scaled_mm, quantize_rows


@pytest.fixture(autouse=True)
def _fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9")


def randn(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


# Qwen2.5-7B's GEMMs: q/k/v (with bias), o, gate/up, down; and a narrow one.
SHAPES = [(4608, 3584, True), (3584, 3584, False), (37888, 3584, False), (3584, 18944, False),
          (512, 3584, False)]


@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("N,K,bias", SHAPES)
def test_scaled_mm_equals_the_reference(M, N, K, bias):
    x = randn(M, K, seed=M)  # [M, K] bf16
    wq, ws = quantize_rows(randn(N, K, seed=N + K, scale=0.02))  # [N, K] fp8, [N, 1] fp32
    b = randn(N, seed=7, scale=0.1) if bias else None
    got, want = fp8_linear_scaled_mm(x, wq, ws, b), fp8_linear_ref(x, wq, ws, b)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    # The same fp32 products summed in another order, then one bf16 rounding each.
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.float().abs().max().item())
    assert torch.equal(fp8_linear(x, wq, ws, b), got)


def test_scaled_mm_in_a_cuda_graph():
    x = randn(16, 3584, seed=1)  # [M, K] static input
    wq, ws = quantize_rows(randn(4608, 3584, seed=2, scale=0.02))
    b = randn(4608, seed=3)
    fp8_linear(x, wq, ws, b)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, wq, ws, b)
    for seed in (4, 5):
        x.copy_(randn(16, 3584, seed=seed))
        graph.replay()
        assert torch.equal(out, fp8_linear(x, wq, ws, b))


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """A small bf16 checkpoint (every GEMM dimension a multiple of 16) with random weights of a
    normal scale, so its logits have real gaps."""
    from safetensors.torch import save_file

    from actors.models.llama import LlamaForCausalLM
    from actors.models.model_config import LlamaArch
    cfg = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 1024, "rope_theta": 1e6, "tie_word_embeddings": False,
           "eos_token_id": 2}
    with torch.device("meta"):
        names = LlamaForCausalLM(LlamaArch.from_hf_config(cfg)).checkpoint_state()
    g = torch.Generator().manual_seed(0)
    state = {n: (torch.ones(p.shape) if n.endswith("norm.weight") else torch.randn(p.shape, generator=g)
                 * (0.3 if "embed" in n or "lm_head" in n else 0.08)).to(torch.bfloat16)
             for n, p in names.items()}
    folder = tmp_path_factory.mktemp("fp8_gpu")
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(folder / "model.safetensors"))
    return str(folder)


def test_fp8_engine_speculates_losslessly_on_gpu(fp8_folder):
    from actors.models.fp8_linear import is_fp8
    from configs.schema import load_config
    from gpu.test_gpu_engine import check_near_ties
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    base = [f"model.path={fp8_folder}", "model.quantization=fp8", "model.dtype=bfloat16", "device=cuda",
            "kv_cache.num_slots=16384", "model.max_model_len=512", "scheduler.max_running_requests=8",
            "attention.backend=triton", "attention.cuda_graphs=true", "draft.path=random", *GPU_DRAFT]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (5, 9, 17, 33, 64, 100, 7, 12)]
    outs = []
    for spec in (["draft.enabled=false"], ["draft.enabled=true", "draft.topk=4", "draft.num_steps=3",
                                           "draft.num_draft_tokens=8"]):
        eng = LLMEngine(load_config(overrides=base + spec), load_tokenizer=False)
        model = eng.workers[0].model
        assert is_fp8(model)
        outs.append([r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))])
        del eng
    n = check_near_ties(model, prompts, outs[1], outs[0], tol=0.25)
    assert n <= len(prompts) // 4, f"{n} of {len(prompts)} prompts diverged"
