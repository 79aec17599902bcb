"""GGUF file -> (LlamaArch, HF-named float32 state dict): dequantize, rename, undo Q/K
permutation, one tensor at a time as the state dict is read."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np
import torch

from actors.models.file_range import read_range
from actors.models.gguf_header import GGUFHeader, read_gguf_header
from actors.models.model_config import LlamaArch

# llama.cpp architecture -> HF model_type. Mistral GGUFs are written as "llama".
_ARCHES = {"llama": "llama", "qwen2": "qwen2"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF parameter name (KeyError for tensors we have no slot for)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise KeyError(f"GGUF tensor {gguf_name!r} has no Llama equivalent")


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's convert_hf_to_gguf Q/K permutation (weight [n_head*D, in] or bias [n_head*D]).

    The converter regrouped each head's rows from HF's rotate_half layout (first half, second
    half) to GGML's interleaved pairs: reshape(n_head, 2, D/2, ...).swapaxes(1, 2). Going back
    reads the rows as (n_head, D/2, 2, ...) and swaps the same two axes.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's forward permutation (HF -> GGUF layout); for tests and round trips."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _f32_decimal(x: float) -> float:
    # Metadata floats are float32 (1e-5 reads back as 9.99999974e-06); recover the
    # decimal the converter wrote, which is what the HF config says.
    return float(str(np.float32(x)))


def _dequantize(tensor: Any, f: BinaryIO | None = None) -> torch.Tensor:
    """One GGUF tensor as float32 [out, in] (torch order). With ``f`` (the open file), its
    bytes are read into fresh memory rather than through the header's memory map
    (file_range.py says why)."""
    from gguf.quants import dequantize

    if f is None:
        raw = np.asarray(tensor.data)  # a view of the file's map
    else:
        raw = read_range(f, int(tensor.data_offset), np.empty(tensor.data.shape, tensor.data.dtype))
    arr = dequantize(raw, tensor.tensor_type)  # numpy, torch order [out, in]
    want = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
    if arr.shape != want:
        arr = arr.reshape(want)
    if arr.dtype != np.float32 or not arr.flags.writeable:
        # F32 tensors come back as read-only views of their input; own the memory.
        arr = np.array(arr, dtype=np.float32, copy=True)
    return torch.from_numpy(arr)  # float32


class GGUFCheckpoint(Mapping[str, torch.Tensor]):
    """HF name -> float32 tensor, dequantized (and Q/K unpermuted) at each lookup, so a load
    holds one dequantized tensor at a time rather than the whole model in float32."""

    def __init__(self, path: str, tensors: dict[str, Any], arch: LlamaArch, permuted: bool):
        self._file = open(path, "rb")
        self._tensors = {hf_name(name): t for name, t in tensors.items()}  # HF name -> GGUF tensor
        self._arch = arch
        self._permuted = permuted

    def __getitem__(self, name: str) -> torch.Tensor:
        w = _dequantize(self._tensors[name], self._file)
        if self._permuted and ".q_proj." in name:
            w = unpermute_rows(w, self._arch.num_heads)
        elif self._permuted and ".k_proj." in name:
            w = unpermute_rows(w, self._arch.num_kv_heads)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)  # the file's order

    def __len__(self) -> int:
        return len(self._tensors)


# Parsed headers by (file, mtime, size): start-up reads a model's shape before its weights,
# and a header only maps the file read-only, so one serves both.
_HEADERS: dict[tuple, GGUFHeader] = {}


def read_gguf(path: str) -> tuple[LlamaArch, GGUFCheckpoint]:
    """The LlamaArch from the GGUF metadata, and the tensors (read on demand)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
    if key not in _HEADERS:
        _HEADERS[key] = read_gguf_header(path)
    header = _HEADERS[key]
    g_arch = header.fields.get("general.architecture")
    if g_arch not in _ARCHES:
        raise ValueError(f"{path}: GGUF architecture {g_arch!r} is not supported (supported: {', '.join(_ARCHES)})")
    tensors = {t.name: t for t in header.tensors}

    def meta(key: str, default: Any = None) -> Any:
        v = header.fields.get(f"{g_arch}.{key}", default)
        if v is None:
            raise ValueError(f"{path}: GGUF metadata {g_arch}.{key} is missing")
        return v

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = meta("attention.head_count_kv", heads)
    if not isinstance(kv_heads, (int, np.integer)):
        raise ValueError(f"{path}: per-layer head_count_kv is not supported")
    kv_heads = int(kv_heads)
    head_dim = int(meta("attention.key_length", hidden // heads))
    rot_dim = int(meta("rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise ValueError(f"{path}: partial RoPE (rope.dimension_count={rot_dim} < head_dim={head_dim}) is not supported")

    rope_scaling = None
    kind = header.fields.get(f"{g_arch}.rope.scaling.type", "none")
    if kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif kind not in ("none", None):
        raise ValueError(f"{path}: GGUF rope scaling type {kind!r} is not supported")
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style scaling, stored by llama.cpp as per-frequency divisors.
        factors = _dequantize(tensors.pop("rope_freqs.weight")).flatten().tolist()
        rope_scaling = {"rope_type": "freq_factors", "factors": factors}

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = header.fields.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = header.fields.get("tokenizer.ggml.bos_token_id")

    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{path}: GGUF has no token_embd.weight")
    arch = LlamaArch(
        vocab_size=int(embd.shape[1]),  # ggml order [hidden, vocab]; the tensor is the truth
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32_decimal(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32_decimal(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        architecture=_ARCHES[g_arch],
    )

    # Only llama-arch conversions permute Q/K (qwen2 is converted with NEOX-style RoPE, unpermuted).
    return arch, GGUFCheckpoint(path, tensors, arch, permuted=g_arch == "llama")
