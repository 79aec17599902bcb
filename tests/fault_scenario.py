"""One fault, start to end, for the CPU integration test and its H200 twin: a long stream
runs, an actor of the replica is killed, the stream must end within 30 s (with an in-band
error, or a dropped connection where the HTTP server itself died), new requests get a clear
status until Serve has replaced the replica, and then succeed; nothing of the old replica
lives on."""
from __future__ import annotations

import json
import threading
import time

import httpx


def wait_until_serving(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while httpx.post(url, json={"prompt": "Hello", "max_tokens": 4}, timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the app does not serve"
        time.sleep(0.5)


def kill_mid_stream_and_recover(url: str, app: str, victim: str, message: str | None) -> dict:
    """victim: "rank0", "core" (actors of the replica, by name) or "replica" (the Serve
    replica's own actor). Returns timings and the replicas involved."""
    import ray
    from ray import serve

    wait_until_serving(url)
    engine = serve.get_deployment_handle("EngineDeployment", app_name=app)
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

    threading.Thread(target=long_stream, daemon=True).start()
    assert started.wait(60), "the stream never started"
    time.sleep(0.5)
    killed_at = time.monotonic()
    if victim == "replica":
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{app}#EngineDeployment#{replica}", namespace="serve"))
    else:
        ray.kill(ray.get_actor(f"kestrel-{replica}-{victim}", namespace="kestrel"))
    assert ended.wait(30), "the stream did not end within 30 s of the kill"
    stream_end_s = ended_at[0] - killed_at
    assert stream_end_s < 10
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
    recovered_s = time.monotonic() - killed_at
    new_replica = engine.stats.remote().result(timeout_s=30)["replica"]
    assert new_replica != replica
    # Nothing of the old replica lives on (its actors would hold a GPU each).
    deadline = time.monotonic() + 30
    left = ["rank0", "core"]
    while left and time.monotonic() < deadline:
        left = [a for a in left if _alive(f"kestrel-{replica}-{a}")]
        time.sleep(0.5)
    assert not left, f"the old replica's {left} outlived it"
    return {"stream_end_s": stream_end_s, "recovered_s": recovered_s, "refused": statuses[:-1],
            "old_replica": replica, "new_replica": new_replica}


def _alive(name: str) -> bool:
    import ray
    try:
        ray.get_actor(name, namespace="kestrel")
        return True
    except ValueError:
        return False
