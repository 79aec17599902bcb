"""C23 losslessness (sampling).

With temperature > 0, tree rejection sampling leaves the target distribution unchanged:
on a small vocabulary, the empirical distribution of the first emitted token over many
seeded trials matches the target's (chi-square, fixed seed, a bound that a wrong
implementation fails).
"""
from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
from scipy.stats import chisquare

from kestrel_kernels.sampling import process_logits, sample_from_probs
from kestrel_kernels.spec_tree import TreeInfo, build_tree
from kestrel_kernels.verify import greedy_verify, tree_sampling_verify

V = 8
N, S = 5, 2  # K=2: root -> 2 children; one of them -> 2 children
TRIALS = 20000
P_PASS = 1e-3
P_FAIL = 1e-6

# Per-node target logits and sampling params (processed through process_logits).
_LOGITS = torch.tensor(
    [
        [2.0, 1.2, 0.9, 0.3, 0.1, -0.5, -1.0, -3.0],  # node 0 (root)
        [-1.0, 0.2, 1.5, 2.2, -0.3, 0.8, -2.0, 0.0],  # node 1
        [0.5, 0.4, 0.3, 0.2, 0.1, 0.0, -0.1, -0.2],   # node 2
        [1.0, -1.0, 0.0, 0.5, 2.0, -0.5, 1.5, 0.2],   # node 3
        [0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0],     # node 4
    ]
)
_TEMP = torch.tensor([0.8, 1.3, 1.0, 0.7, 1.0])
_TOP_P = torch.tensor([0.97, 0.9, 1.0, 0.95, 1.0])
_TOP_K = torch.tensor([6, 5, 0, 4, 0], dtype=torch.int64)


def _node_q() -> torch.Tensor:
    """[N, V] float32 target distribution at each node."""
    return process_logits(_LOGITS, _TEMP, _TOP_P, _TOP_K)


# Tree A: root children = most likely token (0) and an unlikely one (4); node 1's
# children = a mid-probability token (2) and a zero-probability token (6).
TREE_A = dict(tokens=[0, 4, 2, 6], parents=[0, 0, 1, 1])
# Tree B: the most likely root token is not drafted; the second lane holds the children.
TREE_B = dict(tokens=[3, 1, 5, 0], parents=[0, 0, 2, 2])
TREES = {"A": TREE_A, "B": TREE_B}


@functools.lru_cache(maxsize=None)
def _run(tree_name: str, trials: int = TRIALS, seed: int = 2024):
    """Seeded trials of one tree (cached: several tests share the same draws; read-only)."""
    tree = TREES[tree_name]
    q = _node_q()
    one = build_tree(
        torch.tensor([7], dtype=torch.int64),
        torch.tensor([tree["tokens"]], dtype=torch.int64),
        torch.tensor([tree["parents"]], dtype=torch.int64),
        torch.tensor([30], dtype=torch.int64),
    )
    # same tree for every trial (batch = trials)
    info = TreeInfo(**{f.name: getattr(one, f.name).expand(trials, *getattr(one, f.name).shape[1:])
                       for f in dataclasses.fields(one)})
    g = torch.Generator().manual_seed(seed)
    node_coins = torch.rand(trials, N, generator=g)  # [trials, N] float32
    final_coins = torch.rand(trials, generator=g)  # [trials] float32
    target_probs = q[None].expand(trials, N, V)  # [trials, N, V]
    out = tree_sampling_verify(
        info.tokens, target_probs, info.first_child, info.next_sibling, S, node_coins, final_coins
    )
    return q, info, node_coins, final_coins, out


def _chi2_pvalue(tokens: torch.Tensor, q: torch.Tensor) -> float:
    """Chi-square p-value of token samples against distribution q over V; 0 if a q=0 token occurs."""
    counts = torch.bincount(tokens, minlength=V).double()
    support = q > 0
    if counts[~support].sum() > 0:
        return 0.0
    qs = q[support].double()
    expected = qs / qs.sum() * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def test_c23_target_distributions_are_nontrivial():
    q = _node_q()
    # the fixture really has truncated tails and unlikely drafted tokens
    assert (q[0] == 0).sum() >= 2 and 0 < q[0, 4] < 0.1 and q[1, 6] == 0
    assert int(q[0].argmax()) == 0


@pytest.mark.parametrize("tree", ["A", "B"])
def test_c23_first_token_matches_target(tree):
    q, info, _, _, (accept_index, accept_length, predict) = _run(tree)
    first = predict[:, 0]
    assert (q[0][first] > 0).all(), "a zero-probability token was emitted"
    assert _chi2_pvalue(first, q[0]) > P_PASS
    # both acceptance and rejection paths occur
    assert (accept_length == 1).any() and (accept_length >= 2).any()


def test_c23_outputs_are_consistent():
    q, info, _, _, (accept_index, accept_length, predict) = _run("A", trials=2000)
    assert accept_index.shape == predict.shape == (2000, S + 1)
    assert accept_index.dtype == accept_length.dtype == predict.dtype == torch.int64
    for b in range(0, 2000, 7):
        n = int(accept_length[b])
        path = accept_index[b, :n].tolist()
        assert path[0] == 0 and accept_index[b, n:].eq(-1).all() and predict[b, n:].eq(-1).all()
        for d in range(1, n):
            assert int(info.parent[b, path[d]]) == path[d - 1]
            assert int(predict[b, d - 1]) == int(info.tokens[b, path[d]])
        assert q[path[-1], int(predict[b, n - 1])] > 0  # bonus comes from the last node's q


def test_c23_second_token_given_accepted_first():
    q, info, _, _, (accept_index, accept_length, predict) = _run("A", seed=7)
    # first emitted = token of node 1 <=> node 1 accepted (after rejecting node 1 its
    # token has zero residual mass, and node 2 holds a different token)
    sel = predict[:, 0] == TREE_A["tokens"][0]
    assert torch.equal(sel, accept_index[:, 1] == 1)
    assert int(sel.sum()) > 5000
    second = predict[sel, 1]
    assert (second != 6).all(), "zero-probability draft token 6 accepted"
    assert _chi2_pvalue(second, q[1]) > P_PASS
    # third token given path 0 -> 1 -> 3 (depth limit reached): bonus ~ q at node 3
    sel3 = (accept_index[:, 1] == 1) & (accept_index[:, 2] == 3)
    assert int(sel3.sum()) > 1000
    assert _chi2_pvalue(predict[sel3, 2], q[3]) > P_PASS


# ------------------------------------------------------------------ wrong variants fail
def _wrong_first_token(variant: str, q_root, child_tokens, child_coins, final_coins):
    """First emitted token under a deliberately broken verifier (root level only).

    child_tokens: root's children in sibling order; child_coins [T, #children].
    """
    T = child_coins.shape[0]
    q0 = q_root.double().expand(T, V)
    residual = q0.clone()
    out = torch.full((T,), -1, dtype=torch.int64)
    done = torch.zeros(T, dtype=torch.bool)
    for i, tok in enumerate(child_tokens):
        coin = child_coins[:, i].double()
        if variant == "always_first_child":
            acc = torch.ones(T, dtype=torch.bool)
        elif variant == "no_renormalise":  # accept with q(x), never touch q after a rejection
            acc = coin < q0[:, tok]
        elif variant == "bonus_ignores_residual":  # correct acceptance, bonus from the full q
            acc = coin * residual.sum(-1) < residual[:, tok]
        else:
            raise ValueError(variant)
        acc &= ~done
        out = torch.where(acc, torch.full_like(out, tok), out)
        done |= acc
        residual[~done, tok] = 0.0
    bonus = sample_from_probs(q0, final_coins)  # both broken variants ignore the residual
    return torch.where(done, out, bonus)


@pytest.mark.parametrize("variant", ["no_renormalise", "always_first_child", "bonus_ignores_residual"])
def test_c23_wrong_variants_fail_the_same_check(variant):
    q, info, node_coins, final_coins, (_, _, predict) = _run("A")
    children = [1, 2]  # root's children in TREE_A
    child_tokens = [int(info.tokens[0, c]) for c in children]
    wrong = _wrong_first_token(variant, q[0], child_tokens, node_coins[:, children], final_coins)
    assert _chi2_pvalue(wrong, q[0]) < P_FAIL
    # the correct kernel on the very same coins passes
    assert _chi2_pvalue(predict[:, 0], q[0]) > P_PASS


# ------------------------------------------------------------------ one-hot target == greedy
@pytest.mark.parametrize("seed", range(3))
def test_c23_one_hot_target_reduces_to_greedy(seed):
    rng = random.Random(seed)
    B, n, vocab = 48, 9, 4
    parents = torch.tensor([[rng.randrange(0, i + 1) for i in range(n - 1)] for _ in range(B)])
    draft = torch.randint(0, vocab, (B, n - 1), generator=torch.Generator().manual_seed(seed))
    info = build_tree(torch.zeros(B, dtype=torch.int64), draft, parents, torch.zeros(B, dtype=torch.int64))
    target_predict = torch.randint(0, vocab, (B, n), generator=torch.Generator().manual_seed(100 + seed))
    one_hot = torch.nn.functional.one_hot(target_predict, vocab).float()  # [B, n, vocab]
    g = torch.Generator().manual_seed(200 + seed)
    depth = int(info.depth.max())
    sampled = tree_sampling_verify(
        info.tokens, one_hot, info.first_child, info.next_sibling, depth,
        torch.rand(B, n, generator=g), torch.rand(B, generator=g),
    )
    greedy = greedy_verify(info.tokens, target_predict, info.first_child, info.next_sibling, depth)
    for s_out, g_out in zip(sampled, greedy):
        assert torch.equal(s_out, g_out)
