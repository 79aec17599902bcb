"""ms per forward of SmolLM2-135M's 30 layers' four projections (random weights, 30 copies each
so they come from memory) at 1-128 rows: the Q4_1 kernel, a float32 GEMM, and a bfloat16 GEMM on
float32 activations cast in and out. Best of 7.
    PYTHONPATH=. python docs/runs/2026-12-05-cpu-default-packed/kernels_by_rows.py THREADS"""
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
import torch.nn.functional as F
from kestrel_kernels.cpu_q4 import quantize_q4_1, q4_1_linear
L = 30
shapes = {'qkv': (960, 576), 'o': (576, 576), 'gu': (3072, 576), 'down': (576, 1536)}
g = torch.Generator().manual_seed(0)
f32 = {k: [torch.randn(N, K, generator=g) * 0.05 for _ in range(L)] for k, (N, K) in shapes.items()}
q4 = {k: [quantize_q4_1(w) for w in v] for k, v in f32.items()}
b16 = {k: [w.bfloat16() for w in v] for k, v in f32.items()}
def bench(f, n=7):
    f(); best = 1e9
    for _ in range(n):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    return best * 1e3
for M in [1, 2, 4, 8, 16, 32, 64, 128]:
    xs = {k: torch.randn(M, K) for k, (N, K) in shapes.items()}
    a = bench(lambda: [q4_1_linear(xs[k], q4[k][i]) for i in range(L) for k in shapes])
    b = bench(lambda: [F.linear(xs[k], f32[k][i]) for i in range(L) for k in shapes])
    c = bench(lambda: [F.linear(xs[k].bfloat16(), b16[k][i]).float() for i in range(L) for k in shapes])
    print(f"M={M}: q4 {a:.1f}  f32 {b:.1f}  bf16 {c:.1f} ms", flush=True)
