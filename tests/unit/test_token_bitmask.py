"""kestrel_kernels/token_bitmask.py against xgrammar's own CPU kernel, on random bitmasks, with a
model vocabulary wider than the tokenizer's (its padding ids are disallowed); masks applied
in place, to rows of any leading shape."""
import pytest
import torch

from kestrel_kernels.token_bitmask import disallowed_ids, mask_logits_


@pytest.mark.parametrize("V", [64, 100, 49152])
def test_matches_xgrammar(V):
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(V)
    W = (V + 31) // 32
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, W), dtype=torch.int32, generator=g)
    logits = torch.randn(5, V, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    got = logits.clone()
    assert mask_logits_(got, bitmask) is got and torch.equal(got, want)


def test_ids_past_the_mask_are_disallowed():
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)  # 32 ids allowed
    off = disallowed_ids(bitmask, 40)
    assert off[:, 32:].all() and not off[:, :32].any()
    out = mask_logits_(torch.zeros(2, 40), bitmask)
    assert torch.isinf(out[:, 32:]).all() and (out[:, :32] == 0).all()


def test_tree_nodes_take_their_own_masks():
    """[B, N, V] logits with [B, N, W] masks: each node its own row of words."""
    g = torch.Generator().manual_seed(7)
    B, N, V = 3, 4, 96
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, N, 3), dtype=torch.int32, generator=g)
    logits = torch.randn(B, N, V, generator=g)
    want = logits.reshape(B * N, V).clone()
    for r, row in enumerate(bitmask.reshape(B * N, 3)):
        want[r] = mask_logits_(want[r:r + 1], row[None])[0]
    assert torch.equal(mask_logits_(logits, bitmask).reshape(B * N, V), want)
