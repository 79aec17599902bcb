"""FP8 GEMM micro-benchmark (GPU): the bf16 linear against torch._scaled_mm on activations
already in FP8, and against the whole FP8 linear (per-token quantization and the product,
what model.quantization=fp8 runs: the quantization as one Triton kernel, then the row-scaled
_scaled_mm or the tensor-scaled one and the rescale kernel, whichever fp8_linear takes at
that shape; beside it the row-scaled linear at every shape, and the reference's torch ops), at Qwen2.5-7B's and 72B's GEMM shapes and a few batch sizes;
beside them cuBLASLt's fast-accumulation and per-tensor-scaled FP8 GEMMs on the same codes.

Each op is timed as a replayed CUDA graph (triton.testing.do_bench_cudagraph), as decode
steps run when serving, so launch overhead does not hide the kernels.

    PYTHONPATH=. python benchmarks/fp8_gemm_bench.py [--models 7b 72b] [--m 1 8 64 256 512]

--gemv instead sweeps the Triton FP8 GEMV (kestrel_kernels/triton_gemv.py) over a few
launch configs at 1, 8 and 16 rows, or any up to 16 (pre-quantized rows, beside _scaled_mm
on the same codes):
µs and TB/s of FP8 weight bytes per config, the best per shape, and per config the sum over
each model's four GEMMs, which picks default_config's tile (about 1-2 minutes on an H200,
compiles included):

    PYTHONPATH=. python benchmarks/fp8_gemm_bench.py --gemv [--models 7b 72b] [--m 1 8 16]

With --weights bf16 the same sweep runs the kernels on bf16 weights (`gemv`) beside
F.linear (cuBLAS), the bf16 model's decode GEMMs:

    PYTHONPATH=. python benchmarks/fp8_gemm_bench.py --gemv --weights bf16 --models 7b

--quant times the row quantization that precedes every FP8 GEMM, at each GEMM's input
width, and checks its bits against the torch reference:

    PYTHONPATH=. python benchmarks/fp8_gemm_bench.py --quant [--m 1 64]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from kestrel_kernels.fp8_linear import fp8_linear, quantize_rows
from kestrel_kernels.triton_gemv import MAX_ROWS, fp8_gemv, gemv
from kestrel_kernels.triton_fp8_quant import quantize_rows_triton

# name -> [(GEMM, N, K)]: fused q/k/v, o, fused gate/up, down.
SHAPES = {
    "7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "72b": [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 59136, 8192), ("down", 8192, 29568)],
}


def bench(fn, rep: int = 100) -> float:
    """Microseconds per call, from a replayed CUDA graph (`rep` ms of calls)."""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=rep) * 1e3


def row_scaled_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The FP8 linear as one row-scaled GEMM at any shape (the rows quantized by the Triton
    kernel): what fp8_linear runs where the tensor-scaled GEMM does not pay."""
    xq, xs = quantize_rows_triton(x)  # [M, K] fp8, [M, 1] fp32
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)


def torch_ops_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The FP8 linear with the reference's torch ops quantizing the activations."""
    xq, xs = quantize_rows(x)  # [M, K] fp8, [M, 1] fp32
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)


# The GEMV sweep: name -> config overrides ({}: default_config's). Without split_k, K is
# split by default_config's rule for that tile; "nosplit" variants show what splitting buys.
GEMV_CONFIGS = {
    "default": {},  # the tensor-core kernel, 32 channels by 256 of K
    "gemv_n8k512": dict(mma=False, block_n=8, block_k=512),  # the unrolled GEMV
    "n4k512": dict(mma=False, block_n=4, block_k=512),
    "n16k512": dict(mma=False, block_n=16, block_k=512),
    "n16k512w8": dict(mma=False, block_n=16, block_k=512, num_warps=8),
    "n8k1024": dict(mma=False, block_n=8, block_k=1024),
    "n32k256": dict(mma=False, block_n=32, block_k=256),
    "n8k256w2s4": dict(mma=False, block_n=8, block_k=256, num_warps=2, num_stages=4),
    "n8k512s5": dict(mma=False, block_n=8, block_k=512, num_stages=5),
    "mma_nosplit": dict(split_k=1),
    # The tensor-core kernel: 16 rows padded, tl.dot on fp16-widened tiles.
    "mma_n64k128": dict(mma=True, block_n=64, block_k=128),
    "mma_n128k128": dict(mma=True, block_n=128, block_k=128),
    "mma_n64k256w8": dict(mma=True, block_n=64, block_k=256, num_warps=8),
    "mma_n16k512": dict(mma=True, block_n=16, block_k=512),
    "mma_n64k128s5": dict(mma=True, block_n=64, block_k=128, num_stages=5),
    "mma_n64": dict(mma=True, block_n=64),
    "mma_k128": dict(mma=True, block_k=128),
    "mma_w8": dict(mma=True, num_warps=8),
    # Counted in values: for bf16 weights k64 is a 128-byte tile and k256 a 512-byte one.
    "mma_k64": dict(mma=True, block_k=64),
    "mma_k256": dict(mma=True, block_k=256),
    "mma_n16": dict(mma=True, block_n=16),
    "mma_s4": dict(mma=True, num_stages=4),
    # The splits of K added up by each tile's last split instead of a second launch.
    "last": dict(reduce="last"),
    "last_k256": dict(mma=True, block_k=256, reduce="last"),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=None,
                    help="rows (default 1 8 64 256 512; with --gemv 1 8 16)")
    ap.add_argument("--gemv", action="store_true", help="sweep the Triton FP8 GEMV's configs")
    ap.add_argument("--quant", action="store_true",
                    help="time the row quantization (Triton) at each GEMM's input and check its bits")
    ap.add_argument("--weights", choices=["fp8", "bf16"], default="fp8",
                    help="with --gemv: FP8 weights beside _scaled_mm, or bf16 beside F.linear")
    ap.add_argument("--configs", nargs="+", default=None, choices=list(GEMV_CONFIGS),
                    help="with --gemv: these configs only (default all)")
    args = ap.parse_args(argv)
    if args.m is None:
        args.m = [1, 8, 16] if args.gemv else [1, 8, 64, 256, 512]
    if args.gemv and not all(1 <= m <= MAX_ROWS for m in args.m):
        ap.error(f"--gemv takes 1..{MAX_ROWS} rows")
    return args


def gemv_sweep(args: argparse.Namespace, dev: torch.device) -> None:
    """Each config at each shape and row count: µs and TB/s of weight bytes; a config that
    fails (compile, resources) prints why and the sweep goes on."""
    names = args.configs or list(GEMV_CONFIGS)
    totals: dict[tuple[str, str, int], float] = {}  # (model, config, M) -> µs over its GEMMs
    fp8 = args.weights == "fp8"
    base = "scaled_mm" if fp8 else "F.linear"
    print(f"{'model':>5} {'gemm':>8} {'N':>6} {'K':>6} {'M':>3} | {base:>15} | "
          + " | ".join(f"{n:>15}" for n in names) + " | best")
    print(" " * 33 + "| " + " | ".join(f"{'us':>7} {'TB/s':>7}" for _ in ["mm"] + names))
    for model in args.models:
        for gemm, N, K in SHAPES[model]:
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02  # [N, K] bf16
            wq, ws = quantize_rows(w) if fp8 else (w, None)  # [N, K] fp8 and [N, 1] fp32, or bf16
            del w
            # A decode step reads each layer's weight once: the timed calls cycle through
            # copies of it, 256 MB in all, so that the 7B shapes (16-70 MB) are not served
            # from the 50 MB L2 as one weight re-read would be. Captured in the graph.
            nbytes = wq.numel() * wq.element_size()
            copies = [wq] + [wq.clone() for _ in range(min(15, -(-(256 << 20) // nbytes) - 1))]
            turn = itertools.count()

            def weight() -> torch.Tensor:
                return copies[next(turn) % len(copies)]  # [N, K] fp8

            for M in args.m:
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)  # [M, K]
                if fp8:
                    xq, xs = quantize_rows(x)  # [M, K] fp8, [M, 1] fp32

                    def baseline(w):
                        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                out_dtype=torch.bfloat16)  # [M, N]

                    def kernel(w, cfg):
                        return fp8_gemv(xq, xs, w, ws, None, torch.bfloat16, **cfg)
                else:
                    def baseline(w):
                        return F.linear(x, w)  # [M, N] bf16

                    def kernel(w, cfg):
                        return gemv(x, w, None, **cfg)
                want = baseline(wq)
                cells = []
                t_mm = bench(lambda: baseline(weight()), rep=10)
                cells.append(f"{t_mm:7.1f} {nbytes / t_mm / 1e6:7.2f}")
                best = (base, t_mm)
                for name in names:
                    cfg = GEMV_CONFIGS[name]
                    try:
                        got = kernel(wq, cfg)
                        err = (got.float() - want.float()).abs().max().item()
                        if err > 2 ** -6 * want.float().abs().max().item():
                            raise RuntimeError(f"wrong: max error {err:.3g}")
                        t = bench(lambda cfg=cfg: kernel(weight(), cfg), rep=10)
                    except Exception as e:  # one config's failure must not end the sweep
                        print(f"  {name} at {gemm} M={M}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                              flush=True)
                        cells.append(f"{'fail':>15}")
                        totals[(model, name, M)] = float("inf")
                        continue
                    cells.append(f"{t:7.1f} {nbytes / t / 1e6:7.2f}")
                    totals[(model, name, M)] = totals.get((model, name, M), 0.0) + t
                    if t < best[1]:
                        best = (name, t)
                print(f"{model:>5} {gemm:>8} {N:>6} {K:>6} {M:>3} | " + " | ".join(cells)
                      + f" | {best[0]} {best[1]:.1f} us {nbytes / best[1] / 1e6:.2f} TB/s", flush=True)
            del wq, ws, copies
            torch.cuda.empty_cache()
    print("\nPer config, µs over each model's four GEMMs (a decoder layer's linears), by rows:")
    for model in args.models:
        for M in args.m:
            ranked = sorted(names, key=lambda n: totals.get((model, n, M), float("inf")))
            print(f"{model:>5} M={M:>2}: " + ", ".join(f"{n} {totals.get((model, n, M), float('inf')):.1f}"
                                                      for n in ranked))


QUANT_WARPS = (None, 4, 8, 16, 32)  # None: the kernel's default (triton_fp8_quant.default_warps)


def quant_timings(args: argparse.Namespace, dev: torch.device) -> None:
    """The row quantization before each FP8 GEMM (Triton) at each GEMM's input width: µs a
    call by num_warps (the default first) and whether every run's codes and scales are the
    reference's bits."""
    print(f"{'model':>5} {'input of':>8} {'K':>6} {'M':>4} | "
          + " | ".join(f"{'us w' + str(w or 'dflt'):>8}" for w in QUANT_WARPS) + " | same bits")
    for model in args.models:
        for gemm, _, K in SHAPES[model]:
            for M in args.m:
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16) * 3  # [M, K]
                rq, rs = quantize_rows(x)
                same, cells = True, []
                for w in QUANT_WARPS:
                    q, s = quantize_rows_triton(x, w)
                    same &= torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
                    cells.append(f"{bench(lambda w=w: quantize_rows_triton(x, w), rep=20):8.2f}")
                print(f"{model:>5} {gemm:>8} {K:>6} {M:>4} | " + " | ".join(cells) + f" | {same}", flush=True)


def main() -> None:
    args = parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    if args.gemv:
        gemv_sweep(args, dev)
        return
    if args.quant:
        quant_timings(args, dev)
        return
    print(f"{'model':>5} {'gemm':>8} {'N':>6} {'K':>6} {'M':>4} | {'bf16 us':>8} {'fp8 mm us':>9} "
          f"{'linear us':>11} {'row-scaled':>11} {'torch quant+mm':>14} | {'mm x':>5} {'linear x':>8} | {'fp8 TFLOP/s':>11} | "
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
                t_rowlin = bench(lambda: row_scaled_linear(x, wq, ws))
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
                print(f"{model:>5} {gemm:>8} {N:>6} {K:>6} {M:>4} | {t_bf16:8.1f} {t_mm:9.1f} {t_lin:11.1f} "
                      f"{t_rowlin:11.1f} {t_torch:14.1f} | "
                      f"{t_bf16 / t_mm:5.2f} {t_bf16 / t_lin:8.2f} | {tflops:11.1f} | "
                      f"{t_fast:11.1f} {t_tw:13.1f} {t_twf:10.1f}", flush=True)
            del w, wq, ws
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
