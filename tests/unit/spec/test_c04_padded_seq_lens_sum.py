"""C04: a padded draft-decode replay shows the backend a seq_lens_sum consistent with the
padded seq_lens; the caller's batch gets its own values back. CPU: the runner's fake graph
(the forward called eagerly on the padded static buffers) and a recording backend."""

from __future__ import annotations

import pytest
import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner
from graph_fakes import RecordingBackend

K, H, SLOTS = 2, 3, 4  # topk lanes, hidden size, draft scratch slots per request


def _forward(view: GraphBatch):
    """Tiny stand-in model: one per-token and one per-request output."""
    per_token = view.input_ids * 1000 + view.positions  # [bs*K] int64
    per_req = view.seq_lens * 10 + view.req_pool_indices  # [bs] int64
    return per_token, per_req


def _batch() -> GraphBatch:
    seq = torch.tensor([10, 11])  # [2] int64
    return GraphBatch(
        batch_size=2,
        input_ids=torch.tensor([5, 6, 7, 8]),  # [B*K]
        positions=seq.repeat_interleave(K),  # [B*K]
        out_cache_loc=torch.arange(20, 20 + 2 * SLOTS),  # [B*SLOTS]
        req_pool_indices=torch.tensor([3, 9]),  # [B]
        seq_lens=seq, seq_lens_cpu=seq.clone(), seq_lens_sum=21, width=K,
        topk_p=torch.tensor([[0.6, 0.4], [0.7, 0.3]]),  # [B, K] fp32
        topk_index=torch.tensor([[11, 12], [13, 14]]),  # [B, K] int64
        hidden=torch.ones(2, H),  # [B, H] fp32
    )


def _runner(backend) -> GraphRunner:
    r = GraphRunner(GraphKind.DRAFT_DECODE, [1, 4], backend, width=K, slots_per_req=SLOTS,
                    topk=K, hidden_size=H)
    r.capture(_forward)
    return r


@pytest.mark.parametrize("fill", [1, 3])
def test_backend_sees_padded_batch_and_sum(fill):
    backend = RecordingBackend(fill)
    runner = _runner(backend)
    assert runner.pad_size(2) == 4 and runner.pad_size(1) == 1 and runner.pad_size(5) is None
    runner.replay(_batch())
    assert len(backend.calls) == 1
    call = backend.calls[0]
    assert call["bs"] == 4 and call["batch_size"] == 4
    assert call["seq_lens"] == [10, 11, fill, fill]
    assert call["seq_lens_cpu"] == [10, 11, fill, fill]
    assert call["seq_lens_sum"] == 21 + 2 * fill == sum(call["seq_lens"])
    assert call["spec_sum"] == call["seq_lens_sum"]  # the batch object agrees while replaying
    assert call["req_pool_indices"] == [3, 9, 0, 0]


@pytest.mark.parametrize("fill", [1, 3])
def test_caller_batch_restored(fill):
    runner = _runner(RecordingBackend(fill))
    batch = _batch()
    before = {f: getattr(batch, f) for f in ("seq_lens", "seq_lens_cpu", "positions",
                                             "req_pool_indices", "input_ids", "out_cache_loc",
                                             "topk_p", "topk_index", "hidden")}
    values = {f: t.clone() for f, t in before.items()}
    runner.replay(batch)
    assert batch.batch_size == 2
    assert batch.seq_lens_sum == 21
    for f, t in before.items():
        assert getattr(batch, f) is t, f"{f} was not given back"
        assert torch.equal(t, values[f]), f"{f} values changed"


def test_outputs_sliced_to_raw_batch():
    runner = _runner(RecordingBackend(1))
    batch = _batch()
    per_token, per_req = runner.replay(batch)
    assert per_token.tolist() == (batch.input_ids * 1000 + batch.positions).tolist()
    assert per_req.tolist() == [10 * 10 + 3, 11 * 10 + 9]


def test_exact_size_needs_no_padding():
    backend = RecordingBackend(1)
    runner = _runner(backend)
    b = _batch()
    one = GraphBatch(1, b.input_ids[:K], b.positions[:K], b.out_cache_loc[:SLOTS],
                     b.req_pool_indices[:1], b.seq_lens[:1], b.seq_lens_cpu[:1], 10, width=K,
                     topk_p=b.topk_p[:1], topk_index=b.topk_index[:1], hidden=b.hidden[:1])
    runner.replay(one)
    assert backend.calls[0]["bs"] == 1 and backend.calls[0]["seq_lens_sum"] == 10
    assert one.seq_lens_sum == 10 and one.batch_size == 1


def test_too_large_batch_is_refused():
    runner = _runner(RecordingBackend(1))
    b = _batch()
    rep = lambda t, n: t.repeat(n, *([1] * (t.dim() - 1)))
    big = GraphBatch(6, rep(b.input_ids, 3), rep(b.positions, 3), rep(b.out_cache_loc, 3),
                     rep(b.req_pool_indices, 3), rep(b.seq_lens, 3), None, 63, width=K,
                     topk_p=rep(b.topk_p, 3), topk_index=rep(b.topk_index, 3), hidden=rep(b.hidden, 3))
    assert runner.pad_size(6) is None and not runner.can_run(big)
    with pytest.raises(ValueError, match="largest captured size"):
        runner.replay(big)
