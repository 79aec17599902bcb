"""A long prefill chunk's attention by cuDNN (kestrel_kernels/library_attention.py) on the
GPU: the cuDNN call against its fp32 reference, the gathered two-part chunk against the
Triton kernel on a paged cache, and TritonBackend routing long chunks to it beside the same
backend with the route off. tests/unit/test_library_attention.py runs the same logic with
the reference on the CPU."""
from __future__ import annotations

import pytest
import torch

from actors.attention.triton_backend import TritonBackend
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.worker.kv_cache import ReqToTokenPool, TokenToKVPool
from kestrel_kernels import library_attention as la
from kestrel_kernels.triton_attention import paged_attention

H, HKV, D = 28, 4, 128  # Qwen2.5-7B's heads
DEV = torch.device("cuda")


def randn(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)


def test_the_layout_is_supported():
    assert la.library_attention_supported(torch.bfloat16, H, HKV, D, DEV) is None
    assert "bfloat16 or float16" in la.library_attention_supported(torch.float32, H, HKV, D, DEV)


@pytest.mark.parametrize("causal,sq,sk", [(True, 300, 300), (False, 300, 700)])
def test_cudnn_matches_the_reference(causal, sq, sk):
    q = randn(1, H, sq, D, seed=1)
    k, v = randn(1, HKV, sk, D, seed=2), randn(1, HKV, sk, D, seed=3)
    out, lse = la.attend_with_lse(q, k, v, causal, D ** -0.5)
    want, want_lse = la.attend_with_lse_ref(q, k, v, causal, D ** -0.5)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.float(), want_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("prefix,C", [(0, 1500), (2500, 1500), (9000, 1100)])  # 9000: two blocks and a rest
def test_chunk_matches_the_triton_kernel(prefix, C):
    S = prefix + C
    k_cache, v_cache = randn(S + 64, HKV, D, seed=4), randn(S + 64, HKV, D, seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    slots = torch.randperm(S + 64, generator=g, device="cuda")[:S]  # [S] int64, scattered
    q = randn(C, H, D, seed=7)
    got = la.chunk_attention(q, k_cache, v_cache, slots, prefix, D ** -0.5)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
    want = paged_attention(q, k_cache, v_cache, slots.view(1, S), t([0]), t([prefix]), t([C]),
                           t([0, C]), C, scale=D ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_every_planned_shape_runs():
    shapes = la.plan_shapes(1024, 1536, 9000)
    # causal 1024..5632 (up to a block's rest before the longest chunk), a 4096-key prefix for each query bucket
    assert len(shapes) == 10 + 2 and shapes[-1] == (False, 1536, 4096)
    la.warm_up(H, HKV, D, torch.bfloat16, DEV, shapes)


def test_the_backend_routes_long_chunks_and_keeps_the_rest_on_the_kernel():
    qlens, prefix = [1500, 7, 1200], [2000, 50, 0]
    L = max(p + n for p, n in zip(prefix, qlens))
    rt = ReqToTokenPool(4, L, DEV)
    slots = torch.randperm(3 * L, device="cuda")
    for b in range(3):
        rt.req_to_token[b + 1, :L] = slots[b * L:(b + 1) * L]
    pool = TokenToKVPool(3 * L, 1, HKV, D, torch.bfloat16, DEV)
    pool.k[0].copy_(randn(3 * L, HKV, D, seed=8))
    pool.v[0].copy_(randn(3 * L, HKV, D, seed=9))
    T = sum(qlens)
    q, k, v = randn(T, H, D, seed=10), randn(T, HKV, D, seed=11), randn(T, HKV, D, seed=12)
    out_loc = torch.cat([rt.req_to_token[b + 1, p:p + n] for b, (p, n) in enumerate(zip(prefix, qlens))])
    positions = torch.cat([torch.arange(p, p + n, device=DEV) for p, n in zip(prefix, qlens)])
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731

    def run(min_tokens):
        fb = ForwardBatch(ForwardMode.EXTEND, torch.zeros(T, dtype=torch.int64, device=DEV), positions,
                          out_loc, t([1, 2, 3]), t(prefix), list(qlens))
        backend = TritonBackend(pool, rt, D ** -0.5, library_min_tokens=min_tokens)
        assert backend.library_min_tokens == min_tokens
        backend.init_forward_metadata(fb)
        return backend.forward(q, k, v, 0, fb), fb.attn_meta

    got, meta = run(1024)
    assert [c[:3] for c in meta.chunks] == [(0, 1500, 2000), (1507, 1200, 0)]
    want, _ = run(0)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got[1500:1507], want[1500:1507])  # the short request: the same kernel
