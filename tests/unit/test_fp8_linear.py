"""FP8 linear (kestrel_kernels/fp8_linear.py): per-row quantization's error bounds, the fp32
reference against exact arithmetic and against the unquantized product, the CPU dispatch,
torch._scaled_mm (the CUDA path: row-scaled, or tensor-scaled then rescaled) against the
reference where this torch runs it on the CPU, and rows quantized ahead (Fp8Rows) multiplying as the float rows.
tests/gpu/test_fp8_gpu.py checks the CUDA path at model shapes."""
from __future__ import annotations

import pytest
import torch

import kestrel_kernels.fp8_linear as fp8_linear_module
from kestrel_kernels.fp8_linear import (FP8, FP8_MAX, fp8_linear, fp8_linear_ref,
                                        fp8_linear_scaled_mm, fp8_rows, quantize_rows)

# E4M3: 3 mantissa bits, so a normal value rounds within 2^-4 of itself; below 2^-6 (in
# units of the row's scale) the spacing is the subnormals' 2^-9.
REL, SUB = 2.0 ** -4, 2.0 ** -10


def randn(*shape, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_round_trip(dtype):
    x = randn(9, 300, seed=1, dtype=dtype)  # [M, K]
    x[1] *= 1e4  # rows of very different ranges keep their own precision
    x[2] *= 1e-5
    x[3] = 0.0  # an all-zero row: finite scale, zero codes
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (9, 1)
    xf = x.float()
    torch.testing.assert_close(s[[0, 1, 2]], xf.abs().amax(-1, keepdim=True)[[0, 1, 2]] / FP8_MAX,
                               rtol=0, atol=0)
    assert torch.isfinite(s).all() and (s > 0).all() and not q[3].float().any()
    # The largest magnitude of each row lands on E4M3's largest value.
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 2, 4]], torch.full((4,), FP8_MAX))
    err = (q.float() * s - xf).abs()
    assert (err <= torch.maximum(xf.abs() * REL, SUB * s)).all()


def test_quantize_rows_leading_dims():
    x = randn(2, 3, 64, seed=2)  # [B, T, K]
    q, s = quantize_rows(x)
    q2, s2 = quantize_rows(x.view(6, 64))
    assert q.shape == (2, 3, 64) and s.shape == (2, 3, 1)
    assert torch.equal(q.view(6, 64).float(), q2.float()) and torch.equal(s.view(6, 1), s2)


def quantized_weight(N, K, seed):
    w = randn(N, K, seed=seed, scale=0.05)  # [N, K] fp32
    wq, ws = quantize_rows(w)  # [N, K] fp8, [N, 1] fp32
    return w, wq, ws


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,bias", [(1, 48, 64, False), (7, 96, 160, True), (33, 16, 32, True)])
def test_reference_is_the_dequantized_product(M, N, K, bias, dtype):
    x = randn(M, K, seed=M, dtype=dtype)  # [M, K]
    w, wq, ws = quantized_weight(N, K, seed=N)
    b = randn(N, seed=K, dtype=dtype) if bias else None  # [N]
    got = fp8_linear_ref(x, wq, ws, b)
    assert got.dtype == dtype and got.shape == (M, N)
    # Exact arithmetic on the dequantized operands: float64 sums of exact products.
    xq, xs = quantize_rows(x)
    exact = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()
    if bias:
        exact = exact + b.double()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), **tol)
    # And near the unquantized layer: both operands within 2^-4 of themselves per element.
    plain = x.float() @ w.t() + (b.float() if bias else 0)
    assert (got.float() - plain).norm() <= 0.1 * plain.norm()


def test_cpu_dispatch_runs_the_reference():
    x = randn(5, 64, seed=3, dtype=torch.bfloat16)
    _, wq, ws = quantized_weight(32, 64, seed=4)
    b = randn(32, seed=5, dtype=torch.bfloat16)
    assert torch.equal(fp8_linear(x, wq, ws, b), fp8_linear_ref(x, wq, ws, b))
    x3 = x.view(1, 5, 64)  # leading dims pass through
    assert torch.equal(fp8_linear(x3, wq, ws, b).view(5, 32), fp8_linear_ref(x, wq, ws, b))


def test_fp8_rows_give_the_float_rows_product():
    """Rows quantized by the kernel that made them (Fp8Rows) multiply as the float rows."""
    x = randn(5, 64, seed=3, dtype=torch.bfloat16).view(1, 5, 64)  # [1, T, K]
    _, wq, ws = quantized_weight(32, 64, seed=4)
    b = randn(32, seed=5, dtype=torch.bfloat16)
    rows = fp8_rows(x)
    assert rows.shape == x.shape and rows.dtype == x.dtype and not rows.is_cuda
    got = fp8_linear(rows, wq, ws, b)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 5, 32)
    assert torch.equal(got, fp8_linear(x, wq, ws, b))
    assert torch.equal(fp8_linear_ref(rows, wq, ws), fp8_linear_ref(x, wq, ws))
    with pytest.raises(ValueError, match=r"\[N, 48\]"):
        fp8_linear_ref(fp8_rows(x[..., :48]), wq, ws)


def test_shapes_and_dtypes_are_checked():
    x = randn(2, 64, seed=6)
    _, wq, ws = quantized_weight(32, 64, seed=7)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_linear_ref(x, wq, ws.view(-1))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear_ref(x, wq.float(), ws)
    with pytest.raises(ValueError, match=r"\[N, 48\]"):
        fp8_linear_ref(randn(2, 48, seed=8), wq, ws)


def _cpu_scaled_mm() -> bool:
    try:
        a = torch.zeros(16, 16, dtype=FP8)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU torch._scaled_mm with row-wise scales")
@pytest.mark.parametrize("M,bias", [(1, False), (7, True), (64, True)])
@pytest.mark.parametrize("path", ["tensorwise", "too big", "with a draft"])
def test_scaled_mm_layout_equals_the_reference(M, bias, path, monkeypatch):
    """The CUDA path's calls (operand layout, scale shapes, bias) on torch's CPU kernel: the
    tensor-scaled GEMM then the rescale for a small product, else the row-scaled GEMM,
    which every row takes where a draft runs."""
    scales = []  # scale_a's shape of each _scaled_mm call: [] tensor-scaled, [M, 1] row-scaled
    real = torch._scaled_mm

    def spy(*args, **kw):
        scales.append(tuple(kw["scale_a"].shape))
        return real(*args, **kw)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    if path == "too big":
        monkeypatch.setattr(fp8_linear_module, "TENSORWISE_MAX_PRODUCT", M * 48 - 1)
    # As a rank worker leaves it (any engine built earlier in this process set it), restored
    # after the test.
    monkeypatch.setattr(fp8_linear_module, "_tensorwise", True)
    if path == "with a draft":
        fp8_linear_module.set_tensorwise(False)
    x = randn(M, 96, seed=M, dtype=torch.bfloat16)  # [M, K]
    _, wq, ws = quantized_weight(48, 96, seed=9)
    b = randn(48, seed=10, dtype=torch.bfloat16) if bias else None
    got = fp8_linear_scaled_mm(x, wq, ws, b)
    torch.testing.assert_close(got, fp8_linear_ref(x, wq, ws, b), rtol=2 ** -7, atol=1e-3)
    assert torch.equal(fp8_linear_scaled_mm(fp8_rows(x), wq, ws, b), got)
    assert scales == [() if path == "tensorwise" else (M, 1)] * 2
