"""Kestrel's app on the session's Ray cluster from a test: worker nodes added to it, the
app deployed from a Serve config file as `serve deploy` deploys one, and its Engine
replicas watched (their states and nodes, and waiting for a condition with those states
in the failure message)."""
from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A custom resource standing for a GPU node type: each worker node has one and each replica
# asks for one (serve.replica_resources), so replicas run on worker nodes only, one a node.
NODE_RESOURCE = "kestrel_node"


def replica_states(app: str) -> dict[str, int]:
    """Replica state -> count for the app's EngineDeployment ({} before it exists)."""
    from ray import serve
    status = serve.status().applications.get(app)
    if status is None or "EngineDeployment" not in status.deployments:
        return {}
    return {str(k): v for k, v in status.deployments["EngineDeployment"].replica_states.items()}


def wait_for(pred, timeout: float, what: str, app: str, period: float = 0.5):
    """pred()'s first truthy value within `timeout` seconds, polled every `period`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: {replica_states(app)}")


def scale_in_while_running(app: str, replicas: int, work: list, timeout: float = 300) -> bool:
    """Wait for the app to be back to `replicas` running replicas; whether a replica was
    seen stopping while none of `work` (futures of streams) had finished, i.e. it drained."""
    seen_stopping = False

    def scaled_in() -> bool:
        nonlocal seen_stopping
        states = replica_states(app)
        if states.get("STOPPING") and not any(f.done() for f in work):
            seen_stopping = True
        return states == {"RUNNING": replicas}
    wait_for(scaled_in, timeout, f"scale-in to {replicas} replica{'s' if replicas > 1 else ''}", app,
             period=0.25)
    return seen_stopping


def add_worker_node(cluster):
    """A worker node (another raylet on this machine) with 3 CPUs (one engine's placement
    group) and one NODE_RESOURCE, once the cluster sees it."""
    node = cluster.add_node(num_cpus=3, resources={NODE_RESOURCE: 1})
    cluster.wait_for_nodes()
    return node


def deploy_config(app: str, route_prefix: str, port: int, overrides: list[str], autoscaling: dict,
                  code_version: str = "1", **deployment) -> dict:
    """A Serve config file as `serve deploy` takes it (configs/serve.yaml's shape): Kestrel's
    app builder with `overrides`, EngineDeployment with `autoscaling` and the other
    `deployment` options."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": app, "route_prefix": route_prefix, "import_path": "serve_app.app:app_builder",
            "args": {"set": overrides},
            # A new value stands for new code: Serve replaces every replica, as for new args.
            "runtime_env": {"env_vars": {"PYTHONPATH": str(ROOT), "KESTREL_CODE_VERSION": code_version}},
            "deployments": [{"name": "EngineDeployment", "autoscaling_config": autoscaling, **deployment}],
        }],
    }


def serve_deploy(config: dict) -> None:
    """What `serve deploy` does with a config file: the controller's apply_config (which the
    dashboard's REST endpoint calls). It replaces every app deployed that way before."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))


def app_status(app: str) -> str:
    """RUNNING, DEPLOYING, DEPLOY_FAILED... (a str enum), or NONE."""
    from ray import serve
    status = serve.status().applications.get(app)
    return status.status if status else "NONE"


def replicas_by_node(engine, replicas: int, timeout_s: float = 60.0) -> dict[str, dict]:
    """{replica id: its stats (node, running + waiting)}, from stats calls that Serve's
    router spreads over the replicas; fails unless all `replicas` answered. The calls go
    out several at a time: one at a time, the router (the less loaded of two) never picks
    a replica serving a stream while two others are idle."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas:
        for call in [engine.stats.remote() for _ in range(4 * replicas)]:
            st = call.result(timeout_s=30)
            seen[st["replica"]] = {"node": st["node"], "held": st["running"] + st["waiting"]}
        assert len(seen) == replicas or time.monotonic() < deadline, \
            f"only {len(seen)} of {replicas} replicas answered: {seen}"
    return seen
