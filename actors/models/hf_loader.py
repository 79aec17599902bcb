"""Hugging Face folder (config.json + safetensors, sharded or not) -> (LlamaArch, state dict)."""

from __future__ import annotations

import json
import os

import torch

from actors.models.model_config import LlamaArch


def read_hf_config(folder: str) -> LlamaArch:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    with open(path) as f:
        return LlamaArch.from_hf_config(json.load(f))


def safetensors_files(folder: str) -> list[str]:
    """The .safetensors files holding the weights: the index's shards, or the single file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"{folder}: neither model.safetensors nor model.safetensors.index.json found "
        "(only safetensors checkpoints are supported)"
    )


def read_hf_folder(folder: str) -> tuple[LlamaArch, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    arch = read_hf_config(folder)
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        part = load_file(path)  # stored dtype, CPU
        dup = state.keys() & part.keys()
        if dup:
            raise ValueError(f"{path}: tensors also present in another shard: {sorted(dup)[:4]}")
        state.update(part)
    # Tied checkpoints usually omit lm_head.weight; LlamaForCausalLM reads the embedding then.
    return arch, state
