"""C17: plan stream on -> the plan stream waits for an event recorded on the compute stream
after the inputs were written, the preparation runs on the plan stream, then the compute
stream waits for the plan stream. Off -> the preparation only, no stream calls. Verify and
draft extend both follow this. CPU: fake streams/events that log every call."""

from __future__ import annotations

import pytest
import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner, VerifyPath
from actors.dp.sync import draft_extend_ids, stream_ctx
from actors.graphs.plan_stream import (PlanStream, VerifyInputs, prepare_draft_extend_inputs,
                                prepare_verify_inputs)
from graph_fakes import FakeEvent, FakeStream

B, N = 2, 3


def _plan(enabled: bool, log: list, compute=None) -> PlanStream:
    compute = compute or FakeStream("compute", log)
    if not enabled:
        return PlanStream(False, compute_stream=compute)
    return PlanStream(True, compute_stream=compute,
                      stream_factory=lambda d: FakeStream("plan", log),
                      event_factory=lambda: FakeEvent(log))


def _batch() -> GraphBatch:
    seq = torch.tensor([4, 6])
    return GraphBatch(B, torch.zeros(B * N, dtype=torch.int64), torch.zeros(B * N, dtype=torch.int64),
                      torch.zeros(B * N, dtype=torch.int64), torch.tensor([1, 2]), seq, seq.clone(),
                      10, width=N)


def _verify() -> VerifyInputs:
    z = torch.zeros(B, N, dtype=torch.int64)
    return VerifyInputs(torch.arange(B * N), torch.ones(B, N, N, dtype=torch.bool),
                        torch.arange(B * N), z, z.clone(), z.clone())


def _expected(prep: str, writer: str = "compute") -> list[str]:
    ev = f"ev{FakeEvent.count}"
    return [f"{writer}:record:{ev}", f"plan:wait_event:{ev}", "plan:enter", prep, "plan:exit",
            "compute:wait_stream:plan"]


def test_verify_order_with_plan_stream():
    log: list[str] = []
    plan = _plan(True, log)
    compute = plan.compute_stream()
    batch, verify = _batch(), _verify()
    with stream_ctx(compute):
        log.append("write verify inputs")  # draft decode + build tree on the compute stream

    prepare_verify_inputs(plan, batch, verify, lambda: log.append("prepare verify") or {})
    assert log == ["compute:enter", "write verify inputs", "compute:exit",
                   *_expected("prepare verify")]


def test_draft_extend_order_with_plan_stream():
    log: list[str] = []
    plan = _plan(True, log)
    batch = _batch()
    accepted = torch.tensor([3, 4, 5, 6, 7, 8], dtype=torch.int32)

    def prep():
        log.append(f"prepare draft extend ids={batch.input_ids.dtype}")
        return {}

    batch.input_ids = draft_extend_ids(accepted, plan.compute_stream())  # C01: compute stream
    assert log[-2:] == ["compute:enter", "compute:exit"]
    log.clear()
    prepare_draft_extend_inputs(plan, batch, prep)
    assert log == _expected("prepare draft extend ids=torch.int64")


def test_event_recorded_on_the_stream_that_wrote_the_inputs():
    log: list[str] = []
    plan = _plan(True, log)
    copy_stream = FakeStream("copy", log)
    out = plan.prepare(lambda: log.append("prep") or 42, inputs_written_on=copy_stream)
    assert out == 42
    assert log == _expected("prep", writer="copy")


def test_graph_verify_path_follows_the_order():
    log: list[str] = []

    class Backend:
        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        def init_forward_metadata_replay_cuda_graph(self, bs, *a, **kw):
            log.append("replay metadata")

    runner = GraphRunner(GraphKind.TARGET_VERIFY, [2], Backend(), width=N)
    runner.capture(lambda v: v.input_ids)
    path = VerifyPath(Backend(), lambda fb: None, runner=runner, plan=_plan(True, log))
    batch = _batch()
    batch.custom_mask = torch.ones(B, N, N, dtype=torch.bool)
    path.prepare_verify(batch, True)
    assert log == _expected("replay metadata")


def test_compute_waits_even_when_preparation_fails():
    log: list[str] = []
    plan = _plan(True, log)

    def bad():
        log.append("prep")
        raise RuntimeError("plan failed")

    with pytest.raises(RuntimeError):
        plan.prepare(bad)
    assert log == _expected("prep")


@pytest.mark.parametrize("which", ["verify", "draft_extend"])
def test_plan_stream_off_is_preparation_only(which):
    log: list[str] = []
    plan = _plan(False, log)
    assert plan.stream is None
    batch = _batch()
    if which == "verify":
        prepare_verify_inputs(plan, batch, _verify(), lambda: log.append("prep") or {})
    else:
        prepare_draft_extend_inputs(plan, batch, lambda: log.append("prep") or {})
    assert log == ["prep"]


def test_enabled_without_cuda_or_fakes_is_refused():
    with pytest.raises(ValueError, match="CUDA"):
        PlanStream(True, "cpu")
    assert PlanStream(False, "cpu").prepare(lambda: 7) == 7
