"""model.cpu_weights=packed: the target's linear layers as int4 groups and its LM head (the
tied embedding) also as int8 rows, multiplied by torch's weight-only CPU kernels
(kestrel_kernels/weight_only.py) while the model's KernelSwitch is on.

A decode step reads about a quarter of the float32 weights' bytes, and the kernels beat
float32 GEMMs at a few rows (docs/benchmarks.md, "The CPU step"). With the switch off
(prefill, large batches) a float32 GEMM runs on the dequantized weights, which hold exactly
the packed int4 values (the linear layers' float parameters are overwritten with them),
with the kernels' bfloat16 rounding of inputs and outputs: the same function up to the
order of float32 sums; the LM head's logits near each row's top are the float rows' either
way (Int8LMHead). The kernels compute each row alone (a row's result does not depend on the others in
the forward), so a decode step and a verify over the same requests agree bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel_kernels.weight_only import int4_linear, int4_linear_ref, int8_linear, quantize_int4, quantize_int8


class KernelSwitch:
    """Whether the packed modules of one model run the kernels (on) or the float GEMM: one
    flag for the whole model, set per step (RankWorker.launch), so every forward of a step,
    target and draft, takes the same path."""

    def __init__(self) -> None:
        self.on = True


class Int4Linear(nn.Module):
    """An nn.Linear's weight (and bias) as int4 groups; the float `weight` parameter stays,
    holding the dequantized values, so checkpoint names and the float path are unchanged."""

    def __init__(self, linear: nn.Linear, switch: KernelSwitch):
        super().__init__()
        self.switch = switch
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = quantize_int4(linear.weight.data)
        linear.weight.data.copy_(w.dequantized)
        w.dequantized = linear.weight.data  # one float copy: the parameter's
        self.weight, self.bias = linear.weight, linear.bias
        self.int4 = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        fn = int4_linear if self.switch.on else int4_linear_ref
        y = fn(x2, self.int4).to(x.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


# Logits the int8 head puts within this much of a row's top are computed again in float32
# from the float rows: the int8 rows and the kernel's bfloat16 output are off by up to ~0.7
# on SmolLM2 (a bfloat16 step is 0.125 at 16-32), which made greedy ties; this way the
# pick, and every logit near it, is the float model's.
REFINE_MARGIN = 1.0


class Int8LMHead(nn.Module):
    """The LM head's rows also as int8 with a scale each, for the kernel; the float rows
    (the tied embedding's, or the untied head's parameter) stay as loaded. With the switch
    on, the kernel's logits, refined near each row's top (REFINE_MARGIN); off, the float
    GEMM. `limit`: logits of the first ids only (a draft's cut of the vocabulary), which a
    draft reads for its top-k alone: not refined."""

    def __init__(self, head: nn.Module, switch: KernelSwitch):
        super().__init__()
        self.switch = switch
        if isinstance(head, nn.Linear):
            self.weight = head.weight  # the untied head's own parameter, under its checkpoint name
        else:
            object.__setattr__(self, "_rows", head)  # the tied head: not a second submodule
        self.int8 = quantize_int8(head.weight.data)
        self.int8.dequantized = None  # the float path reads the float rows

    @property
    def rows(self) -> torch.Tensor:
        return self.weight if "weight" in self._parameters else self._rows.weight  # [V, H]

    def forward(self, hidden: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        if not self.switch.on:
            return F.linear(hidden, self.rows[:limit])  # [M, limit]
        logits = int8_linear(hidden, self.int8, limit).float()  # [M, limit] float32
        if limit is not None:
            return logits
        top = logits.amax(-1, keepdim=True)  # [M, 1]
        r, c = (logits >= top - REFINE_MARGIN).nonzero(as_tuple=True)  # [P] each
        logits[r, c] = (hidden[r].float() * self.rows[c]).sum(-1)
        return logits


@torch.no_grad()
def pack_cpu_weights(model: nn.Module) -> KernelSwitch:
    """Every decoder layer's projections to Int4Linear and the LM head to Int8LMHead, in
    place, on a loaded float32 LlamaForCausalLM on the CPU -> their switch (also
    `model.kernel_switch`)."""
    switch = KernelSwitch()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = Int4Linear(attn.qkv_proj, switch)
        attn.o_proj = Int4Linear(attn.o_proj, switch)
        mlp.gate_up_proj = Int4Linear(mlp.gate_up_proj, switch)
        mlp.down_proj = Int4Linear(mlp.down_proj, switch)
    model.lm_head = Int8LMHead(model.lm_head, switch)
    model.kernel_switch = switch
    return switch

