"""Llama-family decoder over a flat token batch; attention (and so the KV cache) is injected.

Where a layer's linears are FP8 (fp8_linear.py), the norms and the SiLU-and-mul that feed
them write their FP8 input themselves (`quantize`, set by fp8_linear.fuse_fp8_inputs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch
from torch import nn

from actors.models.fp8_linear import write_quantized
from actors.models.model_config import LlamaArch
from actors.models.rope import RotaryEmbedding
from kestrel_kernels import layer_ops, small_rows_linear
from kestrel_kernels.small_rows_linear import SmallRowsLinear
from kestrel_kernels.fp8_linear import FP8, Fp8Rows

# attn(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], layer_id) -> [T, Hq, D].
# The backend owns the KV cache, the causal/tree mask and the 1/sqrt(D) softmax scale.
AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # Set where an FP8 linear reads the norm (fp8_linear.fuse_fp8_inputs): the kernel
        # writes that linear's FP8 input (Fp8Rows) instead of the normed value.
        self.quantize = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x -> norm(x); with a residual, x + residual -> (norm of the sum, the sum)."""
        if residual is None:
            op = layer_ops.rmsnorm_quant if self.quantize else layer_ops.rmsnorm
            return op(x, self.weight, self.eps)
        op = layer_ops.fused_add_rmsnorm_quant if self.quantize else layer_ops.fused_add_rmsnorm
        return op(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        h, b = arch.hidden_size, arch.attention_bias
        # q, k and v in one GEMM (checkpoints' q_proj/k_proj/v_proj, fused at load).
        self.qkv_sizes = [arch.q_size, arch.kv_size, arch.kv_size]
        self.qkv_proj = SmallRowsLinear(h, sum(self.qkv_sizes), bias=b)
        self.o_proj = SmallRowsLinear(arch.q_size, h, bias=False)

    def forward(self, x: torch.Tensor | Fp8Rows, rot: layer_ops.Rotary, attn: AttnFn) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, -1)  # column slices, no copies
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.rope(q, k, rot)
        o = attn(q, k, v, self.layer_id)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))

    def rope(self, q: torch.Tensor, k: torch.Tensor, rot: layer_ops.Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        return layer_ops.rope_at(q, k, rot)


# Fused projections and the checkpoint projections they hold, in row order.
FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj",
                                            "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_SUFFIXES = (".weight", ".bias", ".weight_scale")  # weight_scale: FP8 layers (fp8_linear.py)


def _ends_with(name: str, proj: str) -> tuple[str, str] | None:
    """(prefix, suffix) when ``name`` is prefix + proj + suffix (a weight, bias or scale)."""
    for suffix in _SUFFIXES:
        if name.endswith(proj + suffix):
            return name[:-len(proj + suffix)], suffix
    return None


def projection_sizes(q_size: int, kv_size: int, intermediate: int) -> dict[str, list[int]]:
    """Each fused projection's part sizes (rows), as split_projections takes them."""
    return {"self_attn.qkv_proj": [q_size, kv_size, kv_size],
            "mlp.gate_up_proj": [intermediate, intermediate]}


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> this model's: each layer's q/k/v (and gate/up) weights and biases
    concatenated by rows into qkv_proj (gate_up_proj). Other entries pass through."""
    out = dict(state)
    for fused, parts in FUSED_PROJECTIONS.items():
        for name in state:
            found = _ends_with(name, parts[0])
            if found is None:
                continue
            prefix, suffix = found
            keys = [prefix + p + suffix for p in parts]
            if all(k in state for k in keys):
                out[prefix + fused + suffix] = torch.cat([state[k] for k in keys])
                for k in keys:
                    del out[k]
    return out


def split_projections(state: dict[str, torch.Tensor],
                      sizes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The inverse of fuse_projections (for exporting and comparing with checkpoints);
    ``sizes`` as projection_sizes gives them."""
    out = {}
    for name, t in state.items():
        for fused, parts in FUSED_PROJECTIONS.items():
            found = _ends_with(name, fused)
            if found is not None:
                prefix, suffix = found
                out.update({prefix + p + suffix: c for p, c in zip(parts, t.split(sizes[fused]))})
                break
        else:
            out[name] = t
    return out


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        h, self.intermediate = arch.hidden_size, arch.intermediate_size
        # gate and up in one GEMM (checkpoints' gate_proj/up_proj, fused at load).
        self.gate_up_proj = SmallRowsLinear(h, 2 * self.intermediate, bias=False)
        self.down_proj = SmallRowsLinear(self.intermediate, h, bias=False)
        # Set where down_proj is FP8 (fp8_linear.fuse_fp8_inputs): SiLU-and-mul writes its input.
        self.quantize = False

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, -1)  # [T, I] each, views
        act = layer_ops.silu_and_mul_quant if self.quantize else layer_ops.silu_and_mul
        return self.down_proj(act(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, layer_id: int):
        super().__init__()
        self.self_attn = Attention(arch, layer_id)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rot: layer_ops.Rotary,
                attn: AttnFn) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream entering the layer is x + residual (x alone when residual is
        None) and leaving it is out + residual' for the returned (out, residual'): each add
        rides in the following norm's kernel."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        a = self.self_attn(h, rot, attn)
        h, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, arch: LlamaArch):
        super().__init__()
        # Uninitialised (the loader builds on the meta device and fills every weight): a
        # random init there costs a second of start-up importing torch's reference ops.
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class TiedLMHead(nn.Module):
    """LM head that reads the embedding matrix at call time.

    Not a shared nn.Parameter: Module.to()/to_empty() in torch 2.13 give each module its own
    copy, which would silently untie the two and leave one of them unloaded.
    """

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        object.__setattr__(self, "_embed", embed)  # plain attribute: not a second submodule

    @property
    def weight(self) -> torch.Tensor:
        return self._embed.weight

    def forward(self, hidden: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        return small_rows_linear.linear(hidden, self.weight[:limit])


class LMHead(SmallRowsLinear):
    """The untied output projection. `limit`: logits of the first ids only (a draft's cut
    of the vocabulary, draft.max_token_id), from a view of the first rows."""

    def forward(self, hidden: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        return small_rows_linear.linear(hidden, self.weight[:limit])


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.arch = arch
        self.load_stats: dict[str, float] | None = None  # what loading cost (loader.build_model)
        self.kernel_switch = None  # model.cpu_weights=packed: packed_cpu_weights.KernelSwitch
        self.model = LlamaModel(arch)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        if arch.tie_word_embeddings:
            self.lm_head: nn.Module = TiedLMHead(self.model.embed_tokens)
        else:
            self.lm_head = LMHead(arch.hidden_size, arch.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [T, H]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnFn,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions [T] (many requests concatenated) -> (normed hidden [T, H], aux).

        aux[j] is the residual stream entering layer aux_layers[j] (EAGLE-3's capture point);
        index num_layers means the last layer's output before the final norm.
        """
        self.check_aux_layers(aux_layers)
        captured: dict[int, torch.Tensor] = {}
        x, residual = self.embed(input_ids), None  # [T, H]; the stream is x + residual
        rot = layer_ops.rotary(positions, self.rotary.inv_freq)
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                # Summed here only where captured; the layer's norm kernel sums it to the same value.
                captured[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, rot, attn)
        normed, x = self.model.norm(x, residual)
        captured[self.arch.num_layers] = x
        return normed, [captured[i] for i in aux_layers]

    def check_aux_layers(self, aux_layers: tuple[int, ...]) -> None:
        for i in aux_layers:
            if not 0 <= i <= self.arch.num_layers:
                raise ValueError(f"aux layer {i} is outside 0..{self.arch.num_layers}")

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, V] fp32, so sampling and verification agree; into `out` [T, V] fp32 when
        given (a static buffer shared by graphs of several sizes), at the cost of the cast."""
        logits = self.lm_head(hidden)  # [T, V] model dtype
        return logits.float() if out is None else out.copy_(logits)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Parameters under checkpoint (HF) names: the fused projections split back (views)."""
        a = self.arch
        sizes = projection_sizes(a.q_size, a.kv_size, a.intermediate_size)
        return split_projections(dict(self.named_parameters()), sizes)

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor],
                     copy: Callable[[torch.Tensor, torch.Tensor], None] = torch.Tensor.copy_) -> None:
        """Copy an HF-named state into the parameters (cast to their dtype/device). Strict.

        ``state`` may read its tensors lazily (hf_loader, gguf_loader): each is read once,
        copied and dropped. Checkpoint q/k/v (gate/up) land straight in their rows of the
        fused parameter, so nothing is concatenated on the host. ``copy(dst, src)`` moves
        one tensor (pinned_staging.PinnedStaging.copy on CUDA).

        An FP8 model (fp8_linear.py) takes FP8 weights with their weight_scale entries as
        they are, or unquantized weights (no weight_scale in the checkpoint), each quantized
        on the device as it is written."""
        slots = self.checkpoint_state()  # checkpoint name -> parameter or row slice of one
        expected = set(slots)
        given = set(state)
        # Tied checkpoints may or may not also store lm_head.weight; the embedding is the truth.
        ignored = {n for n in given if self.arch.tie_word_embeddings and n == "lm_head.weight"}
        # Old Llama checkpoints persist the RoPE table; we compute it.
        ignored |= {n for n in given if n.endswith("rotary_emb.inv_freq")}
        # Scales an unquantized checkpoint lacks: made from the weights by write_quantized.
        derived = (set() if any(n.endswith(".weight_scale") for n in given)
                   else {n for n in expected if n.endswith(".weight_scale")})
        unknown = sorted(given - ignored - expected)
        missing = sorted(expected - derived - given)
        if unknown or missing:
            raise KeyError(
                "checkpoint does not match the model: "
                f"unknown {unknown[:8]}{' ...' if len(unknown) > 8 else ''} ({len(unknown)}), "
                f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)})"
            )
        for name in state:  # the source's order (shard by shard)
            if name in ignored:
                continue
            src, dst = state[name], slots[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
            # FP8 weights come with their scales; unquantized ones into FP8 rows without.
            if src.dtype == FP8 and (dst.dtype != FP8 or derived) \
                    or dst.dtype == FP8 and src.dtype != FP8 and not derived:
                raise ValueError(f"{name}: checkpoint dtype {src.dtype} does not fit the model's "
                                 f"{dst.dtype} (FP8 weights need weight_scale entries, and only FP8 ones)")
            if dst.dtype == FP8 and src.dtype != FP8:
                write_quantized(dst, slots[name + "_scale"], src, copy)
            else:
                copy(dst, src)
            del src  # before the next one is read: one tensor on the host at a time
