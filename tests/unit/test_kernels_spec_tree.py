"""kestrel_kernels.spec_tree (draft-tree growth, selection, layout) and kestrel_kernels.cache_loc."""
from __future__ import annotations

import random

import pytest
import torch

from kestrel_kernels.cache_loc import assign_cache_locs, kv_indices
from kestrel_kernels.spec_tree import (
    build_tree,
    expand_level,
    flatten_tree_mask,
    level_offset,
    organize_draft,
    topk_probs,
)


# ---------------------------------------------------------------------------- helpers
def _grow_draft(B: int, K: int, S: int, V: int, gen: torch.Generator, quantize: bool = True):
    """Run S draft levels with random (optionally coarsely quantised -> tied) probabilities.

    Returns the concatenated candidate lists scores/tokens/parent_flat [B, M] with
    M = K + (S-1)*K*K, as the draft-decode loop would build them.
    """

    def rand_topk(rows):
        p = torch.rand(rows, K, generator=gen)
        if quantize:
            p = torch.round(p * 4) / 4 + 0.25  # values in {0.25, .., 1.25} -> many ties
            p = p / 1.25
        p = torch.sort(p, dim=-1, descending=True).values  # [rows, K] float32
        tok = torch.randint(0, V, (rows, K), generator=gen)  # [rows, K] int64
        return p, tok

    topk_p, topk_index = rand_topk(B)
    scores_l = [topk_p]
    tokens_l = [topk_index]
    parents_l = [torch.full((B, K), -1, dtype=torch.int64)]
    scores = topk_p
    lane_flat = torch.arange(K).expand(B, K).clone()
    for level in range(2, S + 1):
        cp, ct = rand_topk(B * K)
        (scores, _tok, lane_flat, _pl, cs, ctk, cpf) = expand_level(
            scores, cp.view(B, K, K), ct.view(B, K, K), lane_flat, level_offset(level, K)
        )
        scores_l.append(cs)
        tokens_l.append(ctk)
        parents_l.append(cpf)
    return torch.cat(scores_l, 1), torch.cat(tokens_l, 1), torch.cat(parents_l, 1)


def _ancestors(parent: list[int], i: int) -> set[int]:
    out = {i}
    while parent[i] >= 0:
        i = parent[i]
        out.add(i)
    return out


# ---------------------------------------------------------------------------- topk_probs
def test_topk_probs_values_and_stable_ties():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, -1.0], [5.0, 1.0, 1.0, 1.0, 1.0]])
    p, idx = topk_probs(logits, 3)
    assert p.dtype == torch.float32 and idx.dtype == torch.int64 and p.shape == (2, 3)
    assert idx.tolist() == [[1, 3, 2], [0, 1, 2]]
    soft = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(p, torch.gather(soft, 1, idx))


# ---------------------------------------------------------------------------- expand_level
def test_level_offsets():
    K = 3
    assert [level_offset(lv, K) for lv in (1, 2, 3, 4)] == [0, 3, 12, 21]


@pytest.mark.parametrize("K", [1, 2, 4])
def test_expand_level_matches_bruteforce(K):
    g = torch.Generator().manual_seed(10 + K)
    B = 16
    parent_scores = torch.rand(B, K, generator=g)
    child_probs = torch.round(torch.rand(B, K, K, generator=g) * 3) / 3  # ties
    parent_scores[::3] = 0.5  # equal lanes -> tied candidates across lanes
    child_tokens = torch.randint(0, 50, (B, K, K), generator=g)
    lane_flat = torch.randint(0, 40, (B, K), generator=g)
    off = 17
    out = expand_level(parent_scores, child_probs, child_tokens, lane_flat, off)
    new_scores, new_tokens, new_lane_flat, parent_lane, cand_scores, cand_tokens, cand_parent = out
    for t, shape in zip(out, [(B, K)] * 4 + [(B, K * K)] * 3):
        assert t.shape == shape
    for t in (new_tokens, new_lane_flat, parent_lane, cand_tokens, cand_parent):
        assert t.dtype == torch.int64
    for b in range(B):
        cands = []
        for lane in range(K):
            for c in range(K):
                j = lane * K + c
                s = float(parent_scores[b, lane]) * float(child_probs[b, lane, c])
                cands.append((s, j))
                assert float(cand_scores[b, j]) == pytest.approx(s, rel=1e-6, abs=0)
                assert int(cand_tokens[b, j]) == int(child_tokens[b, lane, c])
                assert int(cand_parent[b, j]) == int(lane_flat[b, lane])
        # best K by score; ties toward the lower j
        best = sorted(cands, key=lambda sj: (-float(cand_scores[b, sj[1]]), sj[1]))[:K]
        js = [j for _, j in best]
        assert new_lane_flat[b].tolist() == [off + j for j in js]
        assert parent_lane[b].tolist() == [j // K for j in js]
        assert new_tokens[b].tolist() == [int(child_tokens[b, j // K, j % K]) for j in js]
        torch.testing.assert_close(new_scores[b], cand_scores[b, js])


# ---------------------------------------------------------------------------- organize_draft
def _check_organized(scores, tokens, parent_flat, N, draft_tokens, parent_node, node_rank):
    B, M = scores.shape
    assert draft_tokens.shape == parent_node.shape == node_rank.shape == (B, N - 1)
    assert draft_tokens.dtype == parent_node.dtype == node_rank.dtype == torch.int64
    for b in range(B):
        sc = scores[b].tolist()
        by_score = sorted(range(M), key=lambda j: (-sc[j], j))
        picked = sorted(by_score[: N - 1])
        assert draft_tokens[b].tolist() == [int(tokens[b, j]) for j in picked]
        assert node_rank[b].tolist() == [by_score.index(j) for j in picked]
        pos = {j: i + 1 for i, j in enumerate(picked)}
        for i, j in enumerate(picked):
            pn = int(parent_node[b, i])
            assert 0 <= pn < i + 1, "parent must precede child"
            pf = int(parent_flat[b, j])
            assert pn == (0 if pf < 0 else pos[pf])


@pytest.mark.parametrize("K,S,N", [(1, 5, 6), (2, 3, 6), (4, 4, 16), (3, 5, 25), (2, 2, 5)])
def test_organize_draft_from_grown_tree(K, S, N):
    g = torch.Generator().manual_seed(K * 100 + S * 10 + N)
    scores, tokens, parent_flat = _grow_draft(24, K, S, 30, g, quantize=True)
    assert scores.shape[1] == K + (S - 1) * K * K
    _check_organized(scores, tokens, parent_flat, N, *organize_draft(scores, tokens, parent_flat, N))


@pytest.mark.parametrize("seed", range(4))
def test_organize_draft_random_valid_trees_with_ties(seed):
    """Arbitrary candidate forests (parent at a lower flat index, score <= parent's).

    Child factors include exactly 1.0, so a child can tie with its parent; the stable
    order must still pick the parent first.
    """
    rng = random.Random(seed)
    B, M = 20, 30
    scores = torch.zeros(B, M)
    parent_flat = torch.full((B, M), -1, dtype=torch.int64)
    for b in range(B):
        for j in range(M):
            p = rng.choice([-1, -1] + list(range(j))) if j else -1
            parent_flat[b, j] = p
            base = 1.0 if p < 0 else float(scores[b, p])
            scores[b, j] = base * rng.choice([1.0, 1.0, 0.5, 0.25, 0.75])
    tokens = torch.randint(0, 100, (B, M), generator=torch.Generator().manual_seed(seed))
    for N in (2, 8, M + 1):
        _check_organized(scores, tokens, parent_flat, N, *organize_draft(scores, tokens, parent_flat, N))


def test_organize_draft_rejects_too_many():
    with pytest.raises(ValueError):
        organize_draft(torch.ones(1, 3), torch.zeros(1, 3, dtype=torch.int64), torch.full((1, 3), -1), 5)


# ---------------------------------------------------------------------------- build_tree
def _random_parents(rng: random.Random, N: int) -> list[int]:
    return [rng.randrange(0, i + 1) for i in range(N - 1)]  # parent of node i+1 in [0, i]


@pytest.mark.parametrize("seed", range(5))
def test_build_tree_matches_python_walk(seed):
    rng = random.Random(seed)
    B, N = 12, rng.choice([2, 5, 9, 16])
    parent_node = torch.tensor([_random_parents(rng, N) for _ in range(B)], dtype=torch.int64)
    draft_tokens = torch.randint(0, 1000, (B, N - 1), generator=torch.Generator().manual_seed(seed))
    verified = torch.arange(B, dtype=torch.int64) + 5000
    seq_lens = torch.tensor([rng.randrange(1, 100) for _ in range(B)], dtype=torch.int64)
    info = build_tree(verified, draft_tokens, parent_node, seq_lens)

    for name in ("tokens", "parent", "depth", "positions", "first_child", "next_sibling", "retrieve_index"):
        t = getattr(info, name)
        assert t.shape == (B, N) and t.dtype == torch.int64, name
    assert info.tree_mask.shape == (B, N, N) and info.tree_mask.dtype == torch.bool

    for b in range(B):
        parent = [-1] + parent_node[b].tolist()
        assert info.parent[b].tolist() == parent
        assert info.tokens[b].tolist() == [5000 + b] + draft_tokens[b].tolist()
        children = {i: [c for c in range(N) if parent[c] == i] for i in range(N)}
        for i in range(N):
            anc = _ancestors(parent, i)
            assert info.tree_mask[b, i].tolist() == [j in anc for j in range(N)], (b, i)
            assert int(info.depth[b, i]) == len(anc) - 1
            assert int(info.positions[b, i]) == int(seq_lens[b]) + len(anc) - 1
            assert int(info.first_child[b, i]) == (children[i][0] if children[i] else -1)
            sibs = children[parent[i]] if parent[i] >= 0 else [i]
            later = [s for s in sibs if s > i]
            assert int(info.next_sibling[b, i]) == (later[0] if later else -1)
            assert int(info.retrieve_index[b, i]) == b * N + i


def test_build_tree_small_example():
    # root -> {1, 2}; 1 -> {3, 4}; 2 -> {5}
    info = build_tree(
        torch.tensor([7]), torch.tensor([[11, 12, 13, 14, 15]]), torch.tensor([[0, 0, 1, 1, 2]]),
        torch.tensor([10]),
    )
    assert info.depth.tolist() == [[0, 1, 1, 2, 2, 2]]
    assert info.positions.tolist() == [[10, 11, 11, 12, 12, 12]]
    assert info.first_child.tolist() == [[1, 3, 5, -1, -1, -1]]
    assert info.next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1]]
    assert info.tree_mask[0, 4].tolist() == [True, True, False, False, True, False]
    assert info.tree_mask[0, 5].tolist() == [True, False, True, False, False, True]


def test_flatten_tree_mask_layout():
    info = build_tree(torch.tensor([1, 2]), torch.tensor([[3, 4], [5, 6]]),
                      torch.tensor([[0, 0], [0, 1]]), torch.tensor([2, 3]))
    flat = flatten_tree_mask(info.tree_mask, torch.tensor([2, 3]))
    assert flat.dtype == torch.bool and flat.numel() == 3 * (2 + 3) + 3 * (3 + 3)
    blk0 = flat[:15].view(3, 5)
    blk1 = flat[15:].view(3, 6)
    assert blk0[:, :2].all() and blk1[:, :3].all()
    assert torch.equal(blk0[:, 2:], info.tree_mask[0]) and torch.equal(blk1[:, 3:], info.tree_mask[1])
    assert not blk0[1, 4] and not blk0[2, 3]  # siblings do not see each other
    assert blk1[2, 3:].tolist() == [True, True, True]  # chain node sees both ancestors


@pytest.mark.parametrize("K,S,N", [(2, 3, 6), (4, 5, 12)])
def test_draft_pipeline_end_to_end(K, S, N):
    """grow -> organize -> build: depth <= S, node tokens are the candidates' tokens."""
    g = torch.Generator().manual_seed(99)
    B = 10
    scores, tokens, parent_flat = _grow_draft(B, K, S, 20, g, quantize=False)
    draft_tokens, parent_node, _ = organize_draft(scores, tokens, parent_flat, N)
    info = build_tree(torch.zeros(B, dtype=torch.int64), draft_tokens, parent_node, torch.full((B,), 7))
    assert int(info.depth.max()) <= S
    assert (info.parent[:, 1:] >= 0).all()
    # every non-root node's mask row has exactly depth+1 visible nodes, all with smaller index
    idx = torch.arange(N)
    assert (info.tree_mask.sum(-1) == info.depth + 1).all()
    assert not (info.tree_mask & (idx[None, None, :] > idx[None, :, None])).any()


# ---------------------------------------------------------------------------- cache_loc
def test_assign_cache_locs_and_kv_indices():
    R, L = 5, 12
    req_to_token = (torch.arange(R * L, dtype=torch.int64).view(R, L) * 3 + 1)  # distinct slots
    req_pool_indices = torch.tensor([3, 0, 4], dtype=torch.int64)
    starts = torch.tensor([2, 0, 9], dtype=torch.int64)
    locs = assign_cache_locs(req_to_token, req_pool_indices, starts, 3)
    assert locs.dtype == torch.int64 and locs.shape == (9,)
    expected = []
    for r, s in zip(req_pool_indices.tolist(), starts.tolist()):
        expected += req_to_token[r, s:s + 3].tolist()
    assert locs.tolist() == expected

    seq_lens = torch.tensor([4, 0, 12], dtype=torch.int64)
    indptr, indices = kv_indices(req_to_token, req_pool_indices, seq_lens)
    assert indptr.tolist() == [0, 4, 4, 16]
    assert indices.dtype == torch.int64
    expected = []
    for r, n in zip(req_pool_indices.tolist(), seq_lens.tolist()):
        expected += req_to_token[r, :n].tolist()
    assert indices.tolist() == expected


# ---------------------------------------------------------------------------- nested trees
def _walk_target(info, truth: list[list[int]]) -> torch.Tensor:
    """The target's argmax at every node [B, N]: the next token of the row's `truth` where
    the node's path (root excluded) is a prefix of it, else 0 (no draft token is 0)."""
    B, N = info.tokens.shape
    out = torch.zeros(B, N, dtype=torch.int64)
    for b in range(B):
        parent, tok = info.parent[b].tolist(), info.tokens[b].tolist()
        for i in range(N):
            path, j = [], i
            while j > 0:
                path.append(tok[j])
                j = parent[j]
            path.reverse()
            if path == truth[b][:len(path)] and len(path) < len(truth[b]):
                out[b, i] = truth[b][len(path)]
    return out


@pytest.mark.parametrize("K,S,N", [(4, 5, 16), (2, 4, 10), (1, 5, 6)])
def test_nested_accepts_equal_the_smaller_trees_own_walk(K, S, N):
    """A tree of n < N nodes from the same candidates accepts, under greedy verification by
    the same target, what nested_accept_lengths reads off the N-node tree's walk: its
    node_rank < n-1 nodes are that tree. The target follows one path of the N-node tree per
    row (a random node's), so the smaller trees cut it where they lose a node."""
    from kestrel_kernels.verify import greedy_verify, nested_accept_lengths
    g = torch.Generator().manual_seed(K * 100 + S * 10 + N)
    B = 48
    scores, _, parent_flat = _grow_draft(B, K, S, 2, g, quantize=True)  # tied scores
    M = scores.shape[1]
    tokens = torch.arange(1, M + 1).expand(B, M).contiguous()  # [B, M] distinct, never 0

    def tree(n):
        draft_tokens, parent_node, node_rank = organize_draft(scores, tokens, parent_flat, n)
        return build_tree(torch.zeros(B, dtype=torch.int64), draft_tokens, parent_node,
                          torch.full((B,), 5)), node_rank

    big, rank = tree(N)
    truth = []
    for b in range(B):  # a random node's path, then one more token
        i, path = int(torch.randint(0, N, (1,), generator=g)), []
        while i > 0:
            path.append(int(big.tokens[b, i]))
            i = int(big.parent[b, i])
        truth.append(path[::-1] + [M + 1])

    def accept(info):
        return greedy_verify(info.tokens, _walk_target(info, truth), info.first_child, info.next_sibling, S)

    accept_index, accept_length, _ = accept(big)
    smaller = sorted({n for n in (2, 3, N // 2, N - 1) if 1 < n < N})
    got = nested_accept_lengths(accept_index, rank, smaller)  # [B, J] int64
    assert got.shape == (B, len(smaller)) and got.dtype == torch.int64
    for j, n in enumerate(smaller):
        want = accept(tree(n)[0])[1]
        assert torch.equal(got[:, j], want), n
        assert bool((want <= accept_length).all())
    assert bool((got[:, 0] < accept_length).any())  # the cut is seen, not only full accepts
