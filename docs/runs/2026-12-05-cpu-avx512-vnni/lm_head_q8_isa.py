"""ms of the Q8_0 LM head (SmolLM2's tied embedding, 49152 x 576, random weights) at 1-32 rows,
2 threads, best of 7, on the kernels' VNNI path (auto) and on AVX2, rounds alternating.
    PYTHONPATH=. python docs/runs/2026-12-05-cpu-avx512-vnni/lm_head_q8_isa.py"""
import time, torch
torch.set_num_threads(2)
from kestrel_kernels.cpu_q4 import isa, quantize_q8_0, q8_0_linear, set_isa
w = quantize_q8_0(torch.randn(49152, 576) * 0.05)
for rnd in range(2):
    for name in ("auto", "avx2"):
        set_isa(name)
        row = []
        for M in (1, 4, 8, 32):
            x = torch.randn(M, 576)
            q8_0_linear(x, w); best = 1e9
            for _ in range(7):
                t = time.perf_counter(); q8_0_linear(x, w); best = min(best, time.perf_counter() - t)
            row.append(f"M={M} {best * 1e3:.2f}")
        print(f"round {rnd} {isa():>10}: " + ", ".join(row) + " ms", flush=True)
