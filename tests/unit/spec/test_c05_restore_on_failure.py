"""C05: the caller's batch is restored when a replay raises, and a seq_lens_sum of None
stays None with no sum derived from it. CPU: fake graphs and a recording backend."""

from __future__ import annotations

import pytest
import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner, pad_graph_batch

FILL = 1
N = 3  # draft tokens per request (target verify width)


class Boom(RuntimeError):
    pass


class RecordingBackend:
    def __init__(self, raise_in_hook: bool = False):
        self.raise_in_hook = raise_in_hook
        self.calls: list[dict] = []

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return FILL

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum,
                                                seq_lens_cpu, extend_lens=None, **kw):
        self.calls.append(dict(bs=bs, seq_lens_sum=seq_lens_sum, seq_lens=seq_lens.tolist(),
                               batch_size=kw["spec"].batch_size))
        if self.raise_in_hook:
            raise Boom("metadata failed")


def _verify_batch(seq_lens_sum) -> GraphBatch:
    seq = torch.tensor([7, 9, 4])  # [3] int64
    return GraphBatch(
        batch_size=3,
        input_ids=torch.arange(100, 100 + 3 * N),  # [B*N]
        positions=(seq[:, None] + torch.arange(N)).reshape(-1),  # [B*N]
        out_cache_loc=torch.arange(40, 40 + 3 * N),  # [B*N]
        req_pool_indices=torch.tensor([2, 5, 6]),  # [B]
        seq_lens=seq, seq_lens_cpu=seq.clone(), seq_lens_sum=seq_lens_sum, width=N,
        custom_mask=torch.ones(3, N, N, dtype=torch.bool).tril(),  # [B, N, N] bool
    )


def _runner(backend, forward) -> GraphRunner:
    r = GraphRunner(GraphKind.TARGET_VERIFY, [2, 4], backend, width=N)
    r.capture(forward)
    return r


def _snapshot(batch: GraphBatch):
    fields = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
              "seq_lens_cpu", "custom_mask")
    return ({f: getattr(batch, f) for f in fields},
            {f: getattr(batch, f).clone() for f in fields},
            batch.batch_size, batch.seq_lens_sum)


def _assert_restored(batch: GraphBatch, snap):
    objs, vals, bs, total = snap
    assert batch.batch_size == bs
    assert batch.seq_lens_sum == total
    for f, t in objs.items():
        assert getattr(batch, f) is t, f"{f} still points at a padded buffer"
        assert torch.equal(t, vals[f]), f"{f} values changed"


def _failing_forward(view):
    raise Boom("graph replay failed")


@pytest.mark.parametrize("total", [20, None])
def test_restored_when_forward_raises(total):
    backend = RecordingBackend()
    runner = _runner(backend, _failing_forward)
    batch = _verify_batch(total)
    snap = _snapshot(batch)
    with pytest.raises(Boom):
        runner.replay(batch)
    assert backend.calls and backend.calls[0]["batch_size"] == 4  # it did run padded
    _assert_restored(batch, snap)


@pytest.mark.parametrize("total", [20, None])
def test_restored_when_metadata_raises(total):
    backend = RecordingBackend(raise_in_hook=True)
    runner = _runner(backend, lambda v: v.input_ids)
    batch = _verify_batch(total)
    snap = _snapshot(batch)
    with pytest.raises(Boom):
        runner.replay(batch)
    _assert_restored(batch, snap)
    with pytest.raises(Boom):  # the plan-stream half restores too
        runner.init_replay_metadata(batch)
    _assert_restored(batch, snap)


def test_none_sum_stays_none_and_is_not_derived():
    backend = RecordingBackend()
    runner = _runner(backend, lambda v: v.input_ids * 2)
    batch = _verify_batch(None)
    out = runner.replay(batch)
    assert backend.calls[0]["seq_lens_sum"] is None  # not 20 + FILL, not a sum of seq_lens
    assert backend.calls[0]["seq_lens"] == [7, 9, 4, FILL]
    assert batch.seq_lens_sum is None
    assert out.tolist() == (batch.input_ids * 2).tolist()
    # A second replay after a None one still starts from the caller's values.
    batch.seq_lens_sum = 20
    runner.replay(batch)
    assert backend.calls[1]["seq_lens_sum"] == 20 + FILL and batch.seq_lens_sum == 20


def test_dp_padding_keeps_none_and_leaves_caller_alone():
    batch = _verify_batch(None)
    snap = _snapshot(batch)
    padded = pad_graph_batch(batch, 4, FILL)
    assert padded.seq_lens_sum is None and padded.batch_size == 4
    assert padded.seq_lens.tolist() == [7, 9, 4, FILL]
    _assert_restored(batch, snap)
    batch.seq_lens_sum = 20
    assert pad_graph_batch(batch, 4, FILL).seq_lens_sum == 20 + FILL
