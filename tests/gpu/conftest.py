"""Fixtures of the GPU engine tests; every test here is marked `gpu` and needs CUDA."""
import os
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).parent == _HERE:
            item.add_marker(pytest.mark.gpu)
            item.add_marker(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.fixture(autouse=True)
def _engines_released():
    """Each test's engines go when it ends: their workers hold reference cycles, so without
    a collection a dozen tests' KV caches and graph pools stayed on the GPU together and a
    later engine ran out of memory on an 80 GB card."""
    yield
    from serve_app.engine.llm_engine import release_device_memory
    release_device_memory()


@pytest.fixture(scope="module")
def fp32_ref(smollm_path):
    """The fp32 model on the GPU that judges bf16 near-ties."""
    from actors.models.loader import build_model
    model, _ = build_model(smollm_path, torch.float32, "cuda")
    return model


@pytest.fixture(scope="module")
def h200_serve_port():
    """Ray and Serve started as `kestrel serve` starts them for the h200 preset (its HTTP
    front's environment), Serve's HTTP on a free loopback port: yields the port."""
    import ray
    from ray import serve

    from actors.dp.group import find_free_port
    from configs.schema import load_config
    from kestrel_testing import ROOT
    from serve_app.app import local_ray_env
    os.environ.update(local_ray_env(load_config(path=str(ROOT / "configs" / "h200.yaml"))))
    # The GPU machine's packages (Ray among them) come from its own PYTHONPATH: keep it.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    port = find_free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
