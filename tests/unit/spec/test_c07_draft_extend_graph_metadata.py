"""C07: draft-extend replay of raw B=3 padded to 4 with width N. The metadata view has
seq_lens_sum = raw + FILL, extend length N in every lane, accept count N and request row 0
in the padded lane; the caller's sum is unchanged; the output has the raw token rows."""

from __future__ import annotations

import pytest
import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner
from graph_fakes import RecordingBackend

N, H = 4, 5


def _draft_extend_batch():
    """What draft-extend preparation hands the runner: seq_lens = t + N (C09) and its sum."""
    t = torch.tensor([12, 30, 7])  # scheduler lengths [3] int64 (never modified here)
    c = t.clone()  # host mirror
    seq = t + N  # [3] forward-side view
    batch = GraphBatch(
        batch_size=3,
        input_ids=torch.arange(1, 1 + 3 * N),  # [B*N] int64
        positions=(t[:, None] + torch.arange(N)).reshape(-1),  # [B*N]
        out_cache_loc=torch.arange(50, 50 + 3 * N),  # [B*N]
        req_pool_indices=torch.tensor([4, 2, 8]),  # [B]
        seq_lens=seq, seq_lens_cpu=c + N, seq_lens_sum=int(c.sum()) + 3 * N, width=N,
        accept_lens=torch.tensor([1, 4, 2]),  # [B] accepted tokens (incl. bonus)
        hidden=torch.randn(3 * N, H),  # [B*N, H] target features
    )
    return batch


def _forward(view: GraphBatch):
    # Per-token draft hidden: features plus the token id, so rows can be traced back.
    return view.hidden + view.input_ids[:, None].float()  # [bs*N, H]


@pytest.mark.parametrize("fill", [1, 2])
def test_padded_draft_extend_metadata(fill):
    backend = RecordingBackend(fill)
    runner = GraphRunner(GraphKind.DRAFT_EXTEND, [1, 4, 8], backend, width=N, hidden_size=H)
    runner.capture(_forward)
    batch = _draft_extend_batch()
    raw_sum = batch.seq_lens_sum
    seq_obj = batch.seq_lens
    out = runner.replay(batch)

    (call,) = backend.calls
    assert call["bs"] == 4 and call["batch_size"] == 4
    assert call["seq_lens_sum"] == raw_sum + fill
    assert call["seq_lens"] == [16, 34, 11, fill]
    assert call["extend_lens"] == [N, N, N, N]  # padded lane included
    assert call["accept_lens"] == [1, 4, 2, N]
    assert call["req_pool_indices"] == [4, 2, 8, 0]

    assert batch.seq_lens_sum == raw_sum  # caller's value unchanged
    assert batch.seq_lens is seq_obj and batch.seq_lens.tolist() == [16, 34, 11]
    assert batch.accept_lens.tolist() == [1, 4, 2] and batch.batch_size == 3
    assert out.shape == (3 * N, H)  # raw token rows only
    assert torch.allclose(out, batch.hidden + batch.input_ids[:, None].float())


def test_unpadded_draft_extend_keeps_sum():
    backend = RecordingBackend(1)
    runner = GraphRunner(GraphKind.DRAFT_EXTEND, [3], backend, width=N, hidden_size=H)
    runner.capture(_forward)
    batch = _draft_extend_batch()
    runner.replay(batch)
    assert backend.calls[0]["seq_lens_sum"] == batch.seq_lens_sum
    assert backend.calls[0]["accept_lens"] == [1, 4, 2]


def test_draft_extend_requires_accept_counts():
    runner = GraphRunner(GraphKind.DRAFT_EXTEND, [4], RecordingBackend(1), width=N, hidden_size=H)
    runner.capture(_forward)
    batch = _draft_extend_batch()
    batch.accept_lens = None
    with pytest.raises(ValueError, match="accept_lens"):
        runner.replay(batch)
