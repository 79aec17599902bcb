"""TokenToKVPool: per-layer views of one buffer, the all-layer move of accepted KV, and the
FP8 cache's stored form (kv_cache.dtype=fp8_e4m3)."""
from __future__ import annotations

import pytest
import torch

from actors.worker.kv_cache import TokenToKVPool, kv_cache_dtype

FP8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare FP8 tensors exactly."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_move_copies_every_layer_reading_sources_first(dtype):
    pool = TokenToKVPool(8, 3, 2, 4, dtype, "cpu")
    for layer in range(3):
        pool.store(layer, torch.arange(8), torch.randn(8, 2, 4), torch.randn(8, 2, 4))
    k0 = [bits(t).clone() for t in pool.k]
    v0 = [bits(t).clone() for t in pool.v]
    src, dst = torch.tensor([1, 2, 5, 6, 0]), torch.tensor([2, 1, 6, 7, 0])  # swap, chain, self
    pool.move(src, dst)
    for layer in range(3):
        want_k, want_v = k0[layer].clone(), v0[layer].clone()
        want_k[[2, 1, 6, 7]] = k0[layer][[1, 2, 5, 6]]
        want_v[[2, 1, 6, 7]] = v0[layer][[1, 2, 5, 6]]
        assert torch.equal(bits(pool.k[layer]), want_k) and torch.equal(bits(pool.v[layer]), want_v)


def test_layer_views_alias_the_buffer():
    pool = TokenToKVPool(4, 2, 1, 2, torch.float32, "cpu")
    pool.store(1, torch.tensor([3]), torch.ones(1, 1, 2), torch.full((1, 1, 2), 2.0))
    assert pool.k_all[1, 3].tolist() == [[1.0, 1.0]] and pool.v_all[1, 3].tolist() == [[2.0, 2.0]]
    assert pool.k[0].is_contiguous() and float(pool.k_all[0].abs().sum()) == 0.0


def test_accepted_kv_moves_when_the_tree_has_fewer_nodes_than_depths():
    """N=3 nodes, S=4 steps: accept lanes 3 and 4 can never hold a node. Here the path is
    root, node 2, node 1, so slots loc[1] and loc[2] swap contents; the empty lanes must
    not write loc[2] again (a second write from the old contents would undo the move)."""
    from types import SimpleNamespace

    from actors.spec.eagle_worker import EagleWorker
    pool = TokenToKVPool(8, 2, 1, 2, torch.float32, "cpu")
    for layer in range(2):
        pool.store(layer, torch.arange(8), torch.randn(8, 1, 2), torch.randn(8, 1, 2))
    before = [t.clone() for t in pool.k]
    fake = SimpleNamespace(S=4, N=3, w=SimpleNamespace(kv_pool=pool))
    loc = torch.tensor([[4, 5, 6]])  # [B=1, N] verify slots of nodes 0, 1, 2
    accept_index = torch.tensor([[0, 2, 1, -1, -1]])  # [B, S+1]
    EagleWorker._keep_accepted_kv(fake, loc, accept_index)
    for layer in range(2):
        assert torch.equal(pool.k[layer][5], before[layer][6])  # depth 1 <- node 2
        assert torch.equal(pool.k[layer][6], before[layer][5])  # depth 2 <- node 1
        assert torch.equal(pool.k[layer][4], before[layer][4])


def test_req_to_token_write_many_equals_writes_in_order():
    """One batched scatter for a step's row growths; overlapping writes keep their order."""
    import numpy as np

    from actors.worker.kv_cache import ReqToTokenPool
    rng = np.random.default_rng(0)
    for overlapping in (False, True):
        writes = [(1, 0, rng.integers(1, 100, 5)), (3, 16, rng.integers(1, 100, 16)),
                  (2, 7, rng.integers(1, 100, 1))]
        if overlapping:
            writes.append((3, 20, rng.integers(100, 200, 4)))  # rewrites part of row 3
        one, many = ReqToTokenPool(4, 40, "cpu"), ReqToTokenPool(4, 40, "cpu")
        for row, start, slots in writes:
            one.write(row, start, torch.from_numpy(slots))
        many.write_many(writes)
        assert torch.equal(one.req_to_token, many.req_to_token), overlapping
        assert int(many.req_to_token[3, 20]) == int(writes[-1][2][0])


# ------------------------------------------------------------------ FP8 KV cache
def test_kv_cache_dtype_follows_the_setting():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8


def test_fp8_pool_has_per_layer_scales_of_one():
    pool = TokenToKVPool(16, 3, 2, 8, FP8, "cpu")
    assert pool.quantized and pool.k_all.dtype == pool.v_all.dtype == FP8
    assert pool.k_scale_all.tolist() == pool.v_scale_all.tolist() == [1.0, 1.0, 1.0]
    assert pool.k_scale[2].shape == (1,) and pool.k_scale[2].data_ptr() == pool.k_scale_all[2:].data_ptr()
    plain = TokenToKVPool(16, 3, 2, 8, torch.bfloat16, "cpu")
    assert not plain.quantized and plain.k_scale == plain.v_scale == [None] * 3


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_store_then_read_is_within_e4m3_precision(k_scale, v_scale, dtype):
    """Each value comes back as its E4M3 rounding times the scale: within half a step of
    3 mantissa bits (2^-4 relative), or of the smallest subnormal (2^-10 * scale) near 0."""
    gen = torch.Generator().manual_seed(0)
    pool = TokenToKVPool(64, 2, 2, 16, FP8, "cpu")
    pool.k_scale_all.fill_(k_scale)
    pool.v_scale_all.fill_(v_scale)
    # [64, 2, 16] each: subnormals to near the range's top (448 * scale; randn stays under 5)
    k = (torch.randn(64, 2, 16, generator=gen) * torch.logspace(-4, 1.9, 16) * k_scale).to(dtype)
    v = (torch.randn(64, 2, 16, generator=gen) * torch.logspace(-4, 1.9, 16) * v_scale).to(dtype)
    loc = torch.randperm(64, generator=gen)
    pool.store(1, loc, k, v)
    kr, vr = pool.read(1, loc, dtype)
    assert kr.dtype == vr.dtype == dtype
    for x, back, scale in ((k, kr, k_scale), (v, vr, v_scale)):
        x, back = x.float(), back.float()
        err = (back - x).abs()
        assert (err <= x.abs() * 2 ** -4 + 2 ** -10 * scale + x.abs() * 2 ** -8).all()  # bf16 read: +2^-8
        assert (err > 0).any()  # really rounded to 3 mantissa bits
    assert float(pool.k_all[0].float().abs().sum()) == 0.0  # layer 0 untouched


def test_fp8_store_saturates_past_the_range():
    pool = TokenToKVPool(4, 1, 1, 4, FP8, "cpu")
    pool.k_scale_all.fill_(0.5)  # a stored 448 stands for 224
    k = torch.tensor([[[1000.0, -1000.0, 223.0, 0.0]]])  # [1, 1, 4]
    pool.store(0, torch.tensor([2]), k, k)
    kr, vr = pool.read(0, torch.tensor([2]), torch.float32)
    assert kr.flatten().tolist() == [224.0, -224.0, 224.0, 0.0]  # 446 rounds to 448
    assert vr.flatten().tolist() == [448.0, -448.0, 224.0, 0.0]  # V's scale is still 1
    assert torch.isfinite(pool.k_all.float()).all()


def rank_worker_stub(kv_dtype: torch.dtype, spec: bool, kv_cache_bytes: int | None = None):
    """What RankWorker's KV sizing reads: a 30-layer target (3 kv heads of 64), the draft's
    one layer when `spec`, and a memory plan leaving `kv_cache_bytes` for the KV."""
    from types import SimpleNamespace

    from actors.worker.rank_worker import RankWorker
    w = SimpleNamespace(
        arch=SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64), kv_dtype=kv_dtype,
        window=1, memory=SimpleNamespace(kv_cache=kv_cache_bytes),
        cfg=SimpleNamespace(draft=SimpleNamespace(enabled=spec), model=SimpleNamespace(max_model_len=100),
                            kv_cache=SimpleNamespace(num_slots=None, page_size=1)))
    w._kv_bytes_per_slot = lambda: RankWorker._kv_bytes_per_slot(w)
    w._num_slots = lambda: RankWorker._num_slots(w)
    return w


@pytest.mark.parametrize("spec", [False, True])
def test_an_fp8_cache_holds_twice_the_slots(spec):
    """A byte a value: half of bfloat16's slot (target layers and the draft's one layer
    alike), so the same memory plan gives twice the slots."""
    bf16 = rank_worker_stub(torch.bfloat16, spec)._kv_bytes_per_slot()
    fp8 = rank_worker_stub(FP8, spec)._kv_bytes_per_slot()
    assert fp8 == (31 if spec else 30) * 2 * 3 * 64 and bf16 == 2 * fp8
    assert rank_worker_stub(torch.bfloat16, spec, 1000 * bf16)._num_slots() == 1000
    assert rank_worker_stub(FP8, spec, 1000 * bf16)._num_slots() == 2000


def test_kv_cache_dtype_setting_is_checked():
    from configs.schema import load_config
    assert load_config(None, []).kv_cache.dtype == "auto"
    assert load_config(None, ["kv_cache.dtype=fp8_e4m3"]).kv_cache.dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache.dtype"):
        load_config(None, ["kv_cache.dtype=fp8"])
