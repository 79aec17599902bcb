"""FP8 target (model.quantization: fp8, or an FP8 checkpoint): the decoder's four linear
layers with E4M3 weights and a scale per output channel; embeddings, LM head and norms
stay in the model dtype, and so does the draft head, which reads the target's embedding,
LM head and bf16 hidden states. Weights arrive quantized (a compressed-tensors FP8
checkpoint) or are quantized on the device as they are written (`write_quantized`).
The kernels whose output a layer's FP8 linear reads (its norms, SiLU-and-mul) write that
input as FP8 themselves (`fuse_fp8_inputs`); o_proj quantizes attention's output itself."""

from __future__ import annotations

import torch
from torch import nn

from kestrel_kernels.fp8_linear import FP8, Fp8Rows, fp8_linear, quantize_rows

# The quantized projections of each decoder layer (llama.py's fused names).
FP8_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class Fp8Linear(nn.Module):
    """nn.Linear's interface over an FP8 weight; the bias (Qwen2's q/k/v) stays in the model
    dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)  # [N, K] fp8
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32, device=device),
                                         requires_grad=False)  # [N, 1] fp32, as checkpoints store it
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)  # [N]

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)


def use_fp8_linears(model: nn.Module) -> None:
    """Replace the decoder layers' FP8_LINEARS of a LlamaForCausalLM by Fp8Linear modules,
    on the device the model is on (meta while it is being built), bias in its dtype, and
    have the kernels that feed them write their FP8 input (`fuse_fp8_inputs`)."""
    for layer in model.model.layers:
        for path in FP8_LINEARS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            old = getattr(parent, name)
            setattr(parent, name, Fp8Linear(old.in_features, old.out_features, old.bias is not None,
                                            old.weight.dtype, old.weight.device))
    fuse_fp8_inputs(model)


def fuse_fp8_inputs(model: nn.Module, enabled: bool = True) -> None:
    """Where an Fp8Linear reads a kernel's output as it is (qkv_proj the input norm's,
    gate_up_proj the post-attention norm's, down_proj SiLU-and-mul's), that kernel writes
    the linear's FP8 codes and row scales (`enabled`), or its usual output for the linear to
    quantize: the same bits, one launch fewer each."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layer.input_layernorm.quantize = enabled and isinstance(attn.qkv_proj, Fp8Linear)
        layer.post_attention_layernorm.quantize = enabled and isinstance(mlp.gate_up_proj, Fp8Linear)
        mlp.quantize = enabled and isinstance(mlp.down_proj, Fp8Linear)


def is_fp8(model: nn.Module) -> bool:
    return isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)


def check_fp8_device(dtype: torch.dtype, device: torch.device | str, dims: dict[str, int]) -> None:
    """Refuse what the CUDA path cannot run: it needs row-wise scaled FP8 matmuls (compute
    capability 8.9: Ada, Hopper and later), which write bf16 and take GEMM dimensions
    (``dims``: name -> size) that are multiples of 16. The CPU runs the fp32 reference in
    any dtype and shape."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"model.quantization=fp8 on CUDA needs model.dtype bfloat16 (or auto), not "
                         f"{str(dtype).removeprefix('torch.')}: FP8 matmuls with per-token scales write bf16")
    odd = {k: v for k, v in dims.items() if v % 16}
    if odd:
        raise ValueError(f"model.quantization=fp8 on CUDA needs GEMM dimensions that are multiples "
                         f"of 16; this model has {odd}")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ValueError(f"model.quantization=fp8 needs a GPU of compute capability 8.9 or more "
                         f"(Ada, Hopper); this one is {cap[0]}.{cap[1]}")


@torch.no_grad()
def write_quantized(weight: torch.Tensor, scale: torch.Tensor, src: torch.Tensor, copy) -> None:
    """weight [R, K] fp8 and scale [R, 1] fp32 (a parameter or rows of one, on the device) <-
    src [R, K] high precision (host): ``copy(dst, src)`` moves src to the device in its own
    dtype, where it is quantized row by row, so the rows of a fused projection's parts are
    quantized as they arrive and the host holds nothing more than src."""
    staged = torch.empty(src.shape, dtype=src.dtype, device=weight.device)  # [R, K]
    copy(staged, src)
    q, s = quantize_rows(staged)  # [R, K] fp8, [R, 1] fp32
    weight.copy_(q)
    scale.copy_(s)

