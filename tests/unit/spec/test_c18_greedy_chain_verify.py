"""C18 greedy chain verify.

Chain N=4, candidates [r,a,b,c], target argmax at the nodes [a,b,x,y]: accepted index
[0,1,2,-1], predictions [a,b,x], accept length 3 (two drafts + bonus x). If the
target's first argmax is not a: accept length 1 and the bonus is the target's argmax at
the root.
"""
from __future__ import annotations

import torch

from kestrel_kernels.spec_tree import build_tree
from kestrel_kernels.verify import greedy_verify

R, A, B_, C, X, Y = 100, 11, 12, 13, 21, 22  # token ids
N, S = 4, 3


def _chain(num_req: int):
    draft = torch.tensor([[A, B_, C]] * num_req, dtype=torch.int64)
    parents = torch.tensor([[0, 1, 2]] * num_req, dtype=torch.int64)
    verified = torch.full((num_req,), R, dtype=torch.int64)
    return build_tree(verified, draft, parents, torch.full((num_req,), 10, dtype=torch.int64))


def test_c18_two_drafts_accepted_plus_bonus():
    info = _chain(1)
    target = torch.tensor([[A, B_, X, Y]], dtype=torch.int64)
    accept_index, accept_length, predict = greedy_verify(
        info.tokens, target, info.first_child, info.next_sibling, S
    )
    assert accept_index.dtype == accept_length.dtype == predict.dtype == torch.int64
    assert accept_index.tolist() == [[0, 1, 2, -1]]
    assert accept_length.tolist() == [3]
    n = int(accept_length[0])
    assert predict[0, :n].tolist() == [A, B_, X]
    assert predict[0, n:].tolist() == [-1]


def test_c18_first_mismatch_gives_root_bonus():
    info = _chain(1)
    target = torch.tensor([[Y, B_, X, Y]], dtype=torch.int64)  # root argmax is not a
    accept_index, accept_length, predict = greedy_verify(
        info.tokens, target, info.first_child, info.next_sibling, S
    )
    assert accept_length.tolist() == [1]
    assert accept_index.tolist() == [[0, -1, -1, -1]]
    assert predict[0, :1].tolist() == [Y]
    assert predict[0, 1:].tolist() == [-1, -1, -1]


def test_c18_all_accepted_and_batch_independence():
    info = _chain(3)
    target = torch.tensor(
        [[A, B_, C, Y],   # all three drafts accepted, bonus y at the last node
         [A, B_, X, Y],   # the C18 case
         [X, B_, C, Y]],  # rejected at the root
        dtype=torch.int64,
    )
    accept_index, accept_length, predict = greedy_verify(
        info.tokens, target, info.first_child, info.next_sibling, S
    )
    assert accept_length.tolist() == [4, 3, 1]
    assert accept_index.tolist() == [[0, 1, 2, 3], [0, 1, 2, -1], [0, -1, -1, -1]]
    assert predict.tolist() == [[A, B_, C, Y], [A, B_, X, -1], [X, -1, -1, -1]]
