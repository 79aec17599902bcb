"""Hugging Face folder (config.json + safetensors, sharded or not) -> (LlamaArch, a state
dict that reads each tensor from disk only when asked for it)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from typing import BinaryIO

import numpy as np
import torch

from actors.models.file_range import read_range

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


# safetensors dtype names -> numpy dtypes of the same width (bfloat16 and float8 are read
# as raw integers and reinterpreted by torch).
_DTYPES = {"F64": (np.float64, torch.float64), "F32": (np.float32, torch.float32),
           "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16),
           "F8_E4M3": (np.uint8, torch.float8_e4m3fn), "F8_E5M2": (np.uint8, torch.float8_e5m2),
           "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32),
           "I16": (np.int16, torch.int16), "I8": (np.int8, torch.int8),
           "U8": (np.uint8, torch.uint8), "BOOL": (np.bool_, torch.bool)}


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Tensor name -> tensor (stored dtype, host), read from its shard at each lookup, so a
    load holds one tensor at a time rather than a shard or the whole checkpoint."""

    def __init__(self, paths: list[str]):
        self._where: dict[str, tuple[BinaryIO, int, str, list[int]]] = {}  # name -> (file, offset, dtype, shape)
        for path in paths:
            f = open(path, "rb")
            # The format: a little-endian u64 header length, a JSON header, then the data.
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            dup = sorted(header.keys() & self._where.keys())
            if dup:
                raise ValueError(f"{path}: tensors also present in another shard: {dup[:4]}")
            # In data order, so a load reads each shard front to back.
            for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if h["dtype"] not in _DTYPES:
                    raise ValueError(f"{path}: {name} has dtype {h['dtype']}, which is not supported")
                self._where[name] = (f, 8 + n + h["data_offsets"][0], h["dtype"], h["shape"])

    def __getitem__(self, name: str) -> torch.Tensor:
        f, offset, dtype, shape = self._where[name]
        np_dtype, torch_dtype = _DTYPES[dtype]
        raw = read_range(f, offset, np.empty(shape, dtype=np_dtype))
        return torch.from_numpy(raw).view(torch_dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)  # shard by shard, in data order

    def __len__(self) -> int:
        return len(self._where)


def read_hf_folder(folder: str) -> tuple[LlamaArch, SafetensorsCheckpoint]:
    arch = read_hf_config(folder)
    # Tied checkpoints usually omit lm_head.weight; LlamaForCausalLM reads the embedding then.
    return arch, SafetensorsCheckpoint(safetensors_files(folder))
