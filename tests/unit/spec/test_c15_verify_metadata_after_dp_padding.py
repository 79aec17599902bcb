"""C15: non-graph target verify builds no attention metadata while preparing; the forward
builds it after DP padding (3 -> 4: the backend sees batch 4). The graph path builds the
replay metadata once while preparing, marks it ready, and the forward never rebuilds it."""

from __future__ import annotations

import pytest
import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner, VerifyPath
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.graphs.plan_stream import PlanStream, VerifyInputs
from graph_fakes import FakeEvent, FakeStream, without_event_names

FILL = 1
N = 3


class RecordingBackend:
    """Logs both metadata entry points into one shared event log."""

    def __init__(self, log: list):
        self.log = log
        self.init_calls: list[dict] = []
        self.replay_calls: list[dict] = []

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return FILL

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self.log.append("init_forward_metadata")
        self.init_calls.append(dict(batch_size=fb.batch_size, mode=fb.mode,
                                    prefix_lens=fb.prefix_lens.tolist(),
                                    extend_lens=list(fb.extend_lens), num_tokens=fb.num_tokens))
        fb.attn_meta = ("meta", fb.batch_size)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum,
                                                seq_lens_cpu, extend_lens=None, **kw):
        self.log.append("replay_metadata")
        self.replay_calls.append(dict(bs=bs, seq_lens=seq_lens.tolist(), seq_lens_sum=seq_lens_sum,
                                      input_ids=kw["spec"].input_ids.tolist()))


def _batch() -> GraphBatch:
    seq = torch.tensor([5, 8, 6])  # [3] int64
    return GraphBatch(3, torch.arange(1, 1 + 3 * N), (seq[:, None] + torch.arange(N)).reshape(-1),
                      torch.arange(30, 30 + 3 * N), torch.tensor([2, 4, 6]), seq, seq.clone(),
                      int(seq.sum()), width=N, custom_mask=torch.ones(3, N, N, dtype=torch.bool))


def _eager_forward(log):
    def fwd(fb: ForwardBatch):
        log.append("eager_forward")
        assert fb.attn_meta == ("meta", fb.batch_size)  # metadata matches what runs
        return fb.input_ids * 10  # [T]
    return fwd


def test_non_graph_metadata_only_after_dp_padding():
    log: list[str] = []
    backend = RecordingBackend(log)
    path = VerifyPath(backend, _eager_forward(log))
    batch = _batch()

    prepared = path.prepare_verify(batch, use_graph=False)
    assert log == [] and not prepared.metadata_ready  # nothing built during preparation

    out = path.forward_verify(prepared, dp_padded_bs=4)
    assert log == ["init_forward_metadata", "eager_forward"]
    (call,) = backend.init_calls
    assert call["batch_size"] == 4 and call["mode"] == ForwardMode.TARGET_VERIFY
    assert call["prefix_lens"] == [5, 8, 6, FILL]
    assert call["extend_lens"] == [N] * 4 and call["num_tokens"] == 4 * N
    assert out.tolist() == (batch.input_ids * 10).tolist()  # raw rows only
    assert batch.batch_size == 3 and batch.seq_lens.tolist() == [5, 8, 6]


def test_non_graph_without_dp_padding_sees_raw_batch():
    log: list[str] = []
    backend = RecordingBackend(log)
    path = VerifyPath(backend, _eager_forward(log))
    path.forward_verify(path.prepare_verify(_batch(), use_graph=False))
    assert backend.init_calls[0]["batch_size"] == 3


def _graph_path(log, plan=None):
    backend = RecordingBackend(log)
    runner = GraphRunner(GraphKind.TARGET_VERIFY, [1, 4], backend, width=N)

    def graph_body(view):
        log.append("graph_replay")
        return view.input_ids * 10

    runner.capture(graph_body)
    return backend, VerifyPath(backend, _eager_forward(log), runner=runner, plan=plan)


def test_graph_metadata_once_in_preparation():
    log: list[str] = []
    backend, path = _graph_path(log)
    batch = _batch()
    prepared = path.prepare_verify(batch, use_graph=True)
    assert log == ["replay_metadata"]
    assert prepared.metadata_ready and prepared.graph_bs == 4
    assert backend.replay_calls[0]["bs"] == 4
    assert backend.replay_calls[0]["seq_lens_sum"] == 19 + FILL

    out = path.forward_verify(prepared, dp_padded_bs=4)
    assert log == ["replay_metadata", "graph_replay"]  # no second init of any kind
    assert backend.init_calls == []
    assert out.tolist() == (batch.input_ids * 10).tolist()


def test_graph_size_must_match_prepared_metadata():
    log: list[str] = []
    _, path = _graph_path(log)
    prepared = path.prepare_verify(_batch(), use_graph=True)
    with pytest.raises(RuntimeError, match="agree on DP padding"):
        path.forward_verify(prepared, dp_padded_bs=5)  # would need another size's metadata
    assert "init_forward_metadata" not in log


def test_graph_metadata_built_on_plan_stream_for_new_inputs():
    """With verify inputs, the metadata sees the rebound draft tokens, on the plan stream."""
    log: list[str] = []
    plan = PlanStream(True, compute_stream=FakeStream("compute", log),
                      stream_factory=lambda d: FakeStream("plan", log),
                      event_factory=lambda: FakeEvent(log))
    backend, path = _graph_path(log, plan)
    batch = _batch()
    draft = torch.arange(90, 90 + 3 * N)  # [B*N] int64 new verify tokens
    verify = VerifyInputs(draft, torch.ones(3, N, N, dtype=torch.bool), batch.positions,
                          *(torch.zeros(3, N, dtype=torch.int64) for _ in range(3)))
    prepared = path.prepare_verify(batch, True, verify, build=lambda b, v: {"input_ids": v.draft_tokens})
    assert without_event_names(log) == ["compute:record", "plan:wait_event", "plan:enter",
                                        "replay_metadata", "plan:exit", "compute:wait_stream:plan"]
    assert backend.replay_calls[0]["input_ids"][:3 * N] == draft.tolist()
    assert batch.input_ids is draft and prepared.metadata_ready
    out = path.forward_verify(prepared, 4)
    assert out.tolist() == (draft * 10).tolist() and log.count("replay_metadata") == 1
