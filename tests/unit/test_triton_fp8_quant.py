"""The fused FP8 row quantization (kestrel_kernels/triton_fp8_quant.py) against its torch
reference (fp8_linear.quantize_rows): codes and scales bit-equal. On CPU in Triton's
interpreter, on a GPU compiled."""
from tests.triton_interpreter import triton_setup  # noqa: I001 - before triton is imported
import pytest
import torch

import kestrel_kernels.triton_fp8_quant as kernels
from kestrel_kernels.fp8_linear import FP8_MAX, quantize_rows
from kestrel_kernels.triton_fp8_quant import quantize_rows_triton

_, DEVICE, pytestmark = triton_setup(kernels, "_quantize_rows_kernel")


# Rows read at once (up to 32768 values) and, past that, in blocks (the last one partial).
@pytest.mark.parametrize("M,K,dtype", [(1, 64, torch.bfloat16), (5, 1000, torch.bfloat16),
                                       (3, 5000, torch.float32), (2, 256, torch.float16),
                                       (3, 32768, torch.bfloat16), (3, 33000, torch.bfloat16)])
def test_codes_and_scales_equal_the_reference(M, K, dtype):
    g = torch.Generator().manual_seed(M * K)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-3, 2, M).view(M, 1)).to(dtype).to(DEVICE)
    x[0, K // 2] = 0.0
    if M > 2:
        x[2] = 0.0  # an all-zero row: the smallest scale, every code 0
    want_q, want_s = quantize_rows(x)
    got_q, got_s = quantize_rows_triton(x)
    assert got_q.dtype == want_q.dtype and got_s.shape == (M, 1)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    # The largest magnitude of every non-zero row maps to the largest code.
    assert torch.equal(got_q.float().abs().amax(-1)[x.abs().amax(-1) > 0].cpu(),
                       torch.full((int((x.abs().amax(-1) > 0).sum()),), FP8_MAX))


def test_rows_of_a_strided_view():
    x = torch.randn(4, 384, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    rows = x[:, :256]  # a row stride of 384
    want_q, want_s = quantize_rows(rows)
    got_q, got_s = quantize_rows_triton(rows)
    assert torch.equal(got_s, want_s) and torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("num_warps", [1, 4, 16])
def test_any_warp_count_gives_the_same_bits(num_warps):
    x = (torch.randn(3, 3584, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16).to(DEVICE)
    want_q, want_s = quantize_rows(x)
    got_q, got_s = quantize_rows_triton(x, num_warps)
    assert torch.equal(got_s, want_s) and torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_refuses_a_non_contiguous_last_dim():
    with pytest.raises(ValueError, match="contiguous last dim"):
        quantize_rows_triton(torch.randn(8, 4, device=DEVICE).t())


def test_default_warps_many_for_a_few_rows_fewer_for_many():
    from kestrel_kernels.triton_fp8_quant import default_warps
    assert default_warps(1, 4096) == 32 and default_warps(64, 4096) == 32  # a decode step's rows
    assert default_warps(8192, 4096) == 4 and default_warps(8192, 32768) == 32  # prefill's
    assert default_warps(1, 512) == 4 and default_warps(8192, 512) == 1
