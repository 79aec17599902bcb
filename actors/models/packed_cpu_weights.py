"""model.cpu_weights=packed: the target's linear layers as Q4_1 blocks and its LM head (the
tied embedding) as Q8_0 blocks, multiplied by the block kernels (kestrel_kernels/cpu_q4.py),
and its norms, RoPE and SiLU-and-mul as one CPU kernel call each (cpu_layer_ops.py), while
the model's KernelSwitch is on: in every decode and verify forward, at any batch size.

A decode step reads about a quarter of the float32 weights' bytes. Weights dequantized from
a GGUF's Q4_1 / Q8_0 blocks are packed back into exactly those blocks, and the linear
layers' float parameters hold their dequantized values (the GGUF's own, for such weights),
so with the switch off (prefill, the draft's extend) a float GEMM computes the same model
without the kernels' int8 rounding of activations: in the switch's gemm_dtype, bfloat16
where the CPU multiplies it natively (several times float32's speed at prefill's rows),
else float32. The LM head's logits near each row's top are the float32 rows' either way
(Q8LMHead). The kernels are batch-invariant (a row's result does not depend on the other
rows of the call), so a decode step and a verify over the same requests agree bit for bit,
whatever the batch, and greedy speculative output equals plain output. Decode and verify
forwards over the CPU attention kernel run the decoder layers as one call
(PackedLlamaForCausalLM): the same kernels in the same order, so the same bits as the
modules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from kestrel_kernels import cpu_layer_ops, layer_ops
from kestrel_kernels.cpu_build import kernels
from kestrel_kernels.cpu_q4 import q4_1_linear, q8_0_linear, quantize_q4_1, quantize_q8_0


class KernelSwitch:
    """Whether the packed modules of one model run the kernels (on) or the float GEMM in
    gemm_dtype: one flag for the whole model, set per step (RankWorker.launch), so every
    forward of a step, target and draft, takes the same path."""

    def __init__(self, gemm_dtype: torch.dtype = torch.float32) -> None:
        self.on = True
        self.gemm_dtype = gemm_dtype


class BlockLinear(nn.Module):
    """An nn.Linear's weight also as blocks for a kernel (Q4Linear, Q8Linear) while the
    switch is on; the float `weight` parameter stays under its checkpoint name, in the
    switch's gemm_dtype (set_gemm_weight), for the float path."""

    def __init__(self, linear: nn.Linear, switch: KernelSwitch):
        super().__init__()
        self.switch = switch
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def set_gemm_weight(self, values: torch.Tensor) -> None:
        """The float path's weight: `values` [N, K] in the switch's gemm_dtype."""
        self.weight.data = values.to(self.switch.gemm_dtype)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if self.switch.on:
            y = self.kernel(x2)  # [M, N] float32
        else:
            y = F.linear(x2.to(self.weight.dtype), self.weight).to(x.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


class Q4Linear(BlockLinear):
    """The target's projections as Q4_1 blocks; the float weight holds the blocks'
    dequantized values (the GGUF's own, for its Q4_1 weights), so the float path computes
    the same model."""

    def __init__(self, linear: nn.Linear, switch: KernelSwitch):
        super().__init__(linear, switch)
        self.q4 = quantize_q4_1(linear.weight.data)
        self.set_gemm_weight(self.q4.dequantize())  # a GGUF's Q4_1 weights: their own values

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return q4_1_linear(x, self.q4)


class Q8Linear(BlockLinear):
    """A draft head's projections as Q8_0 blocks, the float weight as loaded (in gemm_dtype):
    the draft only proposes (verify keeps the output lossless), and at 8 bits it proposes
    nearly what its float weights would, from a quarter of their bytes."""

    def __init__(self, linear: nn.Linear, switch: KernelSwitch):
        super().__init__(linear, switch)
        self.q8 = quantize_q8_0(linear.weight.data)
        self.set_gemm_weight(linear.weight.data)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return q8_0_linear(x, self.q8)


class PackedRMSNorm(RMSNorm):
    """RMSNorm (with its residual add) as one CPU kernel call while the switch is on."""
    switch: KernelSwitch

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self.switch.on:
            return super().forward(x, residual)
        normed, total = cpu_layer_ops.add_rmsnorm(x, residual, self.weight, self.eps)
        return normed if residual is None else (normed, total)


class PackedAttention(Attention):
    """Attention with RoPE as one CPU kernel call per q and k while the switch is on."""
    switch: KernelSwitch

    def rope(self, q, k, rot):
        if not self.switch.on:
            return super().rope(q, k, rot)
        return cpu_layer_ops.rope(q, rot.cos, rot.sin), cpu_layer_ops.rope(k, rot.cos, rot.sin)


class PackedMLP(MLP):
    """The MLP with SiLU-and-mul as one CPU kernel call while the switch is on."""
    switch: KernelSwitch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.switch.on:
            return super().forward(x)
        return self.down_proj(cpu_layer_ops.silu_and_mul(self.gate_up_proj(x)))


def _recast(module: nn.Module, cls: type, switch: KernelSwitch) -> None:
    """The same module (its parameters, under their names) with cls's forward."""
    module.__class__ = cls
    module.switch = switch


# Logits the kernel puts within this much of a row's top are computed again in float32 from
# the float rows: the kernel's int8 activations move logits by a few hundredths, which
# would break the model's near-ties its own way; this way the pick, and every logit near
# it, is the float model's.
REFINE_MARGIN = 1.0


class Q8LMHead(nn.Module):
    """The LM head's rows also as Q8_0 blocks, for the kernel; the float rows (the tied
    embedding's, or the untied head's parameter) stay as loaded (for a GGUF's Q8_0
    embedding, the blocks' exact values). With the switch on, the kernel's logits, refined
    near each row's top (REFINE_MARGIN); off, the float GEMM, on a copy of the rows in
    gemm_dtype where that is not theirs. `limit`: logits of the first ids only (a draft's
    cut of the vocabulary), which a draft reads for its top-k alone: not refined."""

    def __init__(self, head: nn.Module, switch: KernelSwitch):
        super().__init__()
        self.switch = switch
        if isinstance(head, nn.Linear):
            self.weight = head.weight  # the untied head's own parameter, under its checkpoint name
        else:
            object.__setattr__(self, "_rows", head)  # the tied head: not a second submodule
        self.q8 = quantize_q8_0(head.weight.data)
        self.gemm_rows = None  # [V, H] gemm_dtype, where the rows are not in it
        if head.weight.dtype != switch.gemm_dtype:
            self.gemm_rows = head.weight.detach().to(switch.gemm_dtype)

    @property
    def rows(self) -> torch.Tensor:
        return self.weight if "weight" in self._parameters else self._rows.weight  # [V, H]

    def forward(self, hidden: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        if not self.switch.on:
            rows = self.rows if self.gemm_rows is None else self.gemm_rows
            return F.linear(hidden.to(rows.dtype), rows[:limit]).to(hidden.dtype)  # [M, limit]
        logits = q8_0_linear(hidden.float(), self.q8, limit)  # [M, limit] float32
        if limit is not None:
            return logits
        top = logits.amax(-1, keepdim=True)  # [M, 1]
        r, c = (logits >= top - REFINE_MARGIN).nonzero(as_tuple=True)  # [P] each
        logits[r, c] = (hidden[r].float() * self.rows[c]).sum(-1)
        return logits


class PackedLlamaForCausalLM(LlamaForCausalLM):
    """The decoder layers' decode and verify forwards as one kernel call (cpu_decoder.cpp)
    while the switch is on and the attention backend hands over the paged cache (the CPU
    attention kernel's forwards); the modules, layer by layer, otherwise. A layer's Python
    modules cost about as much CPU as its matmuls at one row."""
    switch: KernelSwitch
    stack: object | None  # the extension's PackedStack; None where a projection has a bias

    def forward(self, input_ids, positions, attn, aux_layers=()):
        one_call = self.switch.on and self.stack is not None and hasattr(attn, "paged")
        paged = attn.paged() if one_call else None
        if paged is None:
            return super().forward(input_ids, positions, attn, aux_layers)
        self.check_aux_layers(aux_layers)
        rot = layer_ops.rotary(positions, self.rotary.inv_freq)  # cos, sin [T, D] float32
        normed, *aux = self.stack.forward(self.embed(input_ids), rot.cos, rot.sin, paged.k_all, paged.v_all,
                                          paged.loc, paged.kv_index, paged.mask, paged.q_batch, paged.q_slot,
                                          paged.scale, list(aux_layers))
        return normed, aux


def _stack(model: LlamaForCausalLM):
    """The extension's PackedStack over the packed layers, or None where a projection has a
    bias (cpu_decoder.cpp takes none)."""
    tensors = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(p.bias is not None for p in projections):
            return None
        (qkv, o, gate_up, down) = (p.q4 for p in projections)
        tensors += [layer.input_layernorm.weight.detach(), qkv.codes, qkv.dm, o.codes, o.dm,
                    layer.post_attention_layernorm.weight.detach(), gate_up.codes, gate_up.dm, down.codes, down.dm]
    a = model.arch
    return kernels().PackedStack(tensors, model.model.norm.weight.detach(), a.num_heads, a.num_kv_heads,
                                 a.head_dim, a.rms_norm_eps)


@torch.no_grad()
def pack_cpu_weights(model: nn.Module, gemm_dtype: torch.dtype = torch.float32) -> KernelSwitch:
    """Every decoder layer's projections to Q4Linear, its norms, attention and MLP onto the
    CPU layer kernels, the LM head to Q8LMHead and the model to PackedLlamaForCausalLM, in
    place, on a loaded float32 LlamaForCausalLM on the CPU -> their switch (also
    `model.kernel_switch`), whose float path multiplies in gemm_dtype."""
    switch = KernelSwitch(gemm_dtype)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = Q4Linear(attn.qkv_proj, switch)
        attn.o_proj = Q4Linear(attn.o_proj, switch)
        mlp.gate_up_proj = Q4Linear(mlp.gate_up_proj, switch)
        mlp.down_proj = Q4Linear(mlp.down_proj, switch)
        _recast(attn, PackedAttention, switch)
        _recast(mlp, PackedMLP, switch)
        _recast(layer.input_layernorm, PackedRMSNorm, switch)
        _recast(layer.post_attention_layernorm, PackedRMSNorm, switch)
    _recast(model.model.norm, PackedRMSNorm, switch)
    model.lm_head = Q8LMHead(model.lm_head, switch)
    model.kernel_switch = switch
    _recast(model, PackedLlamaForCausalLM, switch)
    model.stack = _stack(model)
    return switch


@torch.no_grad()
def pack_draft_weights(head: nn.Module, switch: KernelSwitch) -> None:
    """An EAGLE head (actors/models/eagle.py) of a packed target onto the kernels under the
    target's switch, in place: its projections to Q8Linear, its norms and MLP onto the CPU
    layer kernels. Its float32 layers otherwise read more bytes a draft step than the
    target's LM head cut to the draft's ids."""
    layer = head.layer
    attn, mlp = layer.self_attn, layer.mlp
    head.fc = Q8Linear(head.fc, switch)
    attn.qkv_proj = Q8Linear(attn.qkv_proj, switch)
    attn.o_proj = Q8Linear(attn.o_proj, switch)
    mlp.gate_up_proj = Q8Linear(mlp.gate_up_proj, switch)
    mlp.down_proj = Q8Linear(mlp.down_proj, switch)
    _recast(mlp, PackedMLP, switch)
    for norm in (layer.post_attention_layernorm, getattr(layer, "input_layernorm", None),
                 getattr(layer, "hidden_norm", None), getattr(head, "norm", None)):
        if norm is not None:
            _recast(norm, PackedRMSNorm, switch)
    if head.eagle3:
        head.lm_head = Q8Linear(head.lm_head, switch)
