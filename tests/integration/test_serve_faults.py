"""Faults in the serving path: a RankActor, or the engine core, killed mid-stream. Its
channel closes, so the streams it was serving end at once with an in-band error, new
requests get a 503 while the replica is down, and Serve replaces the replica (its health
check fails), after which requests succeed again. A 1-layer random model with SmolLM2's tokenizer keeps the
replacement's model load short."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

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
    ("core", "engine core closed its channel"),  # the front channel closes under the replica
    # The replica itself (the HTTP server of the stream): the connection drops mid-body,
    # which the client sees as an error, not as a finished answer.
    ("replica", None),
])
def test_killed_actor_fails_its_streams_fast_and_the_replica_comes_back(faults_url, victim, message):
    import ray
    from ray import serve

    url = faults_url
    # The app serves: after the other fault, its replacement replica (which that test
    # waited for, unless it failed first).
    deadline = time.monotonic() + 180
    while httpx.post(url, json={"prompt": "Hello", "max_tokens": 4}, timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the app does not serve"
        time.sleep(0.5)
    engine = serve.get_deployment_handle("EngineDeployment", app_name=APP)
    replica = engine.stats.remote().result(timeout_s=30)["replica"]
    events: list[dict] = []
    started, ended = threading.Event(), threading.Event()
    ended_at: list[float] = []
    broken: list[Exception] = []  # the connection's error, if it dropped

    def long_stream():
        body = {"prompt": "Once upon a time", "max_tokens": 1000000, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", url, json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        started.set()
        except httpx.HTTPError as e:
            broken.append(e)
        ended_at.append(time.monotonic())
        ended.set()

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    assert started.wait(60), "the stream never started"
    time.sleep(0.5)
    killed_at = time.monotonic()
    if victim == "replica":
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#EngineDeployment#{replica}", namespace="serve"))
    else:
        ray.kill(ray.get_actor(f"kestrel-{replica}-{victim}", namespace="kestrel"))
    assert ended.wait(30), "the stream did not end within 30 s of the kill"
    assert ended_at[0] - killed_at < 10
    if message is None:
        assert broken, events[-1]  # dropped mid-body: never a clean end
    else:
        assert not broken, broken
        err = events[-1].get("error")
        assert err is not None, events[-1]  # in-band: the 200 status line had gone out
        assert message in err["message"] and "closed its" in err["message"], err

    # The replica is replaced; until then new requests are refused with a clear status.
    deadline = time.monotonic() + 180
    statuses = []
    while time.monotonic() < deadline:
        r = httpx.post(url, json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code in (500, 502, 503), r.text[:300]
        time.sleep(0.5)
    assert statuses[-1] == 200, statuses
    assert engine.stats.remote().result(timeout_s=30)["replica"] != replica
    # Nothing of the old replica lives on (its actors would hold a GPU each).
    deadline = time.monotonic() + 30
    left = ["rank0", "core"]
    while left and time.monotonic() < deadline:
        left = [a for a in left if _alive(f"kestrel-{replica}-{a}")]
        time.sleep(0.5)
    assert not left, f"the old replica's {left} outlived it"


def _alive(name: str) -> bool:
    import ray
    try:
        ray.get_actor(name, namespace="kestrel")
        return True
    except ValueError:
        return False
