"""ray_cluster.yaml against Ray's cluster schema; configs/serve.yaml against Serve's config
schema and through our builder; the deployment options build_app derives. No cluster."""
from __future__ import annotations

import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_ray_cluster_yaml_is_valid_for_ray_up():
    from ray.autoscaler._private.util import prepare_config, validate_config
    raw = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    cfg = prepare_config(raw)
    validate_config(cfg)
    head = cfg["head_node_type"]
    assert "GPU" not in cfg["available_node_types"][head]["resources"]
    gpu_types = [n for n, t in cfg["available_node_types"].items() if t["resources"].get("GPU")]
    assert gpu_types, "no GPU worker type"
    for name in gpu_types:
        t = cfg["available_node_types"][name]
        assert t["min_workers"] <= t["max_workers"]
    assert any("pip install" in c and "kestrel" in c for c in cfg["setup_commands"])
    assert any("serve deploy configs/serve.yaml" in c for c in cfg["head_start_ray_commands"])
    # Every node's Ray starts with the environment serve.yaml's preset needs (HAProxy).
    from configs.schema import load_config
    from serve_app.app import ray_env
    serve_cfg = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    args = serve_cfg["applications"][0]["args"]
    env = ray_env(load_config(args["config"], args.get("set")))
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = next(c for c in cfg[key] if "ray start" in c)
        assert all(f"{k}={shlex.quote(v)}" in start for k, v in env.items()), (key, env)


def test_serve_yaml_is_a_valid_serve_config_and_builds():
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    from serve_app.app import app_builder
    schema = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text()))
    (app_cfg,) = schema.applications
    assert app_cfg.import_path == "serve_app.app:app_builder"
    assert {d.name for d in app_cfg.deployments} == {"EngineDeployment"}
    app = app_builder(app_cfg.args)
    assert isinstance(app, Application)


def test_build_app_deployment_options():
    from configs.schema import load_config
    from serve_app.app import app_builder, build_app

    cfg = load_config("default.yaml", ["device=cpu", "parallel.dp_size=2",
                                       "serve.engine_autoscaling.max_replicas=3",
                                       "serve.engine_autoscaling.target_ongoing_requests=5"])
    engine = build_app(cfg)._bound_deployment  # the engine is the app's HTTP ingress
    assert engine.name == "EngineDeployment"
    # The replica and its engine core, then one bundle per DP rank.
    assert engine._replica_config.placement_group_bundles == [{"CPU": 2.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert engine._replica_config.placement_group_strategy == "STRICT_PACK"
    auto = engine._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 5)
    # The config reaches the replicas as a plain dict, with 'auto' resolved.
    assert engine.init_args[0]["device"] == "cpu"

    gpu = app_builder({"config": "h200.yaml", "set": {"parallel.dp_size": 2}})
    engine = gpu._bound_deployment
    assert engine._replica_config.placement_group_bundles == [{"CPU": 2.0}, {"GPU": 1.0}, {"GPU": 1.0}]


def test_replica_resources_go_to_the_replicas_first_bundle():
    from configs.schema import load_config
    from serve_app.app import build_app
    cfg = load_config("default.yaml", ["device=cpu", "serve.replica_resources={h200_node: 1}"])
    engine = build_app(cfg)._bound_deployment
    assert engine._replica_config.placement_group_bundles == [{"CPU": 2.0, "h200_node": 1.0}, {"CPU": 1.0}]
