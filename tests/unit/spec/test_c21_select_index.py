"""C21 select index: accept lengths [1,3] with N=4 select hidden-state rows [0, 6]."""
from __future__ import annotations

import torch

from kestrel_kernels.verify import select_last_index


def test_c21_contract_example():
    idx = select_last_index(torch.tensor([1, 3], dtype=torch.int64), 4)
    assert idx.dtype == torch.int64
    assert idx.tolist() == [0, 6]


def test_c21_selects_last_accepted_row_of_each_request():
    g = torch.Generator().manual_seed(0)
    B, N, H = 7, 5, 3
    accept_length = torch.randint(1, N + 1, (B,), generator=g)
    # draft-extend output, fixed width N per request; row encodes (request, position)
    hidden = torch.stack(
        [torch.tensor([b, p, 0.5], dtype=torch.float32) for b in range(B) for p in range(N)]
    )  # [B*N, H]
    rows = hidden[select_last_index(accept_length, N)]
    assert rows.shape == (B, H)
    assert rows[:, 0].tolist() == list(range(B))
    assert rows[:, 1].long().tolist() == (accept_length - 1).tolist()
