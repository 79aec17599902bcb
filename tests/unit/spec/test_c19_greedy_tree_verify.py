"""C19 greedy tree verify.

In a tree with siblings, the walk follows the first child whose token equals the
target's argmax at the current node, and stops at a node with no matching child; the
bonus token is the target argmax at the last accepted node.
"""
from __future__ import annotations

import random

import pytest
import torch

from kestrel_kernels.spec_tree import build_tree
from kestrel_kernels.verify import greedy_verify


def _verify(tokens, parents, target, S):
    """tokens [N] (node 0 = root), parents of nodes 1..N-1, target argmax [N]."""
    info = build_tree(
        torch.tensor([tokens[0]]), torch.tensor([tokens[1:]]), torch.tensor([parents]), torch.tensor([0])
    )
    return greedy_verify(info.tokens, torch.tensor([target]), info.first_child, info.next_sibling, S)


# Tree: root(0) -> 1:a, 2:b, 3:b ; 1 -> 4:d ; 2 -> 5:d ; 3 -> 6:e ; 5 -> 7:f
TOK = [100, 1, 2, 2, 4, 4, 5, 6]
PAR = [0, 0, 0, 1, 2, 3, 5]
S = 3


def test_c19_follows_matching_sibling_then_bonus():
    # root wants b: skip 1 (a), take 2 (first b); at 2 wants d: take 5; at 5 wants z=9: stop.
    target = [2, 7, 4, 7, 7, 9, 7, 7]
    ai, al, pr = _verify(TOK, PAR, target, S)
    assert ai.tolist() == [[0, 2, 5, -1]]
    assert al.tolist() == [3]
    assert pr.tolist() == [[2, 4, 9, -1]]


def test_c19_first_matching_child_wins_no_backtracking():
    # root wants b: nodes 2 and 3 both hold b; the walk takes 2 (first in sibling order)
    # even though only 3 has a child (6:e) matching the target at the next step.
    target = [2, 7, 8, 5, 7, 7, 7, 7]
    ai, al, pr = _verify(TOK, PAR, target, S)
    assert ai.tolist() == [[0, 2, -1, -1]]
    assert al.tolist() == [2]
    assert pr.tolist() == [[2, 8, -1, -1]]  # bonus = target argmax at node 2


def test_c19_full_depth_path_and_root_miss():
    target = [2, 7, 4, 7, 7, 6, 7, 3]  # 0 -> 2 -> 5 -> 7, bonus = target[7] = 3
    ai, al, pr = _verify(TOK, PAR, target, S)
    assert ai.tolist() == [[0, 2, 5, 7]] and al.tolist() == [4] and pr.tolist() == [[2, 4, 6, 3]]
    target = [9, 7, 4, 7, 7, 6, 7, 3]  # no child of the root holds 9
    ai, al, pr = _verify(TOK, PAR, target, S)
    assert ai.tolist() == [[0, -1, -1, -1]] and al.tolist() == [1] and pr.tolist() == [[9, -1, -1, -1]]


def test_c19_depth_limit():
    # Same walk as the full-depth path but S=2: stop after two drafts, bonus at node 5.
    target = [2, 7, 4, 7, 7, 6, 7, 3]
    ai, al, pr = _verify(TOK, PAR, target, 2)
    assert ai.tolist() == [[0, 2, 5]] and al.tolist() == [3] and pr.tolist() == [[2, 4, 6]]


# ------------------------------------------------------------------ randomized vs oracle
def _oracle(tokens: list[int], parent: list[int], target: list[int], S: int):
    """Straightforward walk over a dict of children lists (sibling order = node order)."""
    children: dict[int, list[int]] = {}
    for node, p in enumerate(parent):
        if p >= 0:
            children.setdefault(p, []).append(node)
    path, emitted, cur = [0], [], 0
    while len(path) <= S:
        nxt = next((c for c in children.get(cur, []) if tokens[c] == target[cur]), None)
        if nxt is None:
            break
        emitted.append(tokens[nxt])
        path.append(nxt)
        cur = nxt
    emitted.append(target[cur])
    pad = S + 1 - len(path)
    return path + [-1] * pad, len(path), emitted + [-1] * pad


@pytest.mark.parametrize("seed", range(6))
def test_c19_random_trees_match_oracle(seed):
    rng = random.Random(seed)
    B, N = 64, rng.choice([2, 4, 7, 12])
    vocab = 3  # small vocabulary so that matches (and duplicate siblings) are common
    parents = [[rng.randrange(0, i + 1) for i in range(N - 1)] for _ in range(B)]
    tokens = [[rng.randrange(vocab) for _ in range(N)] for _ in range(B)]
    target = [[rng.randrange(vocab) for _ in range(N)] for _ in range(B)]
    info = build_tree(
        torch.tensor([t[0] for t in tokens]), torch.tensor([t[1:] for t in tokens]),
        torch.tensor(parents), torch.zeros(B, dtype=torch.int64),
    )
    S = int(info.depth.max()) if seed % 2 == 0 else max(1, int(info.depth.max()) - 1)
    ai, al, pr = greedy_verify(info.tokens, torch.tensor(target), info.first_child, info.next_sibling, S)
    assert ai.shape == pr.shape == (B, S + 1) and al.shape == (B,)
    accepted_any = 0
    for b in range(B):
        e_ai, e_al, e_pr = _oracle(tokens[b], [-1] + parents[b], target[b], S)
        assert ai[b].tolist() == e_ai, b
        assert int(al[b]) == e_al, b
        assert pr[b].tolist() == e_pr, b
        accepted_any += e_al > 1
    assert accepted_any > 0  # the random cases exercise acceptance
