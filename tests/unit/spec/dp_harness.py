"""Spawned gloo ranks for the DP tests: each rank writes its results to a pickle and
leaves fast; the parent gathers them, failing (not hanging) if a rank gets stuck."""
from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def finish_rank(outdir: str, rank: int, res: dict) -> None:
    """Write this rank's results, then leave without interpreter teardown, which takes
    seconds on a loaded 2-core machine. Only the success path gets here: an exception
    still goes through torch.multiprocessing's error report."""
    with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker, args: tuple, outdir: Path, world: int, timeout_s: float = 60.0) -> list[dict]:
    """mp.spawn(worker, (*args, outdir)) over `world` ranks; their results in rank order."""
    ctx = mp.spawn(worker, args=(*args, str(outdir)), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"DP ranks did not finish within {timeout_s}s")
    out = []
    for r in range(world):
        with open(outdir / f"rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out
