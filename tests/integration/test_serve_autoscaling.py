"""Engine autoscaling: 1 -> 2 replicas under a burst, back to 1 while requests still run on
the replica being removed (Serve drains it: the requests must finish whole).

A second app on the session's Ray cluster (route prefix /as), so it costs no new cluster,
on two worker nodes added to it (one `kestrel_node` each, which each replica asks for:
serve.replica_resources), deployed from a config file as `serve deploy` deploys one: the
two replicas run one on each worker node, none on the head, as test_serve_cluster.py's
do. It serves the 1-layer random model with SmolLM2's tokenizer (the tiny_model fixture):
what is under test is Serve's scaling and the replica's drain, not the model, and a
replica that loads SmolLM2 takes 10-20 s longer to start (twice here, the second time
beside a burst). Slow all the same: each replica starts three processes on a small CPU box.
"""
from __future__ import annotations

import json
from functools import partial
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import serve_replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")]

APP = "autoscale"
replica_states = partial(serve_replicas.replica_states, APP)
wait_for = partial(serve_replicas.wait_for, app=APP)


@pytest.fixture
def worker_nodes(ray_cluster) -> dict:
    """Two worker nodes for the app's replicas, {node id: node}, removed after the test."""
    nodes = {}
    try:
        for _ in range(2):
            node = serve_replicas.add_worker_node(ray_cluster)
            nodes[node.node_id] = node
        yield nodes
    finally:
        for node in nodes.values():
            ray_cluster.remove_node(node)


def stream(url: str, prompt: str, max_tokens: int, stop: threading.Event | None = None,
           first: threading.Event | None = None):
    """One streamed completion: (completion tokens from the usage chunk, finish reason), or
    "left" if `stop` was set first (the client hangs up). `first` is set at the first chunk
    (the request is in an engine)."""
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
            if first is not None:
                first.set()
            for ch in chunk["choices"]:
                finish = ch["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, finish


def serving_replica(base_url: str) -> str:
    """The replica that HAProxy sends a new connection to: the app's /metrics names it."""
    text = httpx.get(base_url + "/as/metrics", timeout=30).text
    m = re.search(r'^kestrel_num_requests_running\{[^}]*replica="([^"]+)"', text, re.M)
    assert m, text[-2000:]
    return m.group(1)


# The tiny model decodes fast, so the probes' length is measured, not fixed: a probe is
# as many tokens as one request alone makes in PROBE_S, and the scale-in starts 3-4 s after
# the burst's clients hang up (look-back 1.5 s, downscale delay 1 s, metrics each second);
# with the load of two replicas on the machine a probe runs longer than alone.
PROBE_S = 8.0
MAX_MODEL_LEN = 16384
BURST_TOKENS = 8000


@pytest.fixture
def app_url(server, tiny_model, worker_nodes):
    """The app, one replica running: its completions URL."""
    from ray import serve
    overrides = server.overrides + [
        f"model.path={tiny_model}", f"model.max_model_len={MAX_MODEL_LEN}", "kv_cache.num_slots=131072",
        # Lighter on the CPU while the second replica starts beside the burst: one torch
        # thread, tokens sent in batches.
        "cpu_threads=1", "serve.stream_interval_ms=100",
        f"serve.replica_resources={{{serve_replicas.NODE_RESOURCE}: 1}}",
        "serve.engine_autoscaling.min_replicas=1", "serve.engine_autoscaling.max_replicas=2",
        "serve.engine_autoscaling.target_ongoing_requests=2",
        "serve.engine_autoscaling.upscale_delay_s=0", "serve.engine_autoscaling.downscale_delay_s=1",
        "scheduler.max_queued_requests=16"]
    t0 = time.monotonic()
    serve_replicas.serve_deploy(serve_replicas.deploy_config(
        APP, "/as", int(server.base_url.rsplit(":", 1)[1]), overrides,
        autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                     "upscale_delay_s": 0, "downscale_delay_s": 1,
                     "look_back_period_s": 1.5, "metrics_interval_s": 1.0},
        graceful_shutdown_timeout_s=300))
    try:
        wait_for(lambda: serve_replicas.app_status(APP) == "RUNNING", 240, "the app to run")
        print(f"\n2 worker nodes and the app up in {time.monotonic() - t0:.0f}s")
        yield server.base_url + "/as/v1/completions"
    finally:
        serve.delete(APP)


def test_engine_scales_out_under_burst_and_back_without_cutting_requests(server, app_url, worker_nodes):
    from ray import serve

    url = app_url
    assert replica_states() == {"RUNNING": 1}
    first = serving_replica(server.base_url)
    engine = serve.get_deployment_handle("EngineDeployment", app_name=APP)
    log = []
    tc = time.monotonic()
    assert stream(url, "Calibrate:", 500) == (500, "length")
    probe_tokens = min(MAX_MODEL_LEN - 64, int(500 / (time.monotonic() - tc) * PROBE_S))
    log.append(f"probes of {probe_tokens} tokens")

    pool = ThreadPoolExecutor(max_workers=16)
    hang_up, scaled_out = threading.Event(), threading.Event()

    def burst_client(i: int):
        """Long requests one after another until the second replica is up (the tiny model
        may finish one before), then the last one until the clients hang up."""
        while True:
            got = stream(url, f"Story number {i}:", BURST_TOKENS, hang_up)
            if got == "left":
                return got
            assert got == (BURST_TOKENS, "length"), got
            if scaled_out.is_set():  # none sent after scale-out
                hang_up.wait()
                return "done"

    try:
        # A burst: 8 ongoing against a target of 2 per replica asks for 2 replicas. It runs
        # until the second replica is up, then its clients hang up.
        t1 = time.monotonic()
        burst = [pool.submit(burst_client, i) for i in range(8)]
        wait_for(lambda: replica_states().get("RUNNING") == 2, 240, "a second replica")
        scaled_out.set()
        log.append(f"2 replicas {time.monotonic() - t1:.0f}s after the burst")
        # HAProxy routes to the new replica a moment after Serve reports it running.
        wait_for(lambda: serving_replica(server.base_url) != first, 60,
                 "HAProxy to route to the new replica", period=0.2)
        hang_up.set()
        assert set(f.result(timeout=60) for f in burst) <= {"left", "done"}
        # Long requests until each replica holds one: Serve may remove either (on nodes of one
        # replica each, not the newest but the first of the nodes it lists), and the one it
        # removes must drain its requests. HAProxy sends each to the replica with the fewest
        # connections, but may still count a burst connection that is closing.
        t2 = time.monotonic()
        probes: list = []
        for i in range(6):
            started = threading.Event()
            probes.append(pool.submit(stream, url, f"Probe {i}:", probe_tokens, None, started))
            wait_for(started.is_set, 60, f"probe {i}'s first token", period=0.05)
            held = serve_replicas.replicas_by_node(engine, 2)
            if all(r["held"] >= 1 for r in held.values()):
                break
        assert all(r["held"] >= 1 for r in held.values()), held
        # One replica on each worker node, none on the head.
        assert {r["node"] for r in held.values()} == set(worker_nodes), (held, set(worker_nodes))

        # Seen stopping with no probe done yet: the ones on the stopping replica still run.
        seen_stopping = serve_replicas.scale_in_while_running(APP, 1, probes)
        log.append(f"back to 1 replica {time.monotonic() - t1:.0f}s after the burst")
        assert seen_stopping, "no replica was stopping while the probes ran"
        assert [f.result(timeout=300) for f in probes] == [(probe_tokens, "length")] * len(probes)
        log.append(f"{len(probes)} probes whole after {time.monotonic() - t1:.0f}s ({time.monotonic() - t2:.1f}s)")
        left = serve_replicas.replicas_by_node(engine, 1)
        assert set(left) < set(held) and [r["held"] for r in left.values()] == [0], (left, held)
    finally:
        hang_up.set()
        pool.shutdown(wait=False, cancel_futures=True)
        print("\n" + "\n".join(log))
