"""The penalties' cost on the GPU: `apply_processing` (presence, frequency, repetition and a
logit bias) with the torch reference against the Triton kernel (kestrel_kernels/triton_penalties.py),
per call, at the shapes a step makes: plain batch 64 (N = 1) and batch 64 of 8-node trees
with their paths, over SmolLM2's 49152 ids.

    python -m benchmarks.penalties_ops [--batch 64] [--nodes 1 8] [--vocab 49152]

Prints a markdown table of milliseconds per call (CUDA events, median of 50 after 5 warm-ups).
"""
from __future__ import annotations

import argparse
from unittest import mock

import torch

from benchmarks.sampling_ops import time_ms
from kestrel_kernels import penalties


def inputs(B: int, N: int, V: int) -> tuple:
    """(logits, Processing, counts, num_out, prompt, path_tokens, path_mask) on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(N)
    dev = "cuda"
    logits = torch.randn(B, N, V, generator=gen, device=dev) * 3  # [B, N, V] float32
    counts = torch.randint(0, 3, (B, V), generator=gen, device=dev, dtype=torch.int32)  # [B, V]
    prompt = torch.rand(B, V, generator=gen, device=dev) < 0.01  # [B, V] bool
    full = lambda v, dt=torch.float32: torch.full((B,), v, dtype=dt, device=dev)  # noqa: E731
    none = lambda *s: torch.full((B, *s), -1, dtype=torch.int64, device=dev)  # noqa: E731
    p = penalties.Processing(full(0.5), full(0.3), full(1.1), full(0, torch.int64),
                             torch.full((B, 1), 13, device=dev), full(-2.0)[:, None], none(0), none(0),
                             none(0, 1))
    path_tokens = path_mask = None
    if N > 1:
        path_tokens = torch.randint(0, V, (B, N), generator=gen, device=dev)  # [B, N] int64
        path_mask = torch.ones(N, N, dtype=torch.bool, device=dev).tril()  # [N, N] bool: a chain
        path_mask[:, 0] = False
        path_mask = path_mask.expand(B, N, N).contiguous()
    return logits, p, counts, full(5, torch.int64), prompt, path_tokens, path_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    print("| batch x nodes | torch ms | triton ms |")
    print("|---|---|---|")
    for N in args.nodes:
        a = inputs(args.batch, N, args.vocab)
        with mock.patch.object(penalties, "use_triton", lambda t, force_torch=False: False):
            ref = time_ms(lambda: penalties.apply_processing(*a))
        tri = time_ms(lambda: penalties.apply_processing(*a))
        print(f"| {args.batch} x {N} | {ref:.3f} | {tri:.3f} |", flush=True)


if __name__ == "__main__":
    main()
