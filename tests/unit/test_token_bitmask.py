"""kernels/token_bitmask.py against xgrammar's own CPU kernel, on random bitmasks, with a
model vocabulary wider than the tokenizer's (its padding ids are disallowed)."""
import pytest
import torch

from kernels.token_bitmask import apply_token_bitmask, unpack_bitmask


@pytest.mark.parametrize("V", [64, 100, 49152])
def test_matches_xgrammar(V):
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(V)
    W = (V + 31) // 32
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, W), dtype=torch.int32, generator=g)
    logits = torch.randn(5, V, generator=g)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    assert torch.equal(apply_token_bitmask(logits, bitmask), want)


def test_ids_past_the_mask_are_disallowed():
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)  # 32 ids allowed
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed[:, :32].all() and not allowed[:, 32:].any()
    out = apply_token_bitmask(torch.zeros(2, 40), bitmask)
    assert torch.isinf(out[:, 32:]).all() and (out[:, :32] == 0).all()
