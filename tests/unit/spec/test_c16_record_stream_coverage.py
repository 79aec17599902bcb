"""C16: before verify preparation rebinds batch tensors, every CUDA tensor a queued
forward-stream kernel may still read is record_stream-ed on the forward stream; tensors
the preparation allocates on the plan stream are recorded on the forward stream after it.
CPU tensors and None are skipped. CPU: tensors that claim to be CUDA and log
record_stream, and fake streams/events that log their calls."""

from __future__ import annotations

import torch

from actors.graphs.cuda_graph_runner import GraphBatch
from actors.graphs.plan_stream import (PlanStream, VerifyInputs, prepare_draft_extend_inputs,
                                prepare_verify_inputs)

B, N = 2, 3
LOG: list = []


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is CUDA and logs record_stream (ops return plain tensors)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        LOG.append(("record_stream", self.tag, stream.name))


def cuda(t: torch.Tensor, tag: str) -> FakeCudaTensor:
    f = t.as_subclass(FakeCudaTensor)
    f.tag = tag
    return f


class FakeStream:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        LOG.append(("enter", self.name))

    def __exit__(self, *exc):
        LOG.append(("exit", self.name))
        return False

    def wait_event(self, ev):
        LOG.append(("wait_event", self.name))

    def wait_stream(self, other):
        LOG.append(("wait_stream", self.name, other.name))


class FakeEvent:
    def record(self, stream):
        LOG.append(("event_record", stream.name))


def _plan() -> PlanStream:
    LOG.clear()
    return PlanStream(True, compute_stream=FakeStream("forward"),
                      stream_factory=lambda d: FakeStream("plan"), event_factory=FakeEvent)


def _batch() -> GraphBatch:
    i64 = dict(dtype=torch.int64)
    return GraphBatch(
        B, cuda(torch.zeros(B, **i64), "old_input_ids"), cuda(torch.zeros(B, **i64), "old_positions"),
        cuda(torch.zeros(B, **i64), "old_out_cache_loc"), cuda(torch.tensor([1, 2]), "req_pool_indices"),
        cuda(torch.tensor([7, 9]), "seq_lens"), torch.tensor([7, 9]), 16, width=1)


def _verify(cpu_sibling: bool = False) -> VerifyInputs:
    sib = torch.full((B, N), -1)  # [B, N] int64
    return VerifyInputs(
        cuda(torch.arange(B * N), "draft_tokens"),
        cuda(torch.ones(B, N, N, dtype=torch.bool), "tree_mask"),
        cuda(torch.arange(B * N), "positions"),
        cuda(torch.zeros(B, N, dtype=torch.int64), "retrieve_index"),
        cuda(torch.zeros(B, N, dtype=torch.int64), "retrieve_next_token"),
        sib if cpu_sibling else cuda(sib, "retrieve_next_sibling"))


READS = ["seq_lens", "req_pool_indices", "old_input_ids", "old_out_cache_loc", "draft_tokens",
         "tree_mask", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"]


def _build(batch, verify):
    def build():
        LOG.append(("build",))
        # Made on the plan stream, used by the forward stream.
        return {"input_ids": cuda(verify.draft_tokens.clone(), "new_input_ids"),
                "out_cache_loc": cuda(torch.arange(10, 10 + B * N), "new_out_cache_loc"),
                "positions": verify.positions}
    return build


def test_verify_preparation_records_reads_then_new_tensors():
    plan = _plan()
    batch, verify = _batch(), _verify()
    old_ids = batch.input_ids
    prepare_verify_inputs(plan, batch, verify, _build(batch, verify))

    recorded_before = [e[1] for e in LOG[:LOG.index(("event_record", "forward"))]
                       if e[0] == "record_stream"]
    assert recorded_before == READS  # all of them, before any plan-stream work
    assert all(e[2] == "forward" for e in LOG if e[0] == "record_stream")
    i_build = LOG.index(("build",))
    i_wait = LOG.index(("wait_stream", "forward", "plan"))
    after = [e[1] for e in LOG[i_wait + 1:] if e[0] == "record_stream"]
    assert i_build < i_wait
    assert after[:2] == ["new_input_ids", "new_out_cache_loc"]
    # The batch now holds the new tensors; the old ones were protected before the rebind.
    assert batch.input_ids.tag == "new_input_ids" and batch.out_cache_loc.tag == "new_out_cache_loc"
    assert old_ids.tag == "old_input_ids"


def test_cpu_tensors_and_none_skipped():
    plan = _plan()
    batch, verify = _batch(), _verify(cpu_sibling=True)
    cpu_extra = torch.zeros(3)
    assert plan.protect([None, cpu_extra, batch.seq_lens_cpu]) == []
    assert LOG == []

    def build():
        return {"input_ids": cuda(torch.zeros(B * N, dtype=torch.int64), "new_input_ids"),
                "out_cache_loc": torch.zeros(B * N, dtype=torch.int64),  # a CPU tensor: skipped
                "custom_mask": None}
    prepare_verify_inputs(plan, batch, verify, build)
    tags = [e[1] for e in LOG if e[0] == "record_stream"]
    assert "retrieve_next_sibling" not in tags
    assert tags == READS[:-1] + ["new_input_ids"]
    assert batch.custom_mask is None


def test_draft_extend_preparation_protects_its_reads():
    plan = _plan()
    batch = _batch()
    batch.hidden = cuda(torch.zeros(B, 4), "hidden")
    batch.accept_lens = cuda(torch.ones(B, dtype=torch.int64), "accept_lens")
    prepare_draft_extend_inputs(plan, batch, lambda: {"out_cache_loc": cuda(torch.zeros(B), "new_loc")})
    tags = [e[1] for e in LOG if e[0] == "record_stream"]
    assert tags == ["seq_lens", "req_pool_indices", "old_input_ids", "old_out_cache_loc",
                    "old_positions", "accept_lens", "hidden", "new_loc"]
    assert LOG.index(("record_stream", "hidden", "forward")) < LOG.index(("event_record", "forward"))


def test_disabled_plan_stream_records_nothing():
    LOG.clear()
    plan = PlanStream(False, compute_stream=FakeStream("forward"))
    batch, verify = _batch(), _verify()
    prepare_verify_inputs(plan, batch, verify, _build(batch, verify))
    assert LOG == [("build",)]
    assert batch.input_ids.tag == "new_input_ids"
