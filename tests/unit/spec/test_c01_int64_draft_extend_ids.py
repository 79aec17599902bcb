"""C01: ids entering draft extend are int64 (same values), cast on the compute stream
before any plan-stream work reads them. CPU: a fake stream that records enter/exit."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from actors.dp.sync import draft_extend_ids, stream_ctx, to_int64


class FakeStream:
    """Stands in for the compute stream: records when it becomes current / stops."""

    def __init__(self, name: str, events: list):
        self.name = name
        self.events = events

    def __enter__(self):
        self.events.append(f"{self.name}:enter")
        return self

    def __exit__(self, *exc):
        self.events.append(f"{self.name}:exit")
        return False


class RecordCasts(TorchFunctionMode):
    """Records every dtype conversion to int64 into the shared event list."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (
            name in ("to", "long", "type", "_to_copy")
            and isinstance(out, torch.Tensor)
            and out.dtype == torch.int64
            and isinstance(args[0], torch.Tensor)
            and args[0].dtype != torch.int64
        ):
            self.events.append(f"cast:{args[0].dtype}->int64")
        return out


def _draft_extend_step(accepted_ids, compute_stream, plan_fn):
    """The order a draft-extend step uses: ids cast on the compute stream, then the
    plan stream (attention metadata) reads them."""
    ids = draft_extend_ids(accepted_ids, compute_stream)
    plan_fn(ids)
    return ids


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int16, torch.int8, torch.uint8, torch.int64]
)
def test_values_kept_and_int64(dtype):
    vals = [0, 1, 7, 42, 100, 127]
    if dtype == torch.int32:
        vals += [2**31 - 1, 49151]
    ids = torch.tensor(vals, dtype=dtype)
    out = draft_extend_ids(ids)
    assert out.dtype == torch.int64
    assert out.tolist() == vals
    assert out.shape == ids.shape


def test_int64_input_is_not_copied():
    ids = torch.tensor([3, 4], dtype=torch.int64)
    assert draft_extend_ids(ids) is ids
    assert to_int64(ids) is ids


def test_two_dim_ids_keep_shape():
    ids = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    out = draft_extend_ids(ids)
    assert out.dtype == torch.int64 and out.shape == (3, 4)
    assert torch.equal(out, ids.long())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_non_integer_ids_rejected(dtype):
    with pytest.raises(TypeError, match="dtype"):
        draft_extend_ids(torch.zeros(3, dtype=dtype))


def test_cast_inside_compute_stream_before_plan():
    events: list[str] = []
    compute = FakeStream("compute", events)
    seen_by_plan = []

    def plan_fn(ids):
        events.append("plan")
        seen_by_plan.append((ids.dtype, ids.tolist()))

    accepted = torch.tensor([5, 9, 2**31 - 2], dtype=torch.int32)
    with RecordCasts(events):
        out = _draft_extend_step(accepted, compute, plan_fn)

    assert events == ["compute:enter", "cast:torch.int32->int64", "compute:exit", "plan"]
    assert seen_by_plan == [(torch.int64, [5, 9, 2**31 - 2])]
    assert out.dtype == torch.int64


def test_cast_without_stream_still_int64():
    events: list[str] = []
    with RecordCasts(events):
        out = draft_extend_ids(torch.tensor([1, 2], dtype=torch.int32), None)
    assert events == ["cast:torch.int32->int64"]
    assert out.tolist() == [1, 2] and out.dtype == torch.int64


def test_stream_ctx_rejects_non_streams():
    with stream_ctx(None):
        pass
    with pytest.raises(TypeError):
        stream_ctx(object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cast_on_real_compute_stream():
    compute = torch.cuda.Stream()
    streams = []

    class RecordStream(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "to":
                streams.append(torch.cuda.current_stream())
            return func(*args, **(kwargs or {}))

    accepted = torch.tensor([1, 2, 3], dtype=torch.int32, device="cuda")
    with RecordStream():
        out = draft_extend_ids(accepted, compute)
    torch.cuda.synchronize()
    assert out.dtype == torch.int64 and out.tolist() == [1, 2, 3]
    assert streams and all(s == compute for s in streams)
