"""The draft trainer's TTT attention against its dense-mask reference: forward plus backward
time of all unrolled steps of one batch, SmolLM2-135M's head shape (9 query heads, 3 KV
heads, 64 wide).

    python -m benchmarks.ttt_attention_bench [--device cuda] [--batch 16] [--tokens 1024] [--steps 7]
"""
from __future__ import annotations

import argparse
import time

import torch

from training.ttt_attention import TTTAttention, ttt_attention, ttt_attention_dense


def run(attend, B: int, T: int, steps: int, dev: torch.device, dtype: torch.dtype) -> float:
    """Seconds for one batch: `steps` unrolled calls, then backward through all of them."""
    qs = [torch.randn(B * T, 9, 64, device=dev, dtype=dtype, requires_grad=True) for _ in range(steps)]
    kvs = [torch.randn(B * T, 3, 64, device=dev, dtype=dtype, requires_grad=True) for _ in range(2 * steps)]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    attn = TTTAttention(B, T, attend)
    loss = sum(attn(qs[i], kvs[2 * i], kvs[2 * i + 1], 0).float().square().mean() for i in range(steps))
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024, help="padded tokens per row (T)")
    ap.add_argument("--steps", type=int, default=7, help="unrolled steps (EAGLE-3's default)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    print(f"B={args.batch} T={args.tokens} steps={args.steps} {dev.type} {dtype}")
    for name, attend in (("dense mask", ttt_attention_dense), ("causal + diagonals", ttt_attention)):
        run(attend, args.batch, args.tokens, args.steps, dev, dtype)  # warm-up
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = sorted(run(attend, args.batch, args.tokens, args.steps, dev, dtype) for _ in range(args.repeats))
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if dev.type == "cuda" else ""
        print(f"{name:>20}: {1000 * times[len(times) // 2]:8.1f} ms per batch (median of {args.repeats}){peak}",
              flush=True)


if __name__ == "__main__":
    main()
