"""Triton kernels under test: compiled on a GPU, in Triton's interpreter on CPU tensors
when there is no CUDA (CI). Import this before anything imports triton: the interpreter
is chosen when a kernel is decorated (switching it on with CUDA present would break the
GPU tests)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def _let_interpreter_index_numpy_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar into a 1-element array and calls int() on it
    inside range(); NumPy >= 2.4 refuses that. Convert through .item() instead."""
    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass
    import triton.runtime.interpreter as interp
    if getattr(interp._patch_lang_tensor, "_kestrel_patched", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    patched._kestrel_patched = True
    interp._patch_lang_tensor = patched


def _round_bf16_to_nearest_even() -> None:
    """Triton 3.6's interpreter casts fp32 -> bf16 (and -> E4M3) by dropping the low bits; the
    GPU rounds to nearest even, as torch does. Round like the GPU so kernels that mirror torch's bf16
    roundings can be compared with it exactly."""
    import triton.language as tl
    import triton.runtime.interpreter as interp
    if getattr(interp._convert_float, "_kestrel_patched", False):
        return
    original = interp._convert_float

    def convert(values, src_ty, dst_ty, rounding_mode):
        if src_ty == tl.float32 and dst_ty == tl.bfloat16:
            f32 = torch.from_numpy(np.array(values, dtype=np.float32))
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if src_ty == tl.float32 and dst_ty == tl.float8e4nv:  # truncates too; the GPU rounds
            f32 = torch.from_numpy(np.array(values, dtype=np.float32))
            return f32.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(values, src_ty, dst_ty, rounding_mode)
    convert._kestrel_patched = True
    interp._convert_float = convert


def _multiply_bf16_as_its_values() -> None:
    """Triton 3.6's interpreter multiplies bfloat16 dot operands as the uint16 bits it stores
    them in. Widen them to fp32 (exact) first, as it widens FP8 operands to fp16."""
    import triton.language as tl
    import triton.runtime.interpreter as interp
    builder = interp.InterpreterBuilder
    if getattr(builder.create_dot, "_kestrel_patched", False):
        return
    original = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        f32 = (handle.data.astype(np.uint32) << 16).view(np.float32)
        return interp.TensorHandle(f32, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)
    create_dot._kestrel_patched = True
    builder.create_dot = create_dot


def triton_setup(kernels_module, kernel_name: str) -> tuple[bool, str, pytest.MarkDecorator]:
    """(interpreted, the device test tensors live on, the mark for kernel tests) for a
    kernels module (with HAS_TRITON) whose kernels look like its `kernel_name`."""
    has_triton = kernels_module.HAS_TRITON
    kernel = getattr(kernels_module, kernel_name, None)  # defined only when triton imports
    interpreted = has_triton and type(kernel).__name__ == "InterpretedFunction"
    dev = "cuda" if CUDA and not interpreted else "cpu"
    mark = pytest.mark.skipif(not has_triton, reason="triton is not installed")
    if has_triton and dev == "cpu" and not interpreted:
        mark = pytest.mark.skip(
            reason="triton was imported before TRITON_INTERPRET=1; run this module on its own")
    if interpreted:
        _let_interpreter_index_numpy_scalars()
        _round_bf16_to_nearest_even()
        _multiply_bf16_as_its_values()
    return interpreted, dev, mark
