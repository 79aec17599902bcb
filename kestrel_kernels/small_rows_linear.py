"""A linear layer at a few rows, where the library GEMM reads the weight below its speed.

On the CPU, float32 at 2..MAX_ROWS rows, computed as weight @ x^T. A speculative
iteration's verify and draft extend multiply N (4 in the CPU preset) rows by each weight,
where a plain decode step multiplies one. On a 2-core AMD EPYC (AVX2, torch's MKL build)
F.linear ran 2 to 4 rows 1.6-3.5x slower than weight @ x^T, which reads the weight the same
way as the one-row path (docs/benchmarks.md, "The CPU step"), so a verify step cost three
decode steps and speculation lost to plain decoding. Whether a machine gains is measured at
start-up (`measure`), not assumed.

On CUDA, 16-bit weights at 1..set_gpu_max_rows rows (model.gemv_max_rows): the Triton GEMV
of triton_gemv.py, which reads each weight once for all rows, nearer the bandwidth than
cuBLAS's few-row kernels (docs/benchmarks.md, "Few-row GEMVs").

Elsewhere the reference, F.linear.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from kestrel_kernels.triton_available import use_triton
from kestrel_kernels.triton_gemv import MAX_ROWS as GPU_MAX_ROWS
from kestrel_kernels.triton_gemv import gemv

MAX_ROWS = 4  # past 4 rows F.linear was as fast or faster on the machine measured
_enabled = False
_gpu_max_rows = 0  # CUDA rows at or below it take the Triton GEMV; 0: never


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def set_gpu_max_rows(rows: int) -> None:
    """model.gemv_max_rows (set by each rank worker at start-up): on CUDA, 16-bit linear
    layers at 1..rows rows take the Triton GEMV instead of F.linear; 0 turns it off."""
    global _gpu_max_rows
    if not 0 <= rows <= GPU_MAX_ROWS:
        raise ValueError(f"gemv_max_rows must be within 0..{GPU_MAX_ROWS}, got {rows}")
    _gpu_max_rows = rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., K], weight [N, K] -> [..., N]; on the CPU in
    float32 at 2..MAX_ROWS rows, when enabled, as weight @ x^T; on CUDA in 16 bits at
    1..set_gpu_max_rows rows by the Triton GEMV."""
    rows = x.numel() // max(1, x.shape[-1])
    if 0 < rows <= _gpu_max_rows and x.dtype in (torch.bfloat16, torch.float16) \
            and weight.dtype == x.dtype and weight.stride(-1) == 1 and use_triton(x):
        x2 = x.reshape(rows, x.shape[-1])
        out = gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, bias)  # [rows, N]
        return out.view(*x.shape[:-1], weight.shape[0])
    if not (_enabled and 2 <= rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32):
        return F.linear(x, weight, bias)
    out = _transposed(x.reshape(rows, x.shape[-1]), weight)  # [rows, N] float32
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T as (weight @ x^T)^T -> [M, N], contiguous."""
    return torch.matmul(weight, x.t()).t().contiguous()


class SmallRowsLinear(nn.Linear):
    """nn.Linear whose forward is `linear` (the models' float projections)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: torch's own linear layer."""
    return F.linear(x, weight, bias)


def measure(weight: torch.Tensor, rows: int = MAX_ROWS, repeats: int = 30) -> tuple[float, float]:
    """Seconds per call of F.linear and of weight @ x^T at `rows` rows of this weight [N, K]
    (best of `repeats`), on its device and dtype."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)  # [rows, K]

    def best(f) -> float:
        f()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(lambda: F.linear(x, weight)), best(lambda: _transposed(x, weight))
