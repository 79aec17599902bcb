"""LlamaArch: the shape and numerics of a Llama-family target model, from any source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.models.checkpoint_quantization import checkpoint_quantization

# model_type values whose forward is exactly the Llama block (RMSNorm, RoPE, GQA, SwiGLU).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# rope_type values rope.py implements ("freq_factors" is Kestrel's own: llama.cpp's rope_freqs tensor).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "freq_factors")


@dataclass
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # HF format ({"rope_type": "llama3", "factor": ..., ...}); None means plain RoPE.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"  # HF model_type: "llama" | "mistral" | "qwen2"
    # Mistral-style local attention window; None = full causal attention. Backends must honour it.
    sliding_window: int | None = None
    # The checkpoint's own quantization (checkpoint_quantization.py): "fp8" for compressed-
    # tensors FP8_DYNAMIC weights, None for unquantized ones.
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling rope_type={kind!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )

    def check_context(self, max_model_len: int) -> None:
        """ValueError, naming the fields, where a context of max_model_len tokens would be
        served wrong: attention here is over the whole context, never a local window."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ValueError(
                f"config.json sliding_window={self.sliding_window} is smaller than "
                f"model.max_model_len={max_model_len}: Kestrel attends over the whole context "
                f"(no sliding-window attention), which past {self.sliding_window} tokens differs "
                f"from this model's; set model.max_model_len <= {self.sliding_window}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "LlamaArch":
        """Build from a Hugging Face config.json dict (Llama, Mistral, Qwen2, SmolLM2)."""
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
        if d.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json partial_rotary_factor != 1 is not supported")

        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        # Mistral/Qwen configs may carry "head_dim": null; the Llama rule is hidden / heads.
        head_dim = int(d.get("head_dim") or hidden // heads)

        theta, scaling = _rope_from_hf(d)

        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        bos = d.get("bos_token_id")

        # Qwen2 always has q/k/v bias and its config has no attention_bias key.
        attention_bias = bool(d.get("attention_bias", model_type == "qwen2"))

        window = d.get("sliding_window")
        if model_type == "qwen2" and not d.get("use_sliding_window", False):
            window = None  # Qwen2 configs list a window but only use it when asked to
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            # LlamaConfig / Qwen2Config default to untied when the key is absent.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            architecture=model_type,
            sliding_window=None if window is None else int(window),
            quantization=checkpoint_quantization(d),
        )


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the transformers<5 keys or transformers 5's rope_parameters."""
    params = d.get("rope_parameters")
    if params:
        if all(isinstance(v, dict) for v in params.values()):
            # Per-layer-type parameters (full vs sliding attention): not a Llama layout.
            raise ValueError("config.json rope_parameters per layer type is not supported")
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {}
    # Older configs spell rope_type as "type".
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return float(theta), None
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope_type={kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return float(theta), scaling
