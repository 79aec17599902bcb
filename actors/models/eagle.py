"""EAGLE draft heads: EAGLE-1/2 and EAGLE-3, in the SGLang/EAGLE checkpoint format.

Both predict the target's next token from (token embedding, target feature). Position p of
the draft pairs token t[p+1] with the target's feature at p; its output hidden state is
fed back as the feature for the next draft step.

EAGLE-1/2 (`LlamaForCausalLMEagle`): x = fc([embed; feature]) ([2H] -> H, with bias), one
decoder layer whose input norm is dropped, logits through the target's LM head.
EAGLE-3 (`LlamaForCausalLMEagle3`): the feature is three captured target layers fused by
fc ([3H] -> H) on the first step; the layer's attention reads [norm(embed); norm(hidden)]
(2H wide); a final norm and its own LM head over a reduced draft vocabulary, mapped back
to target ids by `d2t` (target_id = draft_id + d2t[draft_id]).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from actors.models.llama import (MLP, AttnFn, LlamaForCausalLM, RMSNorm, fuse_projections,
                                 projection_sizes, split_projections)
from actors.models.model_config import LlamaArch
from actors.models.rope import RotaryEmbedding
from kestrel_kernels import layer_ops, spec_ops
from kestrel_kernels.small_rows_linear import SmallRowsLinear


@dataclass
class EagleSpec:
    arch: str  # "eagle" | "eagle3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    draft_vocab_size: int  # == target vocab for EAGLE-1/2
    aux_layers: tuple[int, ...] = ()  # EAGLE-3 capture points in the target

    @classmethod
    def for_target(cls, t: LlamaArch, arch: str, draft_vocab_size: int | None = None) -> "EagleSpec":
        L = t.num_layers
        # Clamped so tiny test targets (a couple of layers) still have three capture points.
        aux = tuple(min(max(i, 0), L - 1) for i in (2, L // 2, L - 3)) if arch == "eagle3" else ()
        return cls(arch, t.hidden_size, t.intermediate_size, t.num_heads, t.num_kv_heads,
                   t.head_dim, t.rms_norm_eps, t.rope_theta, t.rope_scaling,
                   draft_vocab_size or t.vocab_size, aux)


def qkv_sizes(s: EagleSpec) -> list[int]:
    return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]


class _DraftAttention(nn.Module):
    def __init__(self, s: EagleSpec, in_dim: int):
        super().__init__()
        self.s = s
        self.qkv_sizes = qkv_sizes(s)
        self.qkv_proj = SmallRowsLinear(in_dim, sum(self.qkv_sizes), bias=False)  # q, k, v fused
        self.o_proj = SmallRowsLinear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def qkv(self, x, rot: layer_ops.Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, in] -> q [T, Hq, D], k [T, Hkv, D] (both rotated), v [T, Hkv, D]."""
        T, s = x.shape[0], self.s
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, -1)  # column slices, no copies
        q = q.view(T, s.num_heads, s.head_dim)
        k = k.view(T, s.num_kv_heads, s.head_dim)
        v = v.view(T, s.num_kv_heads, s.head_dim)
        q, k = layer_ops.rope_at(q, k, rot)
        return q, k, v

    def forward(self, x, rot: layer_ops.Rotary, attn: AttnFn):
        q, k, v = self.qkv(x, rot)
        # one layer: id 0; sizes spelled out, as an idle DP rank's forward has no tokens
        return self.o_proj(attn(q, k, v, 0).reshape(x.shape[0], self.s.num_heads * self.s.head_dim))


class _DraftLayer(nn.Module):
    def __init__(self, s: EagleSpec):
        super().__init__()
        self.eagle3 = s.arch == "eagle3"
        H = s.hidden_size
        self.self_attn = _DraftAttention(s, 2 * H if self.eagle3 else H)
        self.mlp = MLP(SimpleNamespace(hidden_size=H, intermediate_size=s.intermediate_size))
        self.post_attention_layernorm = RMSNorm(H, s.rms_norm_eps)
        if self.eagle3:
            self.input_layernorm = RMSNorm(H, s.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, s.rms_norm_eps)

    def attention_input(self, emb, hidden) -> torch.Tensor:
        if self.eagle3:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)  # [T, 2H]
        return hidden  # EAGLE-1 drops the input norm

    def forward(self, emb, hidden, rot: layer_ops.Rotary, attn):
        a = self.self_attn(self.attention_input(emb, hidden), rot, attn)
        normed, h = self.post_attention_layernorm(a, hidden)  # h = hidden + a
        return h + self.mlp(normed)


class EagleHead(nn.Module):
    def __init__(self, s: EagleSpec, target: LlamaForCausalLM):
        super().__init__()
        self.spec = s
        H = s.hidden_size
        self.eagle3 = s.arch == "eagle3"
        # Not registered as submodules: the target owns them.
        object.__setattr__(self, "_target", target)
        if self.eagle3:
            self.fc = SmallRowsLinear(3 * H, H, bias=False)
            self.norm = RMSNorm(H, s.rms_norm_eps)
            self.lm_head = SmallRowsLinear(H, s.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.int64))
        else:
            self.fc = SmallRowsLinear(2 * H, H, bias=True)
        self.layer = _DraftLayer(s)
        self.rotary = RotaryEmbedding(s.head_dim, s.rope_theta, s.rope_scaling)
        self.max_token_id: int | None = None  # EAGLE-1: draft among ids below (draft.max_token_id)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.spec.aux_layers

    def forward(self, input_ids, positions, attn: AttnFn, hidden_in: torch.Tensor):
        """input_ids, positions [T]; hidden_in [T, H] (draft's own) or target features
        ([T, H] final hidden for EAGLE-1, [T, 3H] captured layers for EAGLE-3) -> [T, H]."""
        return self.layer(*self._layer_inputs(input_ids, positions, hidden_in), attn)

    def kv(self, input_ids, positions, hidden_in) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V ([T, Hkv, D] each) that forward() stores for these positions: they
        depend on the layer's input alone, not on attention, the MLP or the LM head."""
        emb, h, rot = self._layer_inputs(input_ids, positions, hidden_in)
        _, k, v = self.layer.self_attn.qkv(self.layer.attention_input(emb, h), rot)
        return k, v

    def _layer_inputs(self, input_ids, positions, hidden_in):
        """-> (embeddings [T, H], the layer's hidden input [T, H], the rotary tables)."""
        # The head's dtype: its norms' (a packed head's projections hold GEMM weights).
        emb = self._target.embed(input_ids).to(self.layer.post_attention_layernorm.weight.dtype)  # [T, H]
        hidden_in = hidden_in.to(emb.dtype)
        rot = layer_ops.rotary(positions, self.rotary.inv_freq)
        if self.eagle3:
            return emb, self.fc(hidden_in) if hidden_in.shape[-1] != emb.shape[-1] else hidden_in, rot
        return emb, self.fc(torch.cat([emb, hidden_in], -1)), rot  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, Vd] fp32."""
        return self._logits(hidden).float()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, Vd] in the model's dtype."""
        if self.eagle3:
            return self.lm_head(self.norm(hidden))
        # The target's head: the first rows only under draft.max_token_id (a view, no
        # copy); under dp_attention a vocab-parallel head (a collective).
        return self._target.lm_head(hidden, self.max_token_id)

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the draft's softmax, as target token ids: ([T, k] fp32, [T, k] int64)."""
        topk_p, idx = spec_ops.topk_probs(self._logits(hidden), k)  # fp32 inside
        if self.eagle3:
            idx = idx + self.d2t[idx]
        return topk_p, idx

    # ---- checkpoints -------------------------------------------------------------------
    def state_for_export(self) -> dict[str, torch.Tensor]:
        """Weights under SGLang/EAGLE names (midlayer.* for EAGLE-3, model.* for EAGLE-1)."""
        out = {}
        q, kv, _ = qkv_sizes(self.spec)
        sizes = projection_sizes(q, kv, self.spec.intermediate_size)
        for name, t in split_projections(self.state_dict(), sizes).items():
            if name.startswith("rotary."):
                continue
            out[_export_name(name, self.eagle3)] = t.detach().contiguous()
        return out

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        own = dict(self.state_dict())
        mapped = {}
        for name, t in state.items():
            local = _import_name(name, self.eagle3)
            if local is None:
                continue
            mapped[local] = t
        mapped = fuse_projections(mapped)
        if self.eagle3 and "t2d" in state and "d2t" not in state:
            raise KeyError("EAGLE-3 checkpoint has t2d but no d2t")
        missing = sorted(k for k in own if k not in mapped and not k.startswith("rotary."))
        unknown = sorted(k for k in mapped if k not in own)
        if missing or unknown:
            raise KeyError(f"EAGLE checkpoint does not match: missing {missing[:6]}, unknown {unknown[:6]}")
        for k, t in mapped.items():
            if tuple(own[k].shape) != tuple(t.shape):
                raise ValueError(f"{k}: checkpoint shape {tuple(t.shape)} != head shape {tuple(own[k].shape)}")
            own[k].copy_(t)


def _export_name(local: str, eagle3: bool) -> str:
    if local.startswith("layer."):
        rest = local[len("layer."):]
        return ("midlayer." + rest) if eagle3 else ("model.layers.0." + rest)
    if local in ("d2t",):
        return local
    return local if eagle3 else "model." + local


def _import_name(name: str, eagle3: bool) -> str | None:
    for prefix in ("midlayer.", "model.layers.0.", "layers.0."):
        if name.startswith(prefix):
            return "layer." + name[len(prefix):]
    if name in ("t2d",) or name.endswith("embed_tokens.weight") or "rotary_emb" in name:
        return None  # the target's embedding is used; t2d is derivable from d2t
    if name.startswith("model."):
        name = name[len("model."):]
    return name


def write_eagle_config(out: Path, s: EagleSpec, target_vocab: int) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if s.arch == "eagle3" else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim, "num_hidden_layers": 1, "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta, "rope_scaling": s.rope_scaling,
        "vocab_size": target_vocab, "draft_vocab_size": s.draft_vocab_size,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    if s.aux_layers:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(s.aux_layers)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def read_eagle_spec(folder: Path, target: LlamaArch, arch: str = "auto") -> EagleSpec:
    cfg = json.loads((folder / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if arch == "auto":
        arch = "eagle3" if any("Eagle3" in a for a in archs) else "eagle"
    H = cfg.get("hidden_size", target.hidden_size)
    heads = cfg.get("num_attention_heads", target.num_heads)
    s = EagleSpec(arch, H, cfg.get("intermediate_size", target.intermediate_size), heads,
                  cfg.get("num_key_value_heads", heads), cfg.get("head_dim", H // heads),
                  cfg.get("rms_norm_eps", target.rms_norm_eps),
                  cfg.get("rope_theta", target.rope_theta), cfg.get("rope_scaling"),
                  cfg.get("draft_vocab_size", cfg.get("vocab_size", target.vocab_size)))
    if arch == "eagle3":
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        L = target.num_layers
        s.aux_layers = tuple(ids) if ids else (2, L // 2, L - 3)
    return s


def resolve_draft_path(draft_path: str | None, model_path: str | None,
                       load_format: str = "auto") -> str:
    """draft.path as given; when unset, the shipped head of the default target, a random
    head for a random target (model.load_format=dummy: no trained head fits it, and its
    speed does not depend on the values), and an error for any other target (a random
    head would only slow it down)."""
    if draft_path:
        return draft_path
    if load_format == "dummy":
        return "random"
    if model_path is None:
        from heads import default_head_path
        return default_head_path()
    raise ValueError(f"draft.enabled=true needs draft.path for model.path={model_path!r}: the shipped "
                     "head fits only the default SmolLM2 target (train one: kestrel train-draft)")


def read_head_state(folder: Path) -> dict[str, torch.Tensor]:
    """A head folder's tensors under their published names (*.safetensors, then *.bin)."""
    from safetensors.torch import load_file
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for f in sorted(folder.glob("*.bin")):
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    if not state:
        raise FileNotFoundError(f"{folder}: no *.safetensors or *.bin weights (expected an EAGLE head folder)")
    return state


@torch.no_grad()
def load_eagle_head(path: str, target: LlamaForCausalLM, arch: str, dtype: torch.dtype,
                    device: torch.device, seed: int = 0) -> EagleHead:
    """A head from an SGLang/EAGLE folder, or `path="random"` for a random one."""
    if path == "random":
        s = EagleSpec.for_target(target.arch, "eagle" if arch == "auto" else arch)
        # Built on the device in its dtype: a head for a 7B target is ~1 GB in float32.
        with torch.device("meta"):
            head = EagleHead(s, target)
        head = head.to(dtype).to_empty(device=device)  # .to(dtype) leaves the int64 d2t alone
        if head.eagle3:
            head.d2t.zero_()  # draft ids are target ids
        g = torch.Generator(device=device).manual_seed(seed)
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.02)  # fp32, one tensor
        return head
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"draft.path={path!r}: no config.json (expected an EAGLE head folder)")
    s = read_eagle_spec(folder, target.arch, arch)
    head = EagleHead(s, target)
    head.load_checkpoint_state(read_head_state(folder))
    return head.to(device=device, dtype=dtype)  # .to(dtype) leaves the int64 d2t alone
