"""ms per call, one thread: the 30 layers' Q4_1 projections of SmolLM2-135M (weights rotating, so read from
memory) and the Q8_0 LM head (all 49152 rows, and the draft's first 16384), at the row counts given."""
import sys, time, torch
torch.set_num_threads(1)
from kestrel_kernels.cpu_q4 import quantize_q4_1, quantize_q8_0, q4_1_linear, q8_0_linear
L = 30
shapes = {'qkv': (960, 576), 'o': (576, 576), 'gu': (3072, 576), 'down': (576, 1536)}
g = torch.Generator().manual_seed(0)
ws = {k: [quantize_q4_1(torch.randn(N, K, generator=g) * 0.05) for _ in range(L)] for k, (N, K) in shapes.items()}
head = quantize_q8_0(torch.randn(49152, 576, generator=g) * 0.05)
def bench(f, n):
    f(); best = 1e9
    for _ in range(n):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    return best * 1e3
for M in [int(a) for a in sys.argv[1:]] or [1, 4]:
    xs = {k: torch.randn(M, K) for k, (N, K) in shapes.items()}
    lay = bench(lambda: [q4_1_linear(xs[k], ws[k][i]) for i in range(L) for k in shapes], 15)
    x = torch.randn(M, 576)
    h = bench(lambda: q8_0_linear(x, head), 10)
    h16 = bench(lambda: q8_0_linear(x, head, 16384), 10)
    print(f"M={M}: 30 layers {lay:.2f} ms, head {h:.2f} ms, head[:16384] {h16:.2f} ms", flush=True)
