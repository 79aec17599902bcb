"""Fixtures of the GPU engine tests; every test here is marked `gpu` and needs CUDA."""
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).parent == _HERE:
            item.add_marker(pytest.mark.gpu)
            item.add_marker(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.fixture(scope="module")
def fp32_ref(smollm_path):
    """The fp32 model on the GPU that judges bf16 near-ties."""
    from actors.models.loader import build_model
    model, _ = build_model(smollm_path, torch.float32, "cuda")
    return model
