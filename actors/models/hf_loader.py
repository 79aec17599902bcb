"""Hugging Face folder (config.json + safetensors, sharded or not) -> (LlamaArch, a state
dict that reads each tensor from disk only when asked for it)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping

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
        "(only safetensors checkpoints are supported; model.load_format=dummy builds random "
        "weights from config.json alone)"
    )


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Tensor name -> tensor (stored dtype, host), read from its shard at each lookup, so a
    load holds one tensor at a time rather than a shard or the whole checkpoint."""

    def __init__(self, paths: list[str]):
        from safetensors import safe_open

        self._files: dict[str, object] = {}  # name -> the open shard holding it
        for path in paths:
            f = safe_open(path, framework="pt", device="cpu")
            dup = [k for k in f.keys() if k in self._files]
            if dup:
                raise ValueError(f"{path}: tensors also present in another shard: {sorted(dup)[:4]}")
            self._files.update(dict.fromkeys(f.keys(), f))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)  # shard by shard

    def __len__(self) -> int:
        return len(self._files)


def read_hf_folder(folder: str) -> tuple[LlamaArch, SafetensorsCheckpoint]:
    arch = read_hf_config(folder)
    # Tied checkpoints usually omit lm_head.weight; LlamaForCausalLM reads the embedding then.
    return arch, SafetensorsCheckpoint(safetensors_files(folder))
