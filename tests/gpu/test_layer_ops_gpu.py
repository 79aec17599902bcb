"""Decoder-layer Triton kernels compiled on a GPU against their torch references (run on the
GPU too), at model sizes; captured in a CUDA graph; and the whole SmolLM2 model in bf16 with
the kernels against itself with the references (`layer_ops.force_torch`).

(Not named test_layer_ops.py: that basename is taken by the unit tests.) Sums must be equal
exactly; the rest may differ by the fp32 reduction order and cos/sin/exp, an ulp or two.
Greedy tokens of the two model paths must agree except at bf16 near-ties.
"""
from __future__ import annotations

import pytest
import torch

# Imported first: on a CPU-only machine the unit module switches on Triton's interpreter
# before anything imports triton, so the unit tests still run whichever file is collected
# first (here they are skipped anyway).
from unit.test_layer_ops import TOL, check_store_kv  # isort: skip

import torch.nn.functional as F  # noqa: E402
from gpu.test_gpu_engine import check_near_ties  # noqa: E402
from actors.models.rope import rope_inv_freq  # noqa: E402
from kestrel_kernels import activation, kv_store, layer_ops, rmsnorm, rope  # noqa: E402
from kestrel_testing import require_compiled_triton  # noqa: E402
from kestrel_kernels import triton_activation as tact  # noqa: E402
from kestrel_kernels import triton_rmsnorm as trms  # noqa: E402
from kestrel_kernels import triton_rope as trope  # noqa: E402


@pytest.fixture(autouse=True)
def _compiled():
    require_compiled_triton(trms, "_rmsnorm_kernel")


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def assert_near(got, want):
    assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[want.dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 77, 2048])
@pytest.mark.parametrize("H", [576, 960, 4096, 8192])
def test_rmsnorm_and_fused_add(T, H, dtype):
    x = randn(T, H, dtype=dtype, seed=T + H)  # [T, H]
    res = randn(T, H, dtype=dtype, seed=T + H + 1, scale=4.0)
    w = randn(H, dtype=dtype, seed=H)  # [H]
    assert_near(trms.rmsnorm_triton(x, w, 1e-5), rmsnorm.rmsnorm(x, w, 1e-5))
    normed, summed = trms.fused_add_rmsnorm_triton(x, res, w, 1e-5)
    ref_normed, ref_summed = rmsnorm.fused_add_rmsnorm(x, res, w, 1e-5)
    assert torch.equal(summed, ref_summed)
    assert_near(normed, ref_normed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 5, 1000])
@pytest.mark.parametrize("HQ,HKV,D", [(9, 3, 64), (15, 5, 64), (32, 8, 128)])
def test_rope(T, HQ, HKV, D, dtype):
    q = randn(T, HQ, D, dtype=dtype, seed=T)  # [T, Hq, D]
    k = randn(T, HKV, D, dtype=dtype, seed=T + 1)  # [T, Hkv, D]
    pos = torch.randint(0, 32768, (T,), device="cuda")  # [T] int64
    inv_freq = rope_inv_freq(D, 500000.0).cuda()  # [D/2] fp32
    for got, want in zip(trope.rope_triton(q, k, pos, inv_freq), rope.rope(q, k, pos, inv_freq)):
        assert_near(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,I", [(1, 1536), (77, 1536), (2048, 14336)])
def test_silu_and_mul(T, I, dtype):
    gate = randn(T, I, dtype=dtype, seed=T, scale=4.0)  # [T, I]
    up = randn(T, I, dtype=dtype, seed=T + 1)
    assert_near(tact.silu_and_mul_triton(gate, up), activation.silu_and_mul(gate, up))


@pytest.mark.parametrize("T,I", [(1, 1536), (77, 1536)])
def test_silu_and_mul_on_a_fused_gate_up_output(T, I):
    gate, up = randn(T, 2 * I, dtype=torch.bfloat16, seed=T, scale=4.0).split(I, -1)  # strided rows
    assert_near(tact.silu_and_mul_triton(gate, up), activation.silu_and_mul(gate, up))


@pytest.mark.parametrize("cache_dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("T,HQ,HKV,D", [(1, 9, 3, 64), (512, 9, 3, 64), (64, 28, 4, 128), (8, 64, 8, 128)])
def test_store_kv(T, HQ, HKV, D, cache_dtype, kv_dtype):
    """The unit test's check at SmolLM2's and the 7B/72B shapes' heads, on a 65k-slot cache."""
    check_store_kv(T, HQ, HKV, D, cache_dtype, kv_dtype, slots=1 << 16)


def test_store_kv_in_a_cuda_graph():
    """Captured once, replayed with new rows and new slots in the same buffers."""
    T, HKV, D = 16, 3, 64
    k, v = randn(T, HKV, D, dtype=torch.bfloat16, seed=1), randn(T, HKV, D, dtype=torch.bfloat16, seed=2)
    loc = torch.arange(T, device="cuda")  # [T] int64
    kc, vc = (torch.zeros(4096, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    with torch.no_grad():
        layer_ops.store_kv(kc, vc, loc, k, v)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer_ops.store_kv(kc, vc, loc, k, v)
        kc.zero_(), vc.zero_()
        k.copy_(randn(T, HKV, D, dtype=torch.bfloat16, seed=3))
        v.copy_(randn(T, HKV, D, dtype=torch.bfloat16, seed=4))
        loc.copy_(torch.randperm(4096, device="cuda")[:T])
        graph.replay()
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    kv_store.store_kv(want_k, want_v, loc, k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_dispatch_on_cuda():
    """CUDA tensors take the kernels, except where autograd needs the references' backward."""
    x = randn(4, 64, dtype=torch.float32, seed=0)
    w = torch.ones(64, device="cuda", requires_grad=True)
    assert layer_ops.use_triton(x)
    assert not layer_ops.use_triton(x, w)
    with torch.no_grad():
        assert layer_ops.use_triton(x, w)
    with layer_ops.force_torch():
        assert not layer_ops.use_triton(x)
    layer_ops.set_fused(False)  # model.fused_layer_ops=false
    try:
        assert not layer_ops.use_triton(x)
    finally:
        layer_ops.set_fused(True)
    layer_ops.rmsnorm(x, w, 1e-5).sum().backward()  # the reference ran: a gradient exists
    assert w.grad is not None


def test_ops_in_a_cuda_graph():
    """All four ops captured once, replayed on new inputs copied into the same buffers."""
    T, H, I, HQ, HKV, D = 8, 576, 1536, 9, 3, 64
    dt = torch.bfloat16
    x, res, w = randn(T, H, dtype=dt, seed=1), randn(T, H, dtype=dt, seed=2), randn(H, dtype=dt, seed=3)
    q, k = randn(T, HQ, D, dtype=dt, seed=4), randn(T, HKV, D, dtype=dt, seed=5)
    gate, up = randn(T, I, dtype=dt, seed=6), randn(T, I, dtype=dt, seed=7)
    pos = torch.arange(T, device="cuda")  # [T] int64
    inv_freq = rope_inv_freq(D, 10000.0).cuda()

    def step():
        return (layer_ops.rmsnorm(x, w, 1e-5), *layer_ops.fused_add_rmsnorm(x, res, w, 1e-5),
                *layer_ops.rope(q, k, pos, inv_freq), layer_ops.silu_and_mul(gate, up))

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for i, t in enumerate((x, res, q, k, gate, up)):
            t.copy_(randn(*t.shape, dtype=dt, seed=100 + i))
        pos.copy_(torch.randint(0, 4096, (T,), device="cuda"))
        graph.replay()
        want = (rmsnorm.rmsnorm(x, w, 1e-5), *rmsnorm.fused_add_rmsnorm(x, res, w, 1e-5),
                *rope.rope(q, k, pos, inv_freq), activation.silu_and_mul(gate, up))
    for got, ref in zip(outs, want):
        assert_near(got, ref)


# ---------------------------------------------------------------------------- whole model
def dense_causal(q, k, v, layer_id):
    """q [T, Hq, D], k/v [T, Hkv, D] of one sequence -> [T, Hq, D]."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.fixture(scope="module")
def bf16_model(smollm_path):
    from actors.models.loader import build_model
    model, _ = build_model(smollm_path, torch.bfloat16, "cuda")
    return model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, recomputing the whole sequence each step (no KV cache)."""
    ids = list(prompt)
    for _ in range(n):
        t = torch.tensor(ids, device="cuda")
        h, _ = model(t, torch.arange(len(ids), device="cuda"), dense_causal)
        ids.append(int(model.compute_logits(h[-1:]).argmax(-1)))
    return ids[len(prompt):]


@torch.no_grad()
def test_model_kernels_match_references(bf16_model, chat_prompts, fp32_ref):
    model, L = bf16_model, bf16_model.arch.num_layers
    aux_layers = (0, 2, L // 2, L)
    ids = torch.tensor(chat_prompts[0], device="cuda")
    pos = torch.arange(len(ids), device="cuda")
    hidden, aux = model(ids, pos, dense_causal, aux_layers)
    with layer_ops.force_torch():
        ref_hidden, ref_aux = model(ids, pos, dense_causal, aux_layers)
    assert torch.equal(aux[0], ref_aux[0])  # the embeddings
    for got, want in zip([hidden, *aux[1:]], [ref_hidden, *ref_aux[1:]]):
        # Differences of an ulp compound over 30 layers: compare relative to the row scale.
        err = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)
        assert float(err.max()) < 0.05, float(err.max())

    prompts = chat_prompts[:4]
    fused = [greedy(model, p, 16) for p in prompts]
    with layer_ops.force_torch():
        ref = [greedy(model, p, 16) for p in prompts]
    check_near_ties(fp32_ref, prompts, fused, ref)
