"""Watching a Serve application's Engine replicas from a test: their states, and waiting
for a condition with those states in the failure message."""
from __future__ import annotations

import time


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
