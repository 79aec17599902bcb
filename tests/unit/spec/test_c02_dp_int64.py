"""C02: with two DP ranks, one busy (int32 producer) and one idle (empty batch), every
integer tensor that enters a collective or a padded input is int64 on both ranks;
padding keeps dtype. Two processes over gloo, spawned once for the whole file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dp_harness import finish_rank, run_ranks
from actors.dp.group import DPGroup, find_free_port
from actors.dp.sync import dp_sync, idle_sync_row, make_sync_row, pad_int64
from actors.worker.forward_batch import ForwardMode

WORLD = 2
PAD_FILL = 0
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "all_to_all_single")

# What the busy rank's producer yields per step (as int32, like a real producer).
BUSY_STEPS = [
    dict(ids=[11, 12, 13], mode=ForwardMode.EXTEND),
    dict(ids=[21, 22], mode=ForwardMode.DECODE),
    dict(ids=[2**31 - 1], mode=ForwardMode.DECODE),
]


def _producer(rank: int):
    """Rank 0 is busy: int32 counts and ids. Rank 1 is idle: empty batches, one of
    them built the careless way (``torch.tensor([])`` is float32)."""
    for step, spec in enumerate(BUSY_STEPS):
        if rank == 0:
            ids = torch.tensor(spec["ids"], dtype=torch.int32)
            yield dict(num_tokens=torch.tensor(len(spec["ids"]), dtype=torch.int32), ids=ids, mode=spec["mode"])
        else:
            empty = torch.empty(0, dtype=torch.int32) if step % 2 == 0 else torch.tensor([])
            yield dict(num_tokens=None, ids=empty, mode=ForwardMode.IDLE)


def _describe(x):
    if isinstance(x, torch.Tensor):
        return [x.dtype]
    if isinstance(x, (list, tuple)):
        return [d for y in x for d in _describe(y)]
    return []


def _worker(rank: int, port: int, outdir: str) -> None:
    seen: list = []  # (collective name, dtype) of every tensor handed to torch.distributed
    originals = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def wrapped(*args, __name=name, __fn=fn, **kwargs):
            seen.extend((__name, d) for d in _describe(list(args) + list(kwargs.values())))
            return __fn(*args, **kwargs)

        setattr(dist, name, wrapped)

    res: dict = {"steps": []}
    group = DPGroup.init(rank, WORLD, "127.0.0.1", port, backend="gloo", timeout_s=30)
    try:
        for batch in _producer(rank):
            if batch["num_tokens"] is None:
                row = idle_sync_row()
            else:
                row = make_sync_row(
                    batch["num_tokens"],
                    batch["num_tokens"],
                    can_run_graph=True,
                    is_extend=batch["mode"] == ForwardMode.EXTEND,
                    forward_mode=batch["mode"],
                )
            sync = dp_sync(group, row)
            padded = pad_int64(batch["ids"], sync.max_tokens, PAD_FILL)
            gathered = group.all_gather_int64(padded)
            res["steps"].append(
                dict(
                    row_dtype=row.dtype,
                    input_dtype=batch["ids"].dtype,
                    padded_dtype=padded.dtype,
                    padded=padded.tolist(),
                    gathered_dtype=gathered.dtype,
                    gathered=gathered.tolist(),
                    tokens=sync.tokens_per_rank,
                )
            )

        # Anything that is not int64 is refused before it reaches torch.distributed.
        n_before = len(seen)
        errors = []
        for bad in (
            torch.tensor([1, 2], dtype=torch.int32),
            torch.empty(0, dtype=torch.int32),
            torch.tensor([1.0, 2.0]),
            [1, 2],
        ):
            try:
                group.all_gather_int64(bad)
                errors.append(None)
            except TypeError as e:
                errors.append(str(e))
        res["errors"] = errors
        res["seen_after_errors"] = len(seen) - n_before
        group.barrier()
    finally:
        group.destroy()
        for name, fn in originals.items():
            setattr(dist, name, fn)
    res["seen"] = seen
    finish_rank(outdir, rank, res)


def _run_ranks(outdir: Path, timeout_s: float = 60.0) -> list[dict]:
    port = find_free_port()
    return run_ranks(_worker, (port,), outdir, WORLD, timeout_s)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _run_ranks(tmp_path_factory.mktemp("c02"))


def test_producer_really_is_int32_and_idle_rank_empty(ranks):
    busy, idle = ranks
    assert all(s["input_dtype"] == torch.int32 for s in busy["steps"])
    assert {s["input_dtype"] for s in idle["steps"]} == {torch.int32, torch.float32}


def test_every_collective_tensor_is_int64_on_both_ranks(ranks):
    for r in ranks:
        assert r["seen"], "no collective was recorded"
        assert {d for _, d in r["seen"]} == {torch.int64}, r["seen"]
    # Both ranks handed the same sequence of collectives and dtypes to the backend.
    assert ranks[0]["seen"] == ranks[1]["seen"]


def test_sync_rows_and_padded_inputs_are_int64(ranks):
    for r in ranks:
        for s in r["steps"]:
            assert s["row_dtype"] == torch.int64
            assert s["padded_dtype"] == torch.int64
            assert s["gathered_dtype"] == torch.int64


def test_padding_values_and_lengths(ranks):
    busy, idle = ranks
    for step, spec in enumerate(BUSY_STEPS):
        n = len(spec["ids"])
        assert busy["steps"][step]["tokens"] == [n, 0]
        assert idle["steps"][step]["tokens"] == [n, 0]
        assert busy["steps"][step]["padded"] == spec["ids"]
        assert idle["steps"][step]["padded"] == [PAD_FILL] * n
        expected = [spec["ids"], [PAD_FILL] * n]
        assert busy["steps"][step]["gathered"] == expected
        assert idle["steps"][step]["gathered"] == expected


def test_non_int64_all_gather_raises_type_error(ranks):
    for r in ranks:
        int32_err, empty_int32_err, float_err, list_err = r["errors"]
        assert int32_err is not None and "torch.int32" in int32_err
        assert empty_int32_err is not None and "torch.int32" in empty_int32_err
        assert float_err is not None and "torch.float32" in float_err
        assert list_err is not None
        assert r["seen_after_errors"] == 0, "a rejected tensor reached torch.distributed"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.int64])
def test_pad_int64_local(dtype):
    out = pad_int64(torch.tensor([1, 2, 3], dtype=dtype), 5, 7)
    assert out.dtype == torch.int64 and out.tolist() == [1, 2, 3, 7, 7]
    empty = pad_int64(torch.empty(0, dtype=dtype), 3, 1)
    assert empty.dtype == torch.int64 and empty.tolist() == [1, 1, 1]
    assert pad_int64(torch.empty(0, dtype=dtype), 0, 1).dtype == torch.int64
    assert pad_int64(torch.tensor([4], dtype=dtype), 1, 0).dtype == torch.int64


def test_pad_int64_rejects():
    with pytest.raises(TypeError):
        pad_int64(torch.tensor([1.0, 2.0]), 4, 0)
    with pytest.raises(ValueError):
        pad_int64(torch.tensor([1, 2, 3]), 2, 0)
    with pytest.raises(ValueError):
        pad_int64(torch.zeros(2, 2, dtype=torch.int64), 4, 0)
