"""How the target's residual streams are scaled, per layer an EAGLE-3 head could read:
`python -m training.feature_stats [--data JSONL] [--num 16] [--layers 2 15 27 30]`.

For each layer: the stream's RMS, and the RMS of its largest dimensions against the median
dimension's (the first token of each sample left out: its stream is an outlier of its
own). Badly scaled streams are what `--feature-scale rms` is for (training/README.md).
"""
from __future__ import annotations

import argparse
import json

import torch

from actors.models.loader import build_model, default_model_path
from training.ttt_attention import CausalAttention


def stream_stats(model, samples: list[list[int]], layers: tuple[int, ...], max_len: int = 256) -> dict:
    streams: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    with torch.no_grad():
        for ids in samples:
            x = torch.tensor(ids[:max_len])  # [T] int64
            _, aux = model(x, torch.arange(len(x)), CausalAttention(1, len(x)), layers)
            for i, a in zip(layers, aux):
                streams[i].append(a[1:].float())  # [T-1, H]
    out = {}
    for i in layers:
        x = torch.cat(streams[i])  # [N, H]
        dim_rms = x.square().mean(0).sqrt()  # [H]
        top = dim_rms.topk(4)
        out[i] = {"rms": round(float(x.square().mean().sqrt()), 2),
                  "median_dim_rms": round(float(dim_rms.median()), 2),
                  "top_dims": top.indices.tolist(), "top_dim_rms": [round(float(v), 1) for v in top.values]}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the default model)")
    ap.add_argument("--data", default="benchmarks/data/smollm2_heldout_prompts.jsonl",
                    help="JSONL with input_ids (training data) or prompts (messages/turns)")
    ap.add_argument("--num", type=int, default=16)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="default 2, L/2, L-3, L")
    args = ap.parse_args(argv)
    model, arch = build_model(args.model or default_model_path(), torch.float32, "cpu")
    L = arch.num_layers
    layers = tuple(args.layers or (2, L // 2, L - 3, L))
    rows = [json.loads(line) for line in open(args.data) if line.strip()][:args.num]
    if rows and "input_ids" not in rows[0]:
        from serve_app.text.tokenizer import load_tokenizer
        from training.evaluate import read_eval_prompts
        samples, _ = read_eval_prompts(args.data, load_tokenizer(args.model or default_model_path()))
        samples = samples[:args.num]
    else:
        samples = [r["input_ids"] for r in rows]
    for i, st in stream_stats(model, samples, layers).items():
        where = "the last layer's output" if i == L else f"the stream entering layer {i}"
        print(f"{where}: RMS {st['rms']}, median dimension {st['median_dim_rms']}, "
              f"largest dimensions {st['top_dims']} at {st['top_dim_rms']}")


if __name__ == "__main__":
    main()
