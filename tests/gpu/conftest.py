"""Fixtures of the GPU engine tests."""
import pytest
import torch


@pytest.fixture(scope="module")
def fp32_ref(smollm_path):
    """The fp32 model on the GPU that judges bf16 near-ties."""
    from actors.models.loader import build_model
    model, _ = build_model(smollm_path, torch.float32, "cuda")
    return model
