"""Truncation cost on the GPU: `process_logits` with top-p (and top-k) by the sorted
reference against the sort-free Triton kernel (kestrel_kernels/triton_top_p.py), per call, at the
row counts a step makes (plain batch 64; tree batch 64 x 8 nodes) over SmolLM2's 49152 ids.

    python -m benchmarks.sampling_ops [--rows 1 64 512] [--vocab 49152]

Prints a markdown table of milliseconds per call (CUDA events, median of 50 after 5 warm-ups).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kestrel_kernels import sampling
from kestrel_kernels.triton_top_p import top_k_top_p_triton


def time_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    print("| rows | filter | sorted reference ms | triton ms | softmax only ms |")
    print("|---|---|---|---|---|")
    for T in args.rows:
        gen = torch.Generator(device="cuda").manual_seed(T)
        logits = torch.randn(T, args.vocab, generator=gen, device="cuda") * 3  # [T, V] float32
        probs = torch.softmax(logits, dim=-1)  # [T, V] float32
        temp = torch.full((T,), 0.7, device="cuda")
        for name, p, k in (("top_p 0.9", 0.9, 0), ("top_k 50 + top_p 0.9", 0.9, 50)):
            top_p = torch.full((T,), p, device="cuda")
            top_k = torch.full((T,), k, dtype=torch.int64, device="cuda")
            ref = time_ms(lambda: sampling.top_k_top_p_ref(probs, top_p, top_k))
            tri = time_ms(lambda: top_k_top_p_triton(probs, top_p, top_k))
            soft = time_ms(lambda: sampling.process_logits(logits, temp, top_p, top_k, filtered=False))
            print(f"| {T} | {name} | {ref:.3f} | {tri:.3f} | {soft:.3f} |", flush=True)


if __name__ == "__main__":
    main()
