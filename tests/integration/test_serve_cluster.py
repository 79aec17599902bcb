"""Kestrel on a Ray cluster of several nodes: replicas spread over worker nodes, a node
joining under load (autoscaling puts the new replica there, scale-in drains), a node
without the model, a node lost under load, a redeploy under traffic.

The session's Ray cluster is a `ray.cluster_utils.Cluster` (conftest.py); this module adds
worker nodes to it: more raylets on this machine, each with 3 CPUs and one `kestrel_node`,
a custom resource standing for a GPU node type. The app asks for one `kestrel_node` per
replica (serve.replica_resources), so replicas run only on worker nodes, one per node, as
on a cluster of one-GPU nodes. It is deployed as `serve deploy` deploys a config file
(the controller's apply_config, which the dashboard's REST endpoint calls), with
Kestrel's app builder and the 1-layer tiny model (what is under test is Serve, HAProxy and
the replica's start, drain and death, not the model). HAProxy runs on the head alone
(conftest.py: worker proxies would share this machine's port).

The tests run in order on one app, each leaving the cluster as the next expects; the
figures they measure are printed (docs/reliability.md records them).
"""
from __future__ import annotations

import json
from functools import partial
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

import serve_replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")]

APP = "cluster"
replica_states = partial(serve_replicas.replica_states, APP)
wait_for = partial(serve_replicas.wait_for, app=APP)
app_status = partial(serve_replicas.app_status, APP)
serve_deploy, replicas_by_node = serve_replicas.serve_deploy, serve_replicas.replicas_by_node
NODE_RESOURCE = serve_replicas.NODE_RESOURCE
MAX_MODEL_LEN = 16384
BURST_TOKENS = 8000


def app_overrides(tiny_model: str) -> list[str]:
    return ["device=cpu", "draft.enabled=false", f"model.path={tiny_model}",
            f"model.max_model_len={MAX_MODEL_LEN}", "kv_cache.num_slots=131072",
            # Light on the 2 cores that all nodes share: one torch thread, tokens in batches.
            "cpu_threads=1", "serve.stream_interval_ms=100", "scheduler.max_queued_requests=16",
            f"serve.replica_resources={{{NODE_RESOURCE}: 1}}",
            "serve.engine_autoscaling.min_replicas=2", "serve.engine_autoscaling.max_replicas=3",
            "serve.engine_autoscaling.target_ongoing_requests=2",
            "serve.engine_autoscaling.upscale_delay_s=0", "serve.engine_autoscaling.downscale_delay_s=1"]


def deploy_config(port: int, overrides: list[str], code_version: str) -> dict:
    return serve_replicas.deploy_config(
        APP, "/cluster", port, overrides, code_version=code_version,
        autoscaling={"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 2,
                     "upscale_delay_s": 0, "downscale_delay_s": 1,
                     "look_back_period_s": 1.5, "metrics_interval_s": 1.0},
        health_check_period_s=1.0, graceful_shutdown_timeout_s=120)


def stream(url: str, prompt: str, max_tokens: int, stop: threading.Event | None = None,
           first: threading.Event | None = None):
    """One streamed completion -> ("whole", tokens, finish), ("left",) if `stop` was set
    first (the client hangs up), ("error_event", message), ("cut", exception) for a
    connection that ended before the stream did, or ("status", code)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens, finish, done = 0, None, False
    try:
        with httpx.stream("POST", url, json=body, timeout=httpx.Timeout(120, connect=10)) as r:
            if r.status_code != 200:
                return ("status", r.status_code)
            for line in r.iter_lines():
                if stop is not None and stop.is_set():
                    return ("left",)
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return ("error_event", chunk["error"].get("message"))
                if first is not None:
                    first.set()
                for ch in chunk["choices"]:
                    finish = ch["finish_reason"] or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return ("cut", repr(e))
    if not done:  # a body that ended without [DONE] is never an answer
        return ("cut", "no [DONE]")
    return ("whole", tokens, finish)


@dataclass
class ClusterApp:
    cluster: object  # ray.cluster_utils.Cluster
    nodes: dict[str, object]  # node id -> the worker node (ray._private.node.Node)
    base_url: str
    port: int
    tiny_model: str
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.base_url + "/cluster/v1/completions"

    def engine(self):
        from ray import serve
        return serve.get_deployment_handle("EngineDeployment", app_name=APP)

    def add_node(self) -> str:
        node = serve_replicas.add_worker_node(self.cluster)
        self.nodes[node.node_id] = node
        return node.node_id

    def free_node(self, replicas: dict[str, dict]) -> str:
        """A worker node without a replica, added if there is none (the tests marked
        `long` may not have run before)."""
        free = set(self.nodes) - {r["node"] for r in replicas.values()}
        return next(iter(free)) if free else self.add_node()


@pytest.fixture(scope="module")
def cluster_app(ray_cluster, server, tiny_model):
    from ray import serve
    app = ClusterApp(ray_cluster, {}, server.base_url, int(server.base_url.rsplit(":", 1)[1]), tiny_model)
    t0 = time.monotonic()
    try:
        for _ in range(2):
            app.add_node()
        serve_deploy(deploy_config(app.port, app_overrides(tiny_model), "1"))
        wait_for(lambda: app_status() == "RUNNING", 240, "the app to run")
        app.log.append(f"2 worker nodes and the app up in {time.monotonic() - t0:.0f}s")
        yield app
    finally:
        serve.delete(APP)
        for node in list(app.nodes.values()):
            ray_cluster.remove_node(node)
        print("\n" + "\n".join(app.log))


# Long: test_serve_autoscaling.py deploys the same way (a config file, replica_resources) on
# two worker nodes and checks its two replicas one a node, none on the head.
@pytest.mark.long
def test_replicas_spread_over_worker_nodes(cluster_app):
    replicas = replicas_by_node(cluster_app.engine(), 2)
    assert len(replicas) == 2, replicas
    nodes = {r["node"] for r in replicas.values()}
    assert nodes == set(cluster_app.nodes), (nodes, set(cluster_app.nodes))  # one each, no head


@pytest.mark.long  # 60-90 s; test_serve_autoscaling.py checks the same on one node
def test_node_joined_under_load_takes_the_new_replica_and_scale_in_cuts_no_stream(cluster_app):
    """A burst asks for a third replica that no node can hold; a node joins and takes it.
    When the load drops, Serve scales back to two while a stream runs on every replica:
    the one it removes drains, so every stream ends whole."""
    app, engine = cluster_app, cluster_app.engine()
    tc = time.monotonic()
    assert stream(app.url, "Calibrate:", 300)[0] == "whole"
    # Probes long enough to outlive their placement and the scale-in (metrics each second,
    # look-back 1.5 s, downscale delay 1 s, then 2 s of HAProxy draining), measured not fixed.
    probe_tokens = min(MAX_MODEL_LEN - 64, int(300 / (time.monotonic() - tc) * 15.0))
    pool = ThreadPoolExecutor(max_workers=12)
    hang_up, scaled_out = threading.Event(), threading.Event()

    def burst_client(i: int):
        outcomes = []
        while not hang_up.is_set():
            got = stream(app.url, f"Story number {i}:", BURST_TOKENS, hang_up)
            outcomes.append(got)
            if got[0] != "whole" or scaled_out.is_set():
                break
        hang_up.wait()
        return outcomes

    try:
        burst = [pool.submit(burst_client, i) for i in range(8)]
        # Serve asks for a third replica (8 ongoing, 2 per replica): it waits for a node.
        wait_for(lambda: sum(replica_states().values()) == 3, 60, "a third replica asked for")
        assert replica_states().get("RUNNING") == 2
        t1 = time.monotonic()
        new_node = app.add_node()
        wait_for(lambda: replica_states() == {"RUNNING": 3}, 240, "the third replica")
        scaled_out.set()
        app.log.append(f"node joined: third replica running {time.monotonic() - t1:.0f}s after the node")
        replicas = replicas_by_node(engine, 3)
        assert {r["node"] for r in replicas.values()} == set(app.nodes), replicas
        # The load drops to one probe per replica (least connections spreads them).
        hang_up.set()
        burst_outcomes = [o for f in burst for o in f.result(timeout=120)]
        assert {o[0] for o in burst_outcomes} <= {"whole", "left"}, burst_outcomes
        # Probes until every replica holds one: HAProxy's least-connections choice may
        # still count a burst connection that is closing, and put two on one replica.
        probes: list = []
        for i in range(9):
            started = threading.Event()
            probes.append(pool.submit(stream, app.url, f"Probe {i}:", probe_tokens, None, started))
            wait_for(started.is_set, 60, f"probe {i}'s first token", period=0.05)
            held = replicas_by_node(engine, 3)
            if all(r["held"] >= 1 for r in held.values()):
                break
        assert all(r["held"] >= 1 for r in held.values()), held
        seen_stopping = serve_replicas.scale_in_while_running(APP, 2, probes)
        assert seen_stopping, "no replica was stopping while the probes ran"
        assert [p.result(timeout=300) for p in probes] == [("whole", probe_tokens, "length")] * len(probes)
        app.log.append(f"node joined: {len(burst_outcomes)} burst streams, {len(probes)} probes, 0 cut; "
                       f"back to 2 replicas {time.monotonic() - t1:.0f}s after the node")
        assert new_node in app.nodes
    finally:
        hang_up.set()
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.long  # 20 s; tests/unit/test_model_files.py checks the message
def test_node_without_the_model_fails_its_replica_with_a_clear_error(cluster_app, tmp_path):
    """model.path that the node lacks: the replica fails at start, naming the path and the
    node, and the deploy fails rather than waiting (a free worker node runs it)."""
    from ray import serve
    cluster_app.free_node(replicas_by_node(cluster_app.engine(), 2))

    from configs.schema import load_config
    from serve_app.app import build_app
    missing = str(tmp_path / "not-on-this-node")
    cfg = load_config(overrides=app_overrides(cluster_app.tiny_model) + [
        f"model.path={missing}", "serve.engine_autoscaling.min_replicas=1",
        "serve.engine_autoscaling.max_replicas=1"])
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="Deploying application nomodel failed"):
            serve.run(build_app(cfg), name="nomodel", route_prefix="/nomodel")
        # What `serve status` shows for the deployment: the replica's own error.
        msg = serve.status().applications["nomodel"].deployments["EngineDeployment"].message
        assert f"has no '{missing}'" in msg and "Models on a cluster" in msg, msg[-2000:]
        assert "ModelFilesMissing: node " in msg, msg[-2000:]
        cluster_app.log.append(f"no model on the node: deploy failed after {time.monotonic() - t0:.0f}s")
    finally:
        serve.delete("nomodel")


@pytest.mark.long  # make test keeps the cluster's spread replicas; the node's loss is a minute more
def test_node_lost_under_load(cluster_app):
    """Streams on both replicas and a trickle of short requests; one replica's node goes.
    Its streams end with an error (never a hang, never an answer that looks whole), the
    other replica's streams end whole, every request is answered, requests sent once the
    lost streams have ended all succeed, and Serve starts a replacement on the free node."""
    app, engine = cluster_app, cluster_app.engine()
    before = replicas_by_node(engine, 2)
    assert len(before) == 2, before
    app.free_node(before)  # where the replacement goes
    victim = next(iter(before.values()))["node"]
    tc = time.monotonic()
    assert stream(app.url, "Calibrate:", 300)[0] == "whole"
    long_tokens = min(MAX_MODEL_LEN - 64, int(300 / (time.monotonic() - tc) * 12.0))
    pool = ThreadPoolExecutor(max_workers=12)
    trickle: list[tuple[float, float, str]] = []  # (sent, answered, outcome)
    stop_trickle = threading.Event()

    def trickle_client():
        while not stop_trickle.is_set():
            sent = time.monotonic()
            try:
                r = httpx.post(app.url, json={"prompt": "Hi", "max_tokens": 8, "ignore_eos": True},
                               timeout=httpx.Timeout(60, connect=10))
                outcome = "ok" if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8 \
                    else f"status {r.status_code}"
            except httpx.HTTPError as e:
                outcome = f"error {e!r}"
            trickle.append((sent, time.monotonic(), outcome))
            time.sleep(0.2)

    try:
        # Three: 1.5 per replica, under the autoscaling target (2), so no third replica.
        started = [threading.Event() for _ in range(3)]
        streams = [pool.submit(stream, app.url, f"Long {i}:", long_tokens, None, started[i])
                   for i in range(3)]
        wait_for(lambda: all(e.is_set() for e in started), 60, "the streams' first tokens", period=0.05)
        held = replicas_by_node(engine, 2)
        assert all(r["held"] >= 1 for r in held.values()), held
        on_victim = sum(r["held"] for r in held.values() if r["node"] == victim)
        trickler = pool.submit(trickle_client)
        time.sleep(1.0)
        lost_at = time.monotonic()
        app.cluster.remove_node(app.nodes.pop(victim), allow_graceful=False)
        outcomes = [s.result(timeout=120) for s in streams]  # none hangs
        lost_ended = time.monotonic()
        failed = [o for o in outcomes if o[0] != "whole"]
        assert {o[0] for o in failed} <= {"cut", "error_event"}, outcomes
        assert len(failed) == on_victim, (outcomes, held, victim)
        assert all(o == ("whole", long_tokens, "length") for o in outcomes if o[0] == "whole")
        # Two running: the lost replica may still be listed as STOPPING until its
        # graceful_shutdown_timeout_s runs out (Serve cannot drain an actor on a dead node).
        states = wait_for(lambda: (st := replica_states()).get("RUNNING") == 2 and st, 240,
                          "the replacement replica")
        replaced_s = time.monotonic() - lost_at
        time.sleep(1.0)
        stop_trickle.set()
        trickler.result(timeout=90)
        after = replicas_by_node(engine, 2)
        assert {r["node"] for r in after.values()} == set(app.nodes), (after, set(app.nodes))
        late = [t for t in trickle if t[0] >= lost_ended]
        assert late and all(t[2] == "ok" for t in late), late
        in_flight = [t for t in trickle if t[0] < lost_at < t[1]]
        bad = [t for t in trickle if t[2] != "ok"]
        first_ok = min((t[1] for t in trickle if t[0] >= lost_at and t[2] == "ok"), default=None)
        app.log.append(
            f"node lost: {len(outcomes)} streams ({on_victim} on the lost node: "
            f"{[o[:2] for o in failed]}), {len(outcomes) - len(failed)} whole; lost streams ended "
            f"{lost_ended - lost_at:.1f}s after; trickle {len(trickle)} requests, "
            f"{len(in_flight)} in flight at the loss, {len(bad)} failed {[t[2][:60] for t in bad]}; "
            f"first answer sent after the loss {first_ok - lost_at if first_ok else float('nan'):.1f}s "
            f"after it; replacement running {replaced_s:.0f}s after (replicas {states})")
    finally:
        stop_trickle.set()
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.long  # 70 s: two replicas restarted one after the other
def test_redeploy_under_traffic_fails_no_request(cluster_app):
    """`serve deploy` of a changed config (new args and a new code version) replaces the
    replicas one by one, each draining its streams: every request answered whole."""
    app, engine = cluster_app, cluster_app.engine()
    old = set(replicas_by_node(engine, 2))
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=6)

    def client(i: int):
        outcomes = []
        while not stop.is_set():
            outcomes.append(stream(app.url, f"Client {i}:", 400))
        return outcomes

    try:
        clients = [pool.submit(client, i) for i in range(4)]
        time.sleep(2.0)
        t0 = time.monotonic()
        serve_deploy(deploy_config(app.port, app_overrides(app.tiny_model) + ["serve.stream_interval_ms=50"], "2"))
        wait_for(lambda: app_status() == "DEPLOYING", 30, "the redeploy to start", period=0.1)
        wait_for(lambda: app_status() == "RUNNING" and replica_states() == {"RUNNING": 2}, 300,
                 "the rolled replicas")
        rolled_s = time.monotonic() - t0
        time.sleep(2.0)
        stop.set()
        outcomes = [o for c in clients for o in c.result(timeout=120)]
        new = set(replicas_by_node(engine, 2))
        assert not (new & old), (old, new)  # every replica replaced
        assert outcomes and all(o == ("whole", 400, "length") for o in outcomes), \
            [o for o in outcomes if o != ("whole", 400, "length")]
        app.log.append(f"redeploy: {len(outcomes)} streams, 0 failed, 0 cut; replicas rolled in {rolled_s:.0f}s")
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
