"""C03: each rank's sync row is int64 [num_tokens, num_tokens_for_logprob,
can_run_graph, is_extend, forward_mode]; after the all-gather the token counts are
column 0 of every rank, can_run_graph the min, is_extend the max; an idle rank
contributes a well-defined idle row; values above 2**32 survive exactly.
Two processes over gloo, spawned once for the whole file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dp_harness import finish_rank, run_ranks
from actors.dp.group import DPGroup, find_free_port
from actors.dp.sync import (
    SYNC_ROW_LEN,
    DPSyncResult,
    ForwardMode,
    dp_sync,
    idle_sync_row,
    make_sync_row,
)

WORLD = 2
BIG = 2**40 + 7
BIGGER = 2**62 + 3
IDLE = None  # a rank with no work this step

# Per step: (rank 0 args, rank 1 args) for make_sync_row, or IDLE.
STEPS = {
    "big_vs_idle": ((BIG, BIGGER, True, False, ForwardMode.DECODE), IDLE),
    "extend_no_graph": ((5, 5, False, True, ForwardMode.EXTEND), (3, 1, True, False, ForwardMode.DECODE)),
    "verify_vs_draft": ((4, 0, True, False, ForwardMode.TARGET_VERIFY), (2**33, 7, False, True, ForwardMode.DRAFT_EXTEND)),
    "idle_vs_extend": (IDLE, (9, 9, True, True, ForwardMode.EXTEND)),
    "all_idle": (IDLE, IDLE),
}


def _row(args):
    return idle_sync_row() if args is IDLE else make_sync_row(*args)


def _worker(rank: int, port: int, outdir: str) -> None:
    res = {}
    group = DPGroup.init(rank, WORLD, "127.0.0.1", port, backend="gloo", timeout_s=30)
    try:
        for name, per_rank in STEPS.items():
            row = _row(per_rank[rank])
            raw = group.all_gather_int64(row)  # the raw payload ...
            sync = dp_sync(group, row)  # ... and the reduced result
            res[name] = dict(row=row.tolist(), raw_dtype=raw.dtype, raw=raw.tolist(), sync=sync)
    finally:
        group.destroy()
    finish_rank(outdir, rank, res)


def _run_ranks(outdir: Path, timeout_s: float = 60.0) -> list[dict]:
    port = find_free_port()
    return run_ranks(_worker, (port,), outdir, WORLD, timeout_s)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _run_ranks(tmp_path_factory.mktemp("c03"))


IDLE_ROW = [0, 0, 1, 0, int(ForwardMode.IDLE)]


def _expected_rows(name):
    return [IDLE_ROW if a is IDLE else [a[0], a[1], int(a[2]), int(a[3]), int(a[4])] for a in STEPS[name]]


@pytest.mark.parametrize("name", list(STEPS))
def test_rows_gathered_exactly_on_every_rank(ranks, name):
    expected = _expected_rows(name)
    for r in range(WORLD):
        got = ranks[r][name]
        assert got["row"] == expected[r]
        assert got["raw_dtype"] == torch.int64
        assert got["raw"] == expected  # same [world, 5] payload on both ranks


@pytest.mark.parametrize("name", list(STEPS))
def test_reduction(ranks, name):
    expected = _expected_rows(name)
    want = DPSyncResult(
        tokens_per_rank=[row[0] for row in expected],
        logprob_tokens_per_rank=[row[1] for row in expected],
        can_run_graph=bool(min(row[2] for row in expected)),
        is_extend=bool(max(row[3] for row in expected)),
        max_tokens=max(row[0] for row in expected),
        forward_mode_per_rank=[ForwardMode(row[4]) for row in expected],
    )
    for r in range(WORLD):
        assert ranks[r][name]["sync"] == want


def test_specific_reductions(ranks):
    s = ranks[1]["big_vs_idle"]["sync"]
    assert s.tokens_per_rank == [BIG, 0] and s.max_tokens == BIG
    assert s.logprob_tokens_per_rank == [BIGGER, 0]
    assert s.can_run_graph is True and s.is_extend is False  # idle row does not veto
    assert s.forward_mode_per_rank == [ForwardMode.DECODE, ForwardMode.IDLE]

    s = ranks[0]["extend_no_graph"]["sync"]
    assert s.can_run_graph is False and s.is_extend is True  # min / max
    assert s.tokens_per_rank == [5, 3] and s.max_tokens == 5

    s = ranks[0]["verify_vs_draft"]["sync"]
    assert s.tokens_per_rank == [4, 2**33] and s.can_run_graph is False and s.is_extend is True

    s = ranks[0]["all_idle"]["sync"]
    assert s.all_idle and s.max_tokens == 0 and s.can_run_graph is True and not s.is_extend


def test_large_values_survive_exactly(ranks):
    for r in range(WORLD):
        raw = ranks[r]["big_vs_idle"]["raw"]
        assert raw[0][0] == BIG and raw[0][1] == BIGGER
        assert raw[0][0] != BIG & 0xFFFFFFFF  # not truncated to 32 bits


def test_idle_row_definition():
    row = idle_sync_row()
    assert row.dtype == torch.int64 and row.shape == (SYNC_ROW_LEN,)
    assert row.tolist() == IDLE_ROW


def test_make_sync_row_local():
    row = make_sync_row(torch.tensor(3, dtype=torch.int32), torch.tensor(BIG), True, True, 4)
    assert row.dtype == torch.int64 and row.tolist() == [3, BIG, 1, 1, 4]
    with pytest.raises(TypeError):
        make_sync_row(2.5, 0, True, False, ForwardMode.DECODE)
    with pytest.raises(ValueError):
        make_sync_row(-1, 0, True, False, ForwardMode.DECODE)
    with pytest.raises(ValueError):
        make_sync_row(1, 0, True, False, 9)


def test_dp_sync_rejects_bad_rows():
    group = DPGroup.init(0, 1)
    with pytest.raises(TypeError, match="int32"):
        dp_sync(group, idle_sync_row().to(torch.int32))
    with pytest.raises(ValueError):
        dp_sync(group, torch.zeros(4, dtype=torch.int64))
    s = dp_sync(group, make_sync_row(BIG, 1, False, True, ForwardMode.EXTEND))
    assert s.tokens_per_rank == [BIG] and s.can_run_graph is False and s.is_extend is True
