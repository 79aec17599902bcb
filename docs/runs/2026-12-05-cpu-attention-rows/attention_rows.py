"""paged_attention's time per layer call for T query rows of one request (a verify's rows,
causal over the last T keys) at n keys of context, SmolLM2-135M's heads (9 query, 3 KV, 64
wide): python attention_rows.py THREADS, run from the checkout to measure (REPO=path)."""
import os
import sys
import time

import torch

sys.path.insert(0, os.environ.get("REPO", "."))
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from kestrel_kernels.cpu_attention import paged_attention
H, Hkv, D, slots = 9, 3, 64, 32768
def bench(n, T, reps=300):
    k = torch.randn(slots, Hkv, D); v = torch.randn(slots, Hkv, D)
    kv_index = torch.arange(n + T)[None].clone()
    mask = torch.zeros(1, 1, T, n + T, dtype=torch.bool); mask[..., :n] = True
    for t in range(T): mask[0, 0, t, n:n + t + 1] = True
    q = torch.randn(T, H, D)
    qb = torch.zeros(T, dtype=torch.int64); qs = torch.arange(T)
    f = lambda: paged_attention(q, k, v, kv_index, mask, qb, qs, 0.125)
    for _ in range(20): f()
    t0 = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t0) / reps * 1e6
for n in (128, 512, 1024):
    print(n, {T: round(bench(n, T), 1) for T in (1, 2, 4, 8)}, "us per layer call")
