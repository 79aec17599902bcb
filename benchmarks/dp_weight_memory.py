"""Per-rank weight memory with parallel.dp_attention against without: the target (and the
shipped draft head) sharded for each rank of each group size by the code the ranks run
(actors/dp/sharded_layers.py), counted by storage. Sharding is local: no group is joined.
Prints a markdown table (the largest rank of each size; splits may be uneven by a row).

    python -m benchmarks.dp_weight_memory [--model PATH] [--dtype bfloat16] [--sizes 2 3 4 8]
"""
from __future__ import annotations

import argparse
import copy

import torch

from actors.dp.attention_group import DPAttentionGroup
from actors.dp.sharded_layers import shard_model, weight_bytes
from actors.models.eagle import load_eagle_head, resolve_draft_path
from actors.models.loader import build_model, default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="EAGLE head (default: the shipped one; "
                    "'none' leaves it out)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4, 8])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, arch = build_model(args.model or default_model_path(), dtype, "cpu")
    head = None
    if args.draft != "none":
        head = load_eagle_head(resolve_draft_path(args.draft, args.model), model, "auto", dtype,
                               torch.device("cpu"))
    mib = lambda n: n / 2**20

    def per_rank(W: int) -> int:
        worst = 0
        for rank in range(W):
            m = copy.deepcopy(model)
            shard_model(m, DPAttentionGroup(rank, W, arch.num_layers, None, timeout_s=1.0))
            worst = max(worst, weight_bytes(m, *([head] if head is not None else [])))  # head: replicated
        return worst

    whole = weight_bytes(model, *([head] if head is not None else []))
    print(f"{args.model or 'SmolLM2-135M-Instruct'}, {args.dtype}"
          f"{', with the EAGLE head' if head is not None else ''}: "
          f"hidden {arch.hidden_size}, intermediate {arch.intermediate_size}, "
          f"{arch.num_layers} layers, vocabulary {arch.vocab_size}, tied {arch.tie_word_embeddings}\n")
    print("| dp_size | dp_attention | weights per rank (MiB) | of one rank's whole |")
    print("|---|---|---|---|")
    print(f"| any | false | {mib(whole):.1f} | 1.00 |")
    for W in args.sizes:
        n = per_rank(W)
        print(f"| {W} | true | {mib(n):.1f} | {n / whole:.2f} |")


if __name__ == "__main__":
    main()
