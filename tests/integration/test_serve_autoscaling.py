"""Engine autoscaling: 1 -> 2 replicas under a burst, back to 1 while requests still run on
the replica being removed (Serve drains it: the requests must finish whole).

A second app on the session's Ray cluster (route prefix /as), so it costs one more model
load per replica but no new cluster. Slow: replicas load a model each on a small CPU box.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")]

APP = "autoscale"


def replica_states(app: str = APP) -> dict[str, int]:
    from ray import serve
    status = serve.status().applications.get(app)
    if status is None or "EngineDeployment" not in status.deployments:
        return {}
    return {str(k): v for k, v in status.deployments["EngineDeployment"].replica_states.items()}


def stream(url: str, prompt: str, max_tokens: int, stop: threading.Event | None = None):
    """One streamed completion: (completion tokens from the usage chunk, finish reason), or
    "left" if `stop` was set first (the client hangs up)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens, finish = 0, None
    with httpx.stream("POST", url, json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if stop is not None and stop.is_set():
                return "left"
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for ch in chunk["choices"]:
                finish = ch["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, finish


def wait_for(pred, timeout: float, what: str, period: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: {replica_states()}")


def test_engine_scales_out_under_burst_and_back_without_cutting_requests(server):
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    cfg = load_config(overrides=server.overrides + [
        "serve.engine_autoscaling.min_replicas=1", "serve.engine_autoscaling.max_replicas=2",
        "serve.engine_autoscaling.target_ongoing_requests=2",
        "serve.engine_autoscaling.upscale_delay_s=0", "serve.engine_autoscaling.downscale_delay_s=3",
        "scheduler.max_queued_requests=16"])
    app = build_app(cfg, engine_options={"autoscaling_config": {"look_back_period_s": 2.0,
                                                                "metrics_interval_s": 1.0},
                                         "graceful_shutdown_timeout_s": 300})
    t0 = time.monotonic()
    serve.run(app, name=APP, route_prefix="/as")
    url = server.base_url + "/as/v1/completions"
    assert replica_states() == {"RUNNING": 1}
    log = [f"app up in {time.monotonic() - t0:.0f}s"]

    pool = ThreadPoolExecutor(max_workers=16)
    hang_up = threading.Event()
    try:
        # A burst: 8 ongoing against a target of 2 per replica asks for 2 replicas. It runs
        # until the second replica is up, then its clients hang up.
        t1 = time.monotonic()
        burst = [pool.submit(stream, url, f"Story number {i}:", 2000, hang_up) for i in range(8)]
        wait_for(lambda: replica_states().get("RUNNING") == 2, 240, "a second replica")
        log.append(f"2 replicas {time.monotonic() - t1:.0f}s after the burst")
        # Long requests routed now land on the idle new replica, which is also the one
        # Serve removes first when scaling in (newest first): they must survive it.
        probes = [pool.submit(stream, url, f"Probe {i}:", 200) for i in range(2)]
        time.sleep(1.0)  # let the probes reach the engine before the load drops
        hang_up.set()
        assert [f.result(timeout=60) for f in burst] == ["left"] * 8

        seen_stopping = threading.Event()

        def scaled_in():
            states = replica_states()
            if states.get("STOPPING") and not all(p.done() for p in probes):
                seen_stopping.set()
            return states == {"RUNNING": 1}
        wait_for(scaled_in, 300, "scale-in to 1 replica", period=0.25)
        log.append(f"back to 1 replica {time.monotonic() - t1:.0f}s after the burst")
        assert seen_stopping.is_set(), "no replica was stopping while the probes ran"
        assert [f.result(timeout=300) for f in probes] == [(200, "length")] * 2
        log.append(f"probes whole after {time.monotonic() - t1:.0f}s")
        server_engine = serve.get_deployment_handle("EngineDeployment", app_name=APP)
        assert server_engine.num_running.remote().result(timeout_s=30) == 0
    finally:
        hang_up.set()
        pool.shutdown(wait=False, cancel_futures=True)
        serve.delete(APP)
        print("\n" + "\n".join(log))
