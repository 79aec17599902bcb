"""ms of the Q8_0 LM head (SmolLM2's tied embedding, 49152 x 576, random weights) at 8 and 32
rows, 2 threads, best of 7: the part of a plain step the Q4_1 kernel's instruction set leaves.
    PYTHONPATH=. python docs/runs/2026-12-05-cpu-vnni/lm_head_q8.py"""
import time, torch
torch.set_num_threads(2)
from kestrel_kernels.cpu_q4 import quantize_q8_0, q8_0_linear
w = quantize_q8_0(torch.randn(49152, 576) * 0.05)
for M in (8, 32):
    x = torch.randn(M, 576)
    q8_0_linear(x, w); best = 1e9
    for _ in range(7):
        t = time.perf_counter(); q8_0_linear(x, w); best = min(best, time.perf_counter() - t)
    print(f"M={M}: LM head {best * 1e3:.1f} ms", flush=True)
