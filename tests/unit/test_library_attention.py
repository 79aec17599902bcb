"""kestrel_kernels.library_attention on the CPU, with the fp32 reference standing in for the
cuDNN call (tests/gpu/test_library_attention_gpu.py runs cuDNN itself): a chunk gathered
from a paged cache and attended in two parts, merged by their log-sum-exps, equals the
paged-attention reference; TritonBackend sends chunks of library_min_tokens queries or more
that way and the other requests of the batch through its kernel, with the same answer as
the torch-native backend."""
from __future__ import annotations

import pytest
import torch
import triton_interpreter  # before actors/kernels import triton: picks its interpreter without CUDA

from actors.attention import triton_backend
from actors.attention.torch_native import TorchNativeBackend
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.worker.kv_cache import ReqToTokenPool, TokenToKVPool
from kestrel_kernels import library_attention as la
from kestrel_kernels import triton_attention as ta

INTERPRETED, DEV, needs_triton = triton_interpreter.triton_setup(ta, "_paged_attn_kernel")
t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731


def paged(qlens, prefix, H, Hkv, D, seed=0):
    """Requests 1..B of a req_to_token table whose slots are scattered over the pool, a pool
    of random K/V, and the batch's q/k/v and slots."""
    g = torch.Generator().manual_seed(seed)
    L = max(p + n for p, n in zip(prefix, qlens))
    B = len(qlens)
    rt = ReqToTokenPool(B + 1, L, "cpu")
    perm = torch.randperm(B * L, generator=g)
    for b in range(B):
        rt.req_to_token[b + 1, :L] = perm[b * L:(b + 1) * L]
    rt.req_to_token = rt.req_to_token.to(DEV)
    pool = TokenToKVPool(B * L, 1, Hkv, D, torch.float32, DEV)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    T = sum(qlens)
    q = torch.randn(T, H, D, generator=g).to(DEV)  # [T, H, D] fp32
    k = torch.randn(T, Hkv, D, generator=g).to(DEV)  # [T, Hkv, D]
    v = torch.randn(T, Hkv, D, generator=g).to(DEV)
    out_loc = torch.cat([rt.req_to_token[b + 1, p:p + n] for b, (p, n) in enumerate(zip(prefix, qlens))])
    return rt, pool, q, k, v, out_loc


SMALL = {"block": 16, "bucket": 8}  # the shapes' rounding at this test's sizes


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 24)])
@pytest.mark.parametrize("prefix,rounding", [(0, {}), (37, {}), (5, SMALL), (37, SMALL), (64, SMALL)])
def test_two_parts_merged_equal_the_paged_reference(heads, prefix, rounding):
    H, Hkv, D = heads
    C = 23
    rt, pool, q, k, v, out_loc = paged([C], [prefix], H, Hkv, D, seed=prefix)
    pool.store(0, out_loc, k, v)
    slots = rt.req_to_token[1, :prefix + C]
    got = la.chunk_attention(q, pool.k[0], pool.v[0], slots, prefix, D ** -0.5,
                             attend=la.attend_with_lse_ref, **rounding)
    want = ta.paged_attention_ref(q, pool.k[0], pool.v[0], rt.req_to_token, t([1]), t([prefix]), t([C]),
                                  t([0, C]), C, scale=D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_reference_merge_weights_each_part_by_its_keys():
    """Attending over keys split at any point and merged equals attending over all of them."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 5, 8, generator=g)  # [1, H, Sq, D]
    k, v = torch.randn(1, 2, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g)  # [1, Hkv, Sk, D]
    want, want_lse = la.attend_with_lse_ref(q, k, v, False, 0.3)
    for cut in (1, 11, 29):
        o1, l1 = la.attend_with_lse_ref(q, k[:, :, :cut], v[:, :, :cut], False, 0.3)
        o2, l2 = la.attend_with_lse_ref(q, k[:, :, cut:], v[:, :, cut:], False, 0.3)
        torch.testing.assert_close(la.merge_by_lse(o1, l1, o2, l2), want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(torch.logaddexp(l1, l2), want_lse)


def test_plan_shapes_are_every_call_a_chunk_makes():
    """What warm-up builds is exactly what chunks of 10-20 queries after any prefix call."""
    lo, hi, max_len = 10, 20, 60
    seen = set()

    def record(q, k, v, causal, scale):
        seen.add((causal, q.shape[2], k.shape[2]))
        return la.attend_with_lse_ref(q, k, v, causal, scale)

    kv = torch.randn(max_len, 1, 8)  # [S, Hkv, D]
    for C in range(lo, hi + 1):
        for P in range(max_len - C + 1):
            la.chunk_attention(torch.randn(C, 2, 8), kv, kv, torch.arange(P + C), P, 1.0, attend=record, **SMALL)
    assert seen == set(la.plan_shapes(lo, hi, max_len, **SMALL))
    assert la.plan_shapes(30, 20, 60) == []


def test_only_cuda_runs_it():
    assert la.library_attention_supported(torch.bfloat16, 28, 4, 128, torch.device("cpu")) == "it needs CUDA"


@needs_triton
@pytest.mark.parametrize("qlens,prefix", [([20, 3, 17], [5, 40, 0]), ([18, 16], [0, 9])])
def test_the_backend_routes_long_chunks(monkeypatch, qlens, prefix):
    H, Hkv, D = 9, 3, 64
    rt, pool, q, k, v, out_loc = paged(qlens, prefix, H, Hkv, D, seed=len(qlens))
    T = sum(qlens)
    positions = torch.cat([torch.arange(p, p + n, device=DEV) for p, n in zip(prefix, qlens)])
    fb = lambda: ForwardBatch(ForwardMode.EXTEND, torch.zeros(T, dtype=torch.int64, device=DEV),  # noqa: E731
                              positions, out_loc, t(range(1, len(qlens) + 1)), t(prefix), list(qlens))
    native_pool = TokenToKVPool(pool.k[0].shape[0], 1, Hkv, D, torch.float32, DEV)
    native_pool.k[0].copy_(pool.k[0])
    native_pool.v[0].copy_(pool.v[0])
    native = TorchNativeBackend(native_pool, rt, D ** -0.5)
    nb = fb()
    native.init_forward_metadata(nb)
    want = native.forward(q, k, v, 0, nb)

    monkeypatch.setattr(triton_backend, "chunk_attention",
                        lambda *a: la.chunk_attention(*a, attend=la.attend_with_lse_ref, **SMALL))
    with pytest.raises(ValueError, match="library_prefill_min_tokens=16 cannot run here: it needs CUDA"):
        triton_backend.TritonBackend(pool, rt, D ** -0.5, library_min_tokens=16)
    backend = triton_backend.TritonBackend(pool, rt, D ** -0.5)
    backend.library_min_tokens = 16  # the route, with the reference standing in for cuDNN
    b = fb()
    backend.init_forward_metadata(b)
    long = [i for i, n in enumerate(qlens) if n >= 16]
    assert [c[1] for c in b.attn_meta.chunks] == [qlens[i] for i in long]
    assert (b.attn_meta.rest is None) == (len(long) == len(qlens))
    torch.testing.assert_close(backend.forward(q, k, v, 0, b), want, atol=1e-4, rtol=1e-4)


def test_masks_and_short_chunks_stay_on_the_kernel():
    H, Hkv, D = 4, 2, 16
    rt, pool, q, k, v, out_loc = paged([20, 4], [3, 0], H, Hkv, D)
    backend = triton_backend.TritonBackend(pool, rt, D ** -0.5)
    backend.library_min_tokens = 32
    positions = torch.cat([torch.arange(3, 23), torch.arange(0, 4)]).to(DEV)
    fb = ForwardBatch(ForwardMode.EXTEND, torch.zeros(24, dtype=torch.int64, device=DEV), positions,
                      out_loc, t([1, 2]), t([3, 0]), [20, 4])
    backend.init_forward_metadata(fb)
    assert isinstance(fb.attn_meta, triton_backend.TritonMeta)  # 20 < 32
    backend.library_min_tokens = 16
    fb.custom_mask = torch.ones(2, 20, 20, dtype=torch.bool, device=DEV)
    backend.init_forward_metadata(fb)
    assert isinstance(fb.attn_meta, triton_backend.TritonMeta)  # a mask: the kernel's
