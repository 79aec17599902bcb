"""Write a trained head as an SGLang/EAGLE folder: config.json + safetensors shards.

Names are the published formats': EAGLE-3 as SpecForge writes it (fc, midlayer.*, norm,
lm_head, d2t, t2d), EAGLE-1/2 as the EAGLE repository does (fc, layers.0.*), which is
what SGLang's LlamaForCausalLMEagle expects (it prefixes "model." itself) and what
Kestrel's `load_eagle_head` maps back. The target's embedding and LM head are not
stored: both loaders take them from the target.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from actors.models.eagle import EagleHead, write_eagle_config

log = logging.getLogger("kestrel.training.export")

MAX_SHARD_BYTES = 16 * 1000 * 1000  # under 16 MB (either reading of "MB") per file


def export_state(head: EagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors under their published names; floats cast to `dtype`, d2t int64, t2d bool."""
    out: dict[str, torch.Tensor] = {}
    for name, t in head.state_for_export().items():
        if not head.eagle3 and name.startswith("model."):
            name = name[len("model."):]  # EAGLE-1 files carry no "model." prefix
        t = t.detach().cpu()
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    if head.eagle3:
        d2t = out["d2t"].long()  # [Vd] int64
        t2d = torch.zeros(head._target.arch.vocab_size, dtype=torch.bool)  # [V] bool
        t2d[d2t + torch.arange(d2t.numel())] = True
        out["t2d"] = t2d
    return out


def _shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Greedy packing in name order. A tensor cannot be split across files, so one larger
    than the limit gets a file of its own (and a warning)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        n = state[name].numel() * state[name].element_size()
        if n > limit:
            log.warning("%s is %.1f MB, over the %.1f MB shard limit: it gets a file of its own "
                        "(a smaller draft vocabulary keeps the EAGLE-3 lm_head under it)",
                        name, n / 1e6, limit / 1e6)
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += n
    return shards


def export_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write config.json and the weights; returns the safetensors files written."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a stale shard from an earlier export would be loaded too
    target = head._target
    write_eagle_config(out, head.spec, target.arch.vocab_size)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")  # what the files really hold
    (out / "config.json").write_text(json.dumps(cfg, indent=2))

    shards = _shards(export_state(head, dtype), max_shard_bytes)
    files: list[Path] = []
    if len(shards) == 1:
        files.append(out / "model.safetensors")
        save_file(shards[0], str(files[0]), metadata={"format": "pt"})
        return files
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        f = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(f), metadata={"format": "pt"})
        files.append(f)
        weight_map.update({k: f.name for k in shard})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files
