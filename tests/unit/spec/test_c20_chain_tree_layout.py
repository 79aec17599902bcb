"""C20 chain tree layout.

For K=1: positions seq_len + [0..N-1], first-child array [1,2,...,N-1,-1], no siblings,
and the draft-by-draft block of the mask is lower-triangular while the prefix columns
are all visible.
"""
from __future__ import annotations

import pytest
import torch

from kestrel_kernels.spec_tree import build_tree, expand_level, flatten_tree_mask, level_offset, organize_draft


def _chain_draft(B: int, S: int, gen: torch.Generator):
    """Grow a K=1 draft through the real level op; returns candidates and the chain tokens."""
    K = 1
    topk_p = torch.rand(B, K, generator=gen)
    topk_index = torch.randint(0, 50, (B, K), generator=gen)
    scores_l, tokens_l = [topk_p], [topk_index]
    parents_l = [torch.full((B, K), -1, dtype=torch.int64)]
    scores, lane_flat, chain = topk_p, torch.zeros(B, K, dtype=torch.int64), [topk_index]
    for level in range(2, S + 1):
        cp = torch.rand(B, K, K, generator=gen)
        ct = torch.randint(0, 50, (B, K, K), generator=gen)
        scores, new_tokens, lane_flat, _, cs, ctok, cpar = expand_level(
            scores, cp, ct, lane_flat, level_offset(level, K)
        )
        chain.append(new_tokens)
        scores_l.append(cs)
        tokens_l.append(ctok)
        parents_l.append(cpar)
    return (torch.cat(scores_l, 1), torch.cat(tokens_l, 1), torch.cat(parents_l, 1), torch.cat(chain, 1))


@pytest.mark.parametrize("S", [1, 3, 6])
def test_c20_chain_layout(S):
    g = torch.Generator().manual_seed(S)
    B, N = 3, S + 1
    scores, tokens, parent_flat, chain = _chain_draft(B, S, g)
    draft_tokens, parent_node, node_rank = organize_draft(scores, tokens, parent_flat, N)
    assert torch.equal(draft_tokens, chain)
    assert node_rank.tolist() == [list(range(N - 1))] * B  # a chain's scores fall along it
    assert parent_node.tolist() == [list(range(N - 1))] * B

    seq_lens = torch.tensor([5, 17, 1], dtype=torch.int64)
    verified = torch.tensor([1, 2, 3], dtype=torch.int64)
    info = build_tree(verified, draft_tokens, parent_node, seq_lens)

    assert info.positions.tolist() == [[s + d for d in range(N)] for s in seq_lens.tolist()]
    assert info.first_child.tolist() == [list(range(1, N)) + [-1]] * B
    assert info.next_sibling.tolist() == [[-1] * N] * B
    tril = torch.tril(torch.ones(N, N, dtype=torch.bool))
    for b in range(B):
        assert torch.equal(info.tree_mask[b], tril)

    flat = flatten_tree_mask(info.tree_mask, seq_lens)
    off = 0
    for b, L in enumerate(seq_lens.tolist()):
        blk = flat[off:off + N * (L + N)].view(N, L + N)
        off += N * (L + N)
        assert blk[:, :L].all(), "prefix columns are all visible"
        assert torch.equal(blk[:, L:], tril), "draft-by-draft block is lower-triangular"
    assert off == flat.numel()
