"""Triton decoder-layer kernels (RMSNorm, fused add+RMSNorm, RoPE, silu*mul, the KV store)
against their torch references, and the layer_ops dispatch.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (modest sizes); with
CUDA the same tests run compiled on the GPU (tests/gpu/test_layer_ops_gpu.py adds the
whole-model check). Sums the reference rounds once must be equal exactly; elsewhere the
two may differ by the fp32 reduction order and cos/sin/exp, so by an ulp or two of the
dtype. Skipped when triton is missing.
"""
from __future__ import annotations

import pytest
import torch

import triton_interpreter  # before actors/kernels import triton: picks its interpreter without CUDA
from actors.models.rope import rope_inv_freq
from kestrel_kernels import activation, kv_store, layer_ops, rmsnorm, rope
from kestrel_kernels import triton_activation as tact
from kestrel_kernels import triton_kv_store as tkv
from kestrel_kernels import triton_rmsnorm as trms
from kestrel_kernels import triton_rope as trope

INTERPRETED, DEV, needs_triton = triton_interpreter.triton_setup(trms, "_rmsnorm_kernel")

DTYPES = [torch.bfloat16, torch.float32]
# Two bf16 roundings apart (one ulp is 2^-8..2^-7 of the value); the absolute part covers
# RoPE's cancellation, where an ulp of cos or sin moves a near-zero output by ~2^-8 |x|.
TOL = {torch.bfloat16: dict(rtol=2 ** -6, atol=2 ** -6), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def assert_near(got, want):
    assert got.device.type == DEV and got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[want.dtype])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 576), (3, 960), (17, 100)])
def test_rmsnorm(T, H, dtype):
    gen = torch.Generator().manual_seed(T * H)
    x = randn(T, H, dtype=dtype, gen=gen, scale=3.0)  # [T, H]
    w = randn(H, dtype=dtype, gen=gen)  # [H]
    assert_near(trms.rmsnorm_triton(x, w, 1e-5), rmsnorm.rmsnorm(x, w, 1e-5))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 576), (3, 960), (17, 100)])
def test_fused_add_rmsnorm(T, H, dtype):
    gen = torch.Generator().manual_seed(T * H + 1)
    x = randn(T, H, dtype=dtype, gen=gen)  # [T, H]
    res = randn(T, H, dtype=dtype, gen=gen, scale=4.0)  # [T, H]
    w = randn(H, dtype=dtype, gen=gen)  # [H]
    normed, summed = trms.fused_add_rmsnorm_triton(x, res, w, 1e-6)
    ref_normed, ref_summed = rmsnorm.fused_add_rmsnorm(x, res, w, 1e-6)
    assert summed.dtype == ref_summed.dtype and torch.equal(summed, ref_summed)
    assert_near(normed, ref_normed)


@needs_triton
def test_rmsnorm_mixed_dtypes_and_strided_rows():
    """bf16 activations with an fp32 weight (an EAGLE head evaluated under autocast) give the
    reference's fp32 result; rows of a wider tensor are read in place."""
    gen = torch.Generator().manual_seed(7)
    wide = randn(6, 128, dtype=torch.bfloat16, gen=gen)  # [T, 2H]
    x = wide[:, :64]  # [T, H] rows with stride 128
    res = randn(6, 64, dtype=torch.bfloat16, gen=gen)
    w = randn(64, dtype=torch.float32, gen=gen)  # [H] fp32
    assert_near(trms.rmsnorm_triton(x, w, 1e-5), rmsnorm.rmsnorm(x, w, 1e-5))
    normed, summed = trms.fused_add_rmsnorm_triton(x, res, w, 1e-5)
    ref_normed, ref_summed = rmsnorm.fused_add_rmsnorm(x, res, w, 1e-5)
    assert normed.dtype == torch.float32 and torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,HQ,HKV,D", [(1, 9, 3, 64), (7, 4, 4, 64), (3, 6, 2, 128), (2, 3, 1, 80)])
def test_rope(T, HQ, HKV, D, dtype):
    gen = torch.Generator().manual_seed(T * HQ * D)
    q = randn(T, HQ, D, dtype=dtype, gen=gen)  # [T, Hq, D]
    k = randn(T, HKV, D, dtype=dtype, gen=gen)  # [T, Hkv, D]
    pos = torch.randint(0, 4096, (T,), generator=gen).to(DEV)  # [T] int64
    inv_freq = rope_inv_freq(D, 10000.0).to(DEV)  # [D/2] fp32
    got_q, got_k = trope.rope_triton(q, k, pos, inv_freq)
    want_q, want_k = rope.rope(q, k, pos, inv_freq)
    assert_near(got_q, want_q)
    assert_near(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_at_one_forwards_angles_equals_rope_bit_for_bit(dtype):
    """The angles a forward makes once (layer_ops.rotary) rotate every layer's q and k to
    exactly what the reference makes per call: on the CPU, where the reference runs."""
    gen = torch.Generator().manual_seed(11)
    pos = torch.tensor([0, 5, 4095, 17])  # [T] int64
    inv_freq = rope_inv_freq(64, 10000.0)  # [D/2] fp32
    rot = layer_ops.rotary(pos, inv_freq)
    assert rot.cos is not None and rot.cos.dtype == torch.float32
    for _ in range(2):  # two layers, one table
        q, k = randn(4, 6, 64, dtype=dtype, gen=gen).cpu(), randn(4, 2, 64, dtype=dtype, gen=gen).cpu()
        for got, want in zip(layer_ops.rope_at(q, k, rot), rope.rope(q, k, pos, inv_freq)):
            assert got.dtype == dtype and torch.equal(got, want)


@needs_triton
def test_rope_strided_heads():
    """q and k as views into one fused projection output (rows wider than the heads)."""
    gen = torch.Generator().manual_seed(3)
    qkv = randn(5, 6 * 64, dtype=torch.float32, gen=gen)  # [T, (Hq + 2 Hkv) D]
    q, k = qkv[:, :256].view(5, 4, 64), qkv[:, 256:320].view(5, 1, 64)
    pos = torch.arange(5).to(DEV) + 100  # [T] int64
    inv_freq = rope_inv_freq(64, 500000.0).to(DEV)
    for got, want in zip(trope.rope_triton(q, k, pos, inv_freq), rope.rope(q, k, pos, inv_freq)):
        assert got.is_contiguous()
        assert_near(got, want)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 1536), (5, 100), (3, 2560)])
def test_silu_and_mul(T, I, dtype):
    gen = torch.Generator().manual_seed(T * I)
    gate = randn(T, I, dtype=dtype, gen=gen, scale=4.0)  # [T, I]
    up = randn(T, I, dtype=dtype, gen=gen)  # [T, I]
    assert_near(tact.silu_and_mul_triton(gate, up), activation.silu_and_mul(gate, up))


@needs_triton
@pytest.mark.parametrize("T,I", [(1, 1536), (5, 100)])
def test_silu_and_mul_on_slices_of_a_fused_output(T, I):
    """gate and up as column halves of one [T, 2I] GEMM output (strided rows, no copy)."""
    gate_up = randn(T, 2 * I, dtype=torch.float32, gen=torch.Generator().manual_seed(I), scale=4.0)
    gate, up = gate_up.split(I, -1)  # [T, I] each, row stride 2I
    got = tact.silu_and_mul_triton(gate, up)
    assert got.is_contiguous()
    assert_near(got, activation.silu_and_mul(gate, up))


def _caches(slots, H, D, dtype, gen):
    return randn(slots, H, D, dtype=dtype, gen=gen), randn(slots, H, D, dtype=dtype, gen=gen)  # [slots, H, D]


@needs_triton
@pytest.mark.parametrize("cache_dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("T,HQ,HKV,D", [(1, 9, 3, 64), (7, 4, 4, 64), (5, 8, 1, 128), (3, 6, 2, 80)])
def test_store_kv(T, HQ, HKV, D, cache_dtype, kv_dtype):
    check_store_kv(T, HQ, HKV, D, cache_dtype, kv_dtype, slots=64)


def check_store_kv(T, HQ, HKV, D, cache_dtype, kv_dtype, slots):
    """K contiguous, V a column slice of one fused q/k/v output, written at scattered slots
    (pages 0 and beyond): the caches equal the reference's bit for bit, other slots untouched."""
    gen = torch.Generator().manual_seed(T * HKV * D)
    qkv = randn(T, (HQ + 2 * HKV) * D, dtype=kv_dtype, gen=gen)  # [T, (Hq + 2 Hkv) D]
    k = qkv[:, HQ * D:(HQ + HKV) * D].reshape(T, HKV, D).contiguous()  # [T, Hkv, D]
    v = qkv[:, (HQ + HKV) * D:].view(T, HKV, D)  # [T, Hkv, D], token stride (Hq + 2 Hkv) D
    loc = torch.randperm(slots, generator=gen)[:T].to(DEV)  # [T] int64, distinct slots
    got_k, got_v = _caches(slots, HKV, D, cache_dtype, gen)
    want_k, want_v = got_k.clone(), got_v.clone()
    tkv.store_kv_triton(got_k, got_v, loc, k, v)
    kv_store.store_kv(want_k, want_v, loc, k, v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@needs_triton
def test_store_kv_refuses_layouts_it_does_not_address():
    gen = torch.Generator().manual_seed(5)
    kc, vc = _caches(8, 2, 16, torch.float32, gen)
    k = randn(3, 16, 2, dtype=torch.float32, gen=gen).transpose(1, 2)  # [T, H, D], heads not contiguous
    v = randn(3, 2, 16, dtype=torch.float32, gen=gen)
    assert not tkv.store_kv_fits(kc, vc, k, v)
    with pytest.raises(ValueError, match="contiguous"):
        tkv.store_kv_triton(kc, vc, torch.arange(3).to(DEV), k, v)


def test_cpu_dispatch_is_the_reference():
    """On CPU tensors every op is its torch reference, bit for bit (the CPU model path)."""
    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    q, k = torch.randn(3, 4, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    pos, inv_freq = torch.tensor([0, 5, 9]), rope_inv_freq(64, 10000.0)
    assert not layer_ops.use_triton(x)
    assert torch.equal(layer_ops.rmsnorm(x, w, 1e-5), rmsnorm.rmsnorm(x, w, 1e-5))
    for got, want in [(layer_ops.fused_add_rmsnorm(x, res, w, 1e-5),
                       rmsnorm.fused_add_rmsnorm(x, res, w, 1e-5)),
                      (layer_ops.rope(q, k, pos, inv_freq), rope.rope(q, k, pos, inv_freq))]:
        assert all(torch.equal(g, h) for g, h in zip(got, want))
    assert torch.equal(layer_ops.silu_and_mul(x, res), activation.silu_and_mul(x, res))
    kc, vc = torch.zeros(8, 2, 64), torch.zeros(8, 2, 64)
    layer_ops.store_kv(kc, vc, torch.tensor([6, 1, 3]), k, k + 1)
    assert torch.equal(kc[[6, 1, 3]], k) and torch.equal(vc[[6, 1, 3]], k + 1) and not kc[[0, 2, 4, 5, 7]].any()
