"""A GGUF file's header: its metadata values and its tensors' descriptions, each tensor's
bytes a view of a read-only memory map of the file.

gguf-py's GGUFReader builds Python objects for every element of every metadata array
(SmolLM2's 49k tokens and 48k merges): most of a second and a half of start-up. Here
numeric arrays are read as one numpy view each and strings are decoded once, straight from
the map. The layout (GGUF v2/v3, little-endian): magic, version, tensor count, field count;
the fields (key, type, value); the tensors (name, dims fastest first, ggml type, offset);
the tensor data from the next multiple of general.alignment.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types -> numpy dtypes (little-endian); 8 is a string, 9 an array.
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
            10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
# Tensor types stored as plain numbers: their numpy dtype; the others are blocks of bytes.
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    tensor_type: GGMLQuantizationType
    data_offset: int  # bytes from the start of the file
    data: np.ndarray  # torch order, [rows, bytes per row] uint8 for block types; a view of the map


@dataclass
class GGUFHeader:
    fields: dict[str, Any]  # key -> int, float, bool, str, or a list / 1-D numpy array
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: a GGUF string runs past the end of the file")
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == STRING:
                return [self.string() for _ in range(count)]
            if item == ARRAY:
                return [self.value(self.take("<I")) for _ in range(count)]
            if item not in _SCALARS:
                raise ValueError(f"{self.path}: GGUF array of unknown type {item}")
            arr = np.frombuffer(self.buf, _SCALARS[item], count, self.pos)
            self.pos += arr.nbytes
            return arr
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: GGUF metadata value of unknown type {kind}")
        value = np.frombuffer(self.buf, _SCALARS[kind], 1, self.pos)[0].item()
        self.pos += np.dtype(_SCALARS[kind]).itemsize
        return value


def read_gguf_header(path: str, tensors: bool = True) -> GGUFHeader:
    """The header of the GGUF at `path`; with tensors=False the fields alone (a file cut off
    after its header will do)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf, path)
    if buf[:4] != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    c.pos = 4
    version = c.take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3)")
    n_tensors, n_fields = c.take("<Q"), c.take("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = c.string()
        fields[key] = c.value(c.take("<I"))
    if not tensors:
        return GGUFHeader(fields, [])
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
        infos.append((name, dims, GGMLQuantizationType(c.take("<I")), c.take("<Q")))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-c.pos // align) * align
    out, seen = [], set()
    for name, dims, kind, offset in infos:
        if name in seen:
            raise ValueError(f"{path}: GGUF tensor {name!r} appears twice")
        seen.add(name)
        torch_shape = tuple(reversed(dims))
        n = int(np.prod(dims))
        if kind in _PLAIN:
            data = np.frombuffer(buf, _PLAIN[kind], n, start + offset).reshape(torch_shape)
        else:
            block, size = GGML_QUANT_SIZES[kind]
            row_bytes = dims[0] // block * size
            data = np.frombuffer(buf, np.uint8, n // block * size, start + offset)
            data = data.reshape(*torch_shape[:-1], row_bytes)
        out.append(GGUFTensor(name, dims, kind, start + offset, data))
    return GGUFHeader(fields, out)
