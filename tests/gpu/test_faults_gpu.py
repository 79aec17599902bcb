"""Faults on the H200, where CUDA state is where hangs hide: with the h200 preset (graphs,
plan stream, speculation) a RankActor, then the Engine replica, is killed mid-stream. The
stream must end within 30 s, Serve must replace the replica, new requests must succeed, and
the killed replica's rank process must let go of the GPU (the scenario is the CPU test's,
tests/fault_scenario.py)."""
from __future__ import annotations

import subprocess
import time

import pytest

pytestmark = [pytest.mark.timeout(600)]

APP = "faults-gpu"


def gpu_pids() -> dict[int, int]:
    """pid -> MiB of every process holding memory on the GPU."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True)
    rows = [line.split(",") for line in out.stdout.splitlines() if line.strip()]
    return {int(pid): int(mib) for pid, mib in rows}


@pytest.fixture(scope="module")
def h200_url(h200_serve_port):
    from ray import serve

    from configs.schema import load_config
    from kestrel_testing import ROOT
    from serve_app.app import build_app
    cfg = load_config(path=str(ROOT / "configs" / "h200.yaml"))
    # A health check each second instead of each 10: the replacement starts sooner.
    serve.run(build_app(cfg, engine_options={"health_check_period_s": 1.0}), name=APP,
              route_prefix="/")
    yield f"http://127.0.0.1:{h200_serve_port}/v1/completions"


@pytest.mark.parametrize("victim,message", [("rank0", "rank 0"), ("replica", None)])
def test_killed_actor_on_the_gpu_fails_fast_and_frees_the_gpu(h200_url, victim, message):
    from fault_scenario import kill_mid_stream_and_recover, wait_until_serving
    wait_until_serving(h200_url)
    before = gpu_pids()
    # The one RankActor is the only process on the GPU (Ray's state API needs the
    # dashboard, which the fixture leaves off).
    ranks = list(before)
    assert len(ranks) == 1, before
    got = kill_mid_stream_and_recover(h200_url, APP, victim, message)
    deadline = time.monotonic() + 30
    while ranks[0] in gpu_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    after = gpu_pids()
    assert ranks[0] not in after, f"the killed replica's rank still holds {after[ranks[0]]} MiB"
    # The replacement holds about what the old one did, not that plus a leak.
    assert sum(after.values()) <= 1.1 * sum(before.values()), (before, after)
    print(f"{victim}: stream ended {got['stream_end_s']:.2f} s after the kill, serving again after "
          f"{got['recovered_s']:.1f} s ({len(got['refused'])} refused meanwhile); "
          f"GPU before {before} MiB, after {after} MiB")
