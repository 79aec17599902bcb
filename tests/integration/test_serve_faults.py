"""Faults in the serving path: a RankActor, or the engine core, killed mid-stream. Its
channel closes, so the streams it was serving end at once with an in-band error, new
requests get a 503 while the replica is down, and Serve replaces the replica (its health
check fails), after which requests succeed again. A 1-layer random model with SmolLM2's tokenizer keeps the
replacement's model load short."""
from __future__ import annotations

import pytest
from fault_scenario import kill_mid_stream_and_recover

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = "faults"


@pytest.fixture(scope="module")
def faults_url(server, tiny_model):
    """One app for both faults: each test ends on the replacement replica it waited for,
    which the next test kills in its turn (a new app would start the same replica again,
    20-30 s on 2 cores)."""
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    cfg = load_config(overrides=["device=cpu", "draft.enabled=false", "model.dtype=float32",
                                 "kv_cache.num_slots=4096", f"model.path={tiny_model}"])
    # A health check each second instead of each 10: the replacement starts sooner.
    serve.run(build_app(cfg, engine_options={"health_check_period_s": 1.0}), name=APP,
              route_prefix="/faults")
    try:
        yield server.base_url + "/faults/v1/completions"
    finally:
        serve.delete(APP)


@pytest.mark.parametrize("victim,message", [
    ("rank0", "rank 0"),  # its step channel closes under the engine core
    # The front channel closing under the replica: long, for make test's budget (the
    # rank's case runs the same failure and return one actor further down).
    pytest.param("core", "engine core closed its channel", marks=pytest.mark.long),
    # The replica itself (the HTTP server of the stream): the connection drops mid-body,
    # which the client sees as an error, not as a finished answer. Long, for make test's
    # budget: the rank's case sees the replica come back too.
    pytest.param("replica", None, marks=pytest.mark.long),
])
def test_killed_actor_fails_its_streams_fast_and_the_replica_comes_back(faults_url, victim, message):
    kill_mid_stream_and_recover(faults_url, APP, victim, message)
