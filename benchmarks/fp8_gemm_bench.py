"""FP8 GEMM micro-benchmark (GPU): the bf16 linear against torch._scaled_mm on activations
already in FP8, and against the whole FP8 linear (per-token quantization + _scaled_mm, what
model.quantization=fp8 runs: the quantization as one Triton kernel, and as the torch ops of
the reference beside it), at Qwen2.5-7B's and 72B's GEMM shapes and a few batch sizes; beside them cuBLASLt's
fast-accumulation and per-tensor-scaled FP8 GEMMs on the same codes.

Each op is timed as a replayed CUDA graph (triton.testing.do_bench_cudagraph), as decode
steps run when serving, so launch overhead does not hide the kernels.

    PYTHONPATH=. python benchmarks/fp8_gemm_bench.py [--models 7b 72b] [--m 1 8 64 256 512]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kestrel_kernels.fp8_linear import fp8_linear, quantize_rows

# name -> [(GEMM, N, K)]: fused q/k/v, o, fused gate/up, down.
SHAPES = {
    "7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "72b": [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 59136, 8192), ("down", 8192, 29568)],
}


def bench(fn) -> float:
    """Microseconds per call, from a replayed CUDA graph."""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=100) * 1e3


def torch_ops_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The FP8 linear with the reference's torch ops quantizing the activations."""
    xq, xs = quantize_rows(x)  # [M, K] fp8, [M, 1] fp32
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 8, 64, 256, 512])
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print(f"{'model':>5} {'gemm':>8} {'N':>6} {'K':>6} {'M':>4} | {'bf16 us':>8} {'fp8 mm us':>9} "
          f"{'quant+mm us':>11} {'torch quant+mm':>14} | {'mm x':>5} {'linear x':>8} | {'fp8 TFLOP/s':>11} | "
          f"{'fast acc us':>11} {'tensorwise us':>13} {'tw fast us':>10}")
    for model in args.models:
        for gemm, N, K in SHAPES[model]:
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02  # [N, K] bf16
            wq, ws = quantize_rows(w)  # [N, K] fp8, [N, 1] fp32
            for M in args.m:
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)  # [M, K]
                xq, xs = quantize_rows(x)  # [M, K] fp8, [M, 1] fp32
                t_bf16 = bench(lambda: F.linear(x, w))
                t_mm = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                      out_dtype=torch.bfloat16))
                t_lin = bench(lambda: fp8_linear(x, wq, ws))
                t_torch = bench(lambda: torch_ops_linear(x, wq, ws))
                # cuBLASLt's other FP8 kernels on the same codes: fast accumulation (fp32
                # partial sums promoted less often), and one scale per tensor (vLLM's
                # --quantization fp8 of a bf16 checkpoint) with and without it.
                one = torch.ones((), device=dev)  # [] fp32
                t_fast = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                        out_dtype=torch.bfloat16, use_fast_accum=True))
                t_tw = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16))
                t_twf = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                       out_dtype=torch.bfloat16, use_fast_accum=True))
                tflops = 2 * M * N * K / (t_lin * 1e-6) / 1e12
                print(f"{model:>5} {gemm:>8} {N:>6} {K:>6} {M:>4} | {t_bf16:8.1f} {t_mm:9.1f} {t_lin:11.1f} {t_torch:14.1f} | "
                      f"{t_bf16 / t_mm:5.2f} {t_bf16 / t_lin:8.2f} | {tflops:11.1f} | "
                      f"{t_fast:11.1f} {t_tw:13.1f} {t_twf:10.1f}", flush=True)
            del w, wq, ws
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
