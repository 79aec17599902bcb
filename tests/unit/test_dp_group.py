"""DPGroup: world_size 1 fast path (no process group), 2-rank collectives, barrier and
destroy over gloo (spawned once for the file)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dp_harness import finish_rank, run_ranks
from actors.dp.group import DPGroup, find_free_port, resolve_backend

WORLD = 2
SLEEP_S = 0.6


# ----------------------------------------------------------------- world_size 1
def test_world_size_one_fast_path():
    assert not dist.is_initialized()
    g = DPGroup.init(0, 1)  # no address or port needed
    assert not dist.is_initialized(), "world_size 1 must not create a process group"
    assert g.world_size == 1 and g.rank == 0 and g.is_alive

    row = torch.tensor([2**40 + 7, 3, 1, 0, 1], dtype=torch.int64)
    out = g.all_gather_int64(row)
    assert out.shape == (1, 5) and out.dtype == torch.int64
    assert torch.equal(out, row[None])
    out[0, 0] = -1  # a new tensor, not a view of the caller's row
    assert row[0].item() == 2**40 + 7

    with pytest.raises(TypeError, match="torch.int32"):
        g.all_gather_int64(row.to(torch.int32))
    with pytest.raises(TypeError, match="torch.float32"):
        g.all_gather_int64(torch.zeros(5))

    g.barrier()
    g.destroy()
    g.destroy()  # idempotent
    assert not g.is_alive
    with pytest.raises(RuntimeError):
        g.all_gather_int64(row)
    with pytest.raises(RuntimeError):
        g.barrier()
    assert not dist.is_initialized()


def test_context_manager_destroys():
    with DPGroup.init(0, 1) as g:
        assert g.is_alive
    assert not g.is_alive


def test_init_argument_checks():
    with pytest.raises(ValueError):
        DPGroup.init(0, 0)
    with pytest.raises(ValueError):
        DPGroup.init(2, 2, master_port=12345)
    with pytest.raises(ValueError):
        DPGroup.init(0, 2)  # no port
    with pytest.raises(ValueError):
        resolve_backend("mpi")
    if not torch.cuda.is_available():
        assert resolve_backend("auto") == "gloo"
        with pytest.raises(RuntimeError):
            resolve_backend("nccl")
    else:
        assert resolve_backend("auto") == "nccl"


def test_find_free_port_is_bindable():
    port = find_free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


# ---------------------------------------------------------------------- 2 ranks
def _worker(rank: int, port: int, port2: int, outdir: str) -> None:
    res = {}
    g = DPGroup.init(rank, WORLD, "127.0.0.1", port, backend="auto", timeout_s=30)
    res["backend"] = g.backend
    res["initialized"] = dist.is_initialized()
    res["dist_world"] = dist.get_world_size()
    res["dist_rank"] = dist.get_rank()
    res["gathered"] = g.all_gather_int64(torch.tensor([rank, 10 + rank], dtype=torch.int64)).tolist()
    # dp_attention's row collectives: floats, or int64 and nothing narrower.
    res["rows"] = g.all_gather_rows(torch.full((2, 3), float(rank))).tolist()
    res["ids"] = g.all_gather_rows(torch.tensor([2**40 + rank], dtype=torch.int64)).tolist()
    res["summed"] = g.reduce_scatter_rows(torch.arange(4.0)[:, None] * (rank + 1)).tolist()
    res["swapped"] = g.all_to_all_rows(torch.tensor([[10 * rank], [10 * rank + 1]])).tolist()
    try:
        g.all_gather_rows(torch.zeros(2, dtype=torch.int32))
    except TypeError as e:
        res["int32_rows"] = str(e)

    # Barrier blocks until the slow rank arrives.
    if rank == 1:
        time.sleep(SLEEP_S)
    t0 = time.monotonic()
    g.barrier()
    res["barrier_wait_s"] = time.monotonic() - t0

    g.destroy()
    res["initialized_after_destroy"] = dist.is_initialized()
    g.destroy()  # idempotent
    try:
        g.barrier()
        res["barrier_after_destroy"] = None
    except RuntimeError as e:
        res["barrier_after_destroy"] = str(e)

    # The process can join a fresh group after destroy.
    g2 = DPGroup.init(rank, WORLD, "127.0.0.1", port2, backend="gloo", timeout_s=30)
    res["regathered"] = g2.all_gather_int64(torch.tensor([100 * rank], dtype=torch.int64)).tolist()
    g2.barrier()
    g2.destroy()
    res["initialized_at_end"] = dist.is_initialized()
    finish_rank(outdir, rank, res)


def _run_ranks(outdir: Path, timeout_s: float = 60.0) -> list[dict]:
    port, port2 = find_free_port(), find_free_port()
    while port2 == port:
        port2 = find_free_port()
    return run_ranks(_worker, (port, port2), outdir, WORLD, timeout_s)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _run_ranks(tmp_path_factory.mktemp("dp_group"))


def test_two_ranks_join(ranks):
    for r, res in enumerate(ranks):
        assert res["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
        assert res["initialized"] and res["dist_world"] == WORLD and res["dist_rank"] == r
        assert res["gathered"] == [[0, 10], [1, 11]]


def test_two_ranks_row_collectives(ranks):
    for r, res in enumerate(ranks):
        assert res["rows"] == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
        assert res["ids"] == [2**40, 2**40 + 1]
        # Rows [0, 1, 2, 3] times 1 and times 2, summed: rank r keeps block r.
        assert res["summed"] == [[3.0 * i] for i in (2 * r, 2 * r + 1)]
        assert res["swapped"] == [[r], [10 + r]]  # block j of each rank went to rank j
        assert "torch.int32" in res["int32_rows"]


def test_two_ranks_barrier_waits_for_slow_rank(ranks):
    # rank 0 arrived early and had to wait for rank 1's sleep.
    assert ranks[0]["barrier_wait_s"] >= SLEEP_S / 2, ranks[0]["barrier_wait_s"]


def test_two_ranks_destroy(ranks):
    for res in ranks:
        assert res["initialized_after_destroy"] is False
        assert res["barrier_after_destroy"] and "destroyed" in res["barrier_after_destroy"]
        assert res["regathered"] == [[0], [100]]
        assert res["initialized_at_end"] is False
