"""One Ray cluster and one Kestrel Serve app for the whole integration session.

Starting Ray, Serve and an engine replica (model load included) takes tens of seconds on
a small CPU machine, so every test shares this server, deployed while the first tests
run; tests that need other settings say so in their own fixtures. Ray is given more
logical CPUs than the machine has: the engine's placement group wants one CPU per bundle,
and oversubscribing a CPU is fine.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SERVER_OVERRIDES = [
    "device=cpu",
    # Below the driver (nice 0) on a 2-core CI box, as Ray's own 15 would be, but not 15:
    # the niceness test must see the setting take effect.
    "serve.ray_worker_niceness=10",
    "draft.enabled=false",  # plain: the served default (speculation on) has its own test
    "model.dtype=float32",  # token-for-token comparisons need fp32 (docs/design.md, "Numerics and tests")
    "kv_cache.num_slots=4096",
    "scheduler.max_running_requests=16",
    # Small, so a burst of a few dozen requests overflows the queue (test_backpressure).
    "scheduler.max_queued_requests=4",
    "serve.stream_interval_ms=0",
]
APP_NAME = "kestrel"
ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    # Ray Serve's own pydantic models warn on import; not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::pydantic.PydanticDeprecatedSince20")


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    cfg: Any  # KestrelConfig
    app_name: str
    overrides: list[str]

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def engine(self):
        from ray import serve
        return serve.get_deployment_handle("EngineDeployment", app_name=self.app_name)

    def kv_stats(self) -> list[dict]:
        return self.engine().kv_stats.remote().result(timeout_s=30)

    def num_running(self) -> int:
        return self.engine().num_running.remote().result(timeout_s=30)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request (earlier tests' streams may still finish)."""
        deadline = time.monotonic() + timeout
        while self.num_running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.num_running() == 0, "the engine still has requests"


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster: a head node alone, as one machine's `ray.init` would be,
    but a `ray.cluster_utils.Cluster`, so test_serve_cluster.py can add worker nodes (more
    raylets on this machine) and take them away again."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from configs.schema import load_config
    from serve_app.app import local_ray_env
    # Autoscaling metrics every second rather than every 10 s, so the autoscaling test
    # sees decisions in seconds. Set before ray.init: every Ray process inherits them, and
    # so the HTTP front the served config asks for (HAProxy by default), as `kestrel
    # serve` sets it up.
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    os.environ.update(local_ray_env(load_config(overrides=SERVER_OVERRIDES)))
    # Logical CPUs: this app (engine bundles 2) and the other tests' apps (up to 2 more
    # engines at once) fit, on a 2-core machine too.
    # A node is declared dead after 10 failed health checks in a row, not Ray's 5: on two
    # busy cores a live node's raylet missed 5 once, and the replacement replica that
    # test_node_lost_under_load waits for had no node left to start on. A killed node's
    # checks fail at once, every 3 s: about 30 s to notice it instead of 15.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 10, "include_dashboard": False,
        "_system_config": {"health_check_failure_threshold": 10}})
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session", autouse=True)
def server_deploying(request):
    """The session's server deployed from the first integration test on, where a test of
    the session uses it: its replica starts (tens of seconds on 2 cores, most of it Ray
    starting processes that import torch) in the background while the tests before
    test_serve_api.py, on scripted engines and stand-in replicas, run. -> (port, config,
    the deployment's future, when it started), or None."""
    here = Path(__file__).parent
    if not any("server" in item.fixturenames and here in Path(str(item.path)).parents
               for item in request.session.items):
        yield None
        return
    request.getfixturevalue("ray_cluster")
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    from actors.dp.group import find_free_port
    from configs.schema import load_config
    from serve_app.app import build_app
    port = find_free_port()
    # HAProxy on the head alone: worker nodes that test_serve_cluster.py adds share this
    # machine, where a proxy of theirs could not bind the same port.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    cfg = load_config(overrides=SERVER_OVERRIDES)
    with ThreadPoolExecutor(max_workers=1) as pool:
        deployed = pool.submit(serve.run, build_app(cfg), name=APP_NAME, route_prefix="/")
        yield port, cfg, deployed, time.monotonic()


@pytest.fixture(scope="session")
def server(server_deploying) -> Server:
    assert server_deploying is not None, "no collected test of tests/integration asks for the server"
    port, cfg, deployed, t0 = server_deploying
    deployed.result()
    print(f"\nkestrel server up on port {port}, {time.monotonic() - t0:.1f}s after its deployment began")
    return Server(f"http://127.0.0.1:{port}", cfg, APP_NAME, list(SERVER_OVERRIDES))


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    with OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120) as c:
        yield c
