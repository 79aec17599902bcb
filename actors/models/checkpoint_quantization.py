"""The quantization a Hugging Face checkpoint declares (config.json's quantization_config).

Kestrel runs one such layout as it is stored: compressed-tensors with E4M3 weights, a scale
per output channel, and activations quantized per token at run time (llm-compressor's
FP8_DYNAMIC scheme; each projection's `weight` [out, in] float8_e4m3fn beside its
`weight_scale` [out, 1]). Any other declared quantization (GPTQ, AWQ, bitsandbytes, other
compressed-tensors schemes) is refused by name: loading its packed tensors as plain weights
would serve garbage.
"""

from __future__ import annotations

from typing import Any

SUPPORTED = ("compressed-tensors FP8 with per-channel weight scales and dynamic per-token "
             "activations (llm-compressor's FP8_DYNAMIC scheme)")


def checkpoint_quantization(config: dict[str, Any]) -> str | None:
    """"fp8" for the supported layout, None for an unquantized checkpoint; raises for others."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"config.json quantization_config quant_method={method!r} is not "
                         f"supported (supported: {SUPPORTED})")
    problems = _fp8_dynamic_problems(q)
    if problems:
        raise ValueError("config.json quantization_config (compressed-tensors) is not supported: "
                         f"{'; '.join(problems)} (supported: {SUPPORTED})")
    return "fp8"


def _fp8_dynamic_problems(q: dict[str, Any]) -> list[str]:
    """What keeps a compressed-tensors quantization_config from being FP8_DYNAMIC."""
    problems = []
    if q.get("quantization_status", "compressed") != "compressed":
        problems.append(f"quantization_status={q['quantization_status']!r} (stored unquantized)")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            problems.append(f"{key} is set")
    # lm_head (and the embedding, no Linear anyway) may stay unquantized; any other layer
    # left out would need a decoder of mixed precision.
    other = [i for i in q.get("ignore") or [] if "lm_head" not in i and "embed_tokens" not in i]
    if other:
        problems.append(f"ignore lists {other[:4]} (only lm_head may stay unquantized)")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        return problems + [f"{len(groups)} config_groups (one is supported)"]
    (name, g), = groups.items()
    fmt = g.get("format") or q.get("format")
    if fmt not in (None, "float-quantized"):
        problems.append(f"format={fmt!r}")
    if g.get("targets") != ["Linear"]:
        problems.append(f"{name} targets={g.get('targets')!r} (['Linear'] is supported)")
    problems += _args_problems(f"{name} weights", g.get("weights"), strategy="channel", dynamic=False)
    problems += _args_problems(f"{name} input_activations", g.get("input_activations"),
                               strategy="token", dynamic=True)
    if g.get("output_activations"):
        problems.append(f"{name} output_activations are quantized")
    return problems


def _args_problems(where: str, args: dict[str, Any] | None, strategy: str, dynamic: bool) -> list[str]:
    if not args:
        return [f"{where} are not quantized"]
    want = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": dynamic,
            "symmetric": True, "group_size": None, "block_structure": None}
    defaults = {"symmetric": True, "group_size": None, "block_structure": None, "dynamic": False}
    off = {k: args.get(k, defaults.get(k)) for k, v in want.items() if args.get(k, defaults.get(k)) != v}
    return [f"{where} {', '.join(f'{k}={v!r}' for k, v in off.items())} "
            f"(want {', '.join(f'{k}={want[k]!r}' for k in off)})"] if off else []
