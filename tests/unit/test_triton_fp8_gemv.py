"""The fused small-row FP8 linear (kestrel_kernels/triton_fp8_gemv.py) against its torch
reference (fp8_linear.fp8_linear_ref): the same quantization and products, so equal up to
the fp32 summation order. On CPU in Triton's interpreter, on a GPU compiled."""
from tests.triton_interpreter import triton_setup  # noqa: I001 - before triton is imported
import pytest
import torch

import kestrel_kernels.triton_fp8_gemv as kernels
from kestrel_kernels.fp8_linear import FP8, FP8_MAX, fp8_linear_ref
from kestrel_kernels.triton_fp8_gemv import MAX_ROWS, fp8_linear_small_m

_, DEVICE, pytestmark = triton_setup(kernels, "_fp8_small_m_kernel")


def fp8_weight(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantized per output channel: (codes [N, K] E4M3, scale [N, 1] fp32)."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    scale = w.abs().amax(-1, keepdim=True) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


# N 100, 40 and 20 take output blocks of 64, 32 and 16 channels on one CPU "SM"; K 1000 and
# 300 end in a partial block; 16 rows is the most one launch takes.
@pytest.mark.parametrize("M,N,K,bias", [(1, 100, 1000, False), (3, 40, 300, True),
                                        (MAX_ROWS, 20, 1000, True), (2, 64, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_reference(M, N, K, bias, dtype):
    g = torch.Generator().manual_seed(M * N + K)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-2, 1, M).view(M, 1)).to(dtype)
    if M > 2:
        x[2] = 0.0  # an all-zero row: the smallest scale, every product 0
    w, ws = fp8_weight(N, K, seed=K)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    want = fp8_linear_ref(x, w, ws, b)
    got = fp8_linear_small_m(x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE),
                             b.to(DEVICE) if b is not None else None).cpu()
    assert got.dtype == dtype and got.shape == (M, N)
    # Only the order of the fp32 sums differs: one rounding of the output dtype at most.
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_a_row_does_not_depend_on_the_others():
    """A token's output is the same alone and beside other rows (verify and decode agree)."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    w, ws = (t.to(DEVICE) for t in fp8_weight(48, 256, seed=4))
    together = fp8_linear_small_m(x, w, ws)
    for i in range(5):
        assert torch.equal(fp8_linear_small_m(x[i:i + 1], w, ws)[0], together[i])


def test_refuses_more_rows_than_a_launch_takes():
    w, ws = fp8_weight(16, 64, seed=0)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        fp8_linear_small_m(torch.randn(MAX_ROWS + 1, 64).to(DEVICE), w.to(DEVICE), ws.to(DEVICE))
