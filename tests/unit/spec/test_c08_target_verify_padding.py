"""C08: target-verify replay pads the same way as the other kinds (N tokens per lane) and
passes the padded seq_lens_sum to the backend."""

from __future__ import annotations

import pytest
import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner
from graph_fakes import RecordingBackend

N = 4


def _verify_batch(bs: int) -> GraphBatch:
    seq = torch.tensor([9, 15, 6, 21, 3][:bs])  # [bs] int64 committed lengths
    mask = torch.ones(bs, N, N, dtype=torch.bool).tril()  # [bs, N, N] chain tree mask
    return GraphBatch(
        batch_size=bs,
        input_ids=torch.arange(200, 200 + bs * N),  # [bs*N] draft tokens
        positions=(seq[:, None] + torch.arange(N)).reshape(-1),  # [bs*N] seq_len + depth
        out_cache_loc=torch.arange(60, 60 + bs * N),  # [bs*N]
        req_pool_indices=torch.tensor([1, 3, 5, 7, 9][:bs]),  # [bs]
        seq_lens=seq, seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()), width=N,
        custom_mask=mask)


def _forward(view: GraphBatch):
    logits = view.input_ids[:, None].float() * torch.ones(1, 7)  # [bs*N, V=7]
    return logits


@pytest.mark.parametrize("fill", [1, 5])
def test_verify_padded_to_captured_size(fill):
    backend = RecordingBackend(fill)
    runner = GraphRunner(GraphKind.TARGET_VERIFY, [2, 4], backend, width=N)
    runner.capture(_forward)
    batch = _verify_batch(3)
    out = runner.replay(batch)
    (call,) = backend.calls
    raw = 9 + 15 + 6
    assert call["bs"] == 4
    assert call["seq_lens"] == [9, 15, 6, fill] and call["seq_lens_cpu"] == [9, 15, 6, fill]
    assert call["seq_lens_sum"] == raw + fill
    assert call["extend_lens"] == [N] * 4
    assert call["req_pool_indices"] == [1, 3, 5, 0]
    assert call["positions"][3 * N:] == [0] * N
    assert call["out_cache_loc"][3 * N:] == [0] * N  # padded tokens write slot 0
    assert call["input_ids"][3 * N:] == [0] * N
    assert not call["mask"][3].any()
    assert torch.equal(call["mask"][:3], batch.custom_mask)
    assert out.shape == (3 * N, 7)
    assert out[:, 0].tolist() == batch.input_ids.float().tolist()
    assert batch.seq_lens_sum == raw and batch.batch_size == 3


def test_verify_exact_size_passes_raw_sum():
    backend = RecordingBackend(1)
    runner = GraphRunner(GraphKind.TARGET_VERIFY, [2, 4], backend, width=N)
    runner.capture(_forward)
    batch = _verify_batch(4)
    runner.replay(batch)
    assert backend.calls[0]["bs"] == 4
    assert backend.calls[0]["seq_lens_sum"] == batch.seq_lens_sum == 9 + 15 + 6 + 21


def test_verify_explicit_larger_size():
    """DP agreement may ask for a larger captured size than the raw batch needs."""
    backend = RecordingBackend(1)
    runner = GraphRunner(GraphKind.TARGET_VERIFY, [2, 4], backend, width=N)
    runner.capture(_forward)
    batch = _verify_batch(1)
    out = runner.replay(batch, bs=4)
    assert backend.calls[0]["bs"] == 4
    assert backend.calls[0]["seq_lens_sum"] == 9 + 3
    assert out.shape == (N, 7)
    with pytest.raises(ValueError):
        runner.replay(batch, bs=3)  # not a captured size
