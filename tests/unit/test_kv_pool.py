"""TokenToKVPool: per-layer views of one buffer, and the all-layer move of accepted KV."""
from __future__ import annotations

import torch

from actors.worker.kv_cache import TokenToKVPool


def test_move_copies_every_layer_reading_sources_first():
    pool = TokenToKVPool(8, 3, 2, 4, torch.float32, "cpu")
    for layer in range(3):
        pool.store(layer, torch.arange(8), torch.randn(8, 2, 4), torch.randn(8, 2, 4))
    k0 = [t.clone() for t in pool.k]
    v0 = [t.clone() for t in pool.v]
    src, dst = torch.tensor([1, 2, 5, 6, 0]), torch.tensor([2, 1, 6, 7, 0])  # swap, chain, self
    pool.move(src, dst)
    for layer in range(3):
        want_k, want_v = k0[layer].clone(), v0[layer].clone()
        want_k[[2, 1, 6, 7]] = k0[layer][[1, 2, 5, 6]]
        want_v[[2, 1, 6, 7]] = v0[layer][[1, 2, 5, 6]]
        assert torch.equal(pool.k[layer], want_k) and torch.equal(pool.v[layer], want_v)


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
