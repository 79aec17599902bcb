"""The FP8 linear's rescale of a codes-only product (kestrel_kernels/triton_fp8_rescale.py)
against its torch reference (fp8_linear.rescale_product): bit-equal outputs, the same
products in the same order. On CPU in Triton's interpreter, on a GPU compiled."""
from tests.triton_interpreter import triton_setup  # noqa: I001 - before triton is imported
import pytest
import torch

import kestrel_kernels.triton_fp8_rescale as kernels
from kestrel_kernels.fp8_linear import rescale_product
from kestrel_kernels.triton_fp8_rescale import rescale_product_triton

_, DEVICE, pytestmark = triton_setup(kernels, "_rescale_kernel")


def randn(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# N within one block, past one (the last block partial); a bias of the output dtype.
@pytest.mark.parametrize("M,N", [(1, 48), (5, 1000), (3, 2100)])
@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, True), (torch.bfloat16, False),
                                        (torch.float16, True), (torch.float32, True)])
def test_rescale_equals_the_reference(M, N, dtype, bias):
    acc = (randn(M, N, seed=M + N) * 3e4).to(DEVICE)  # [M, N] fp32: sums of code products
    xs = (randn(M, 1, seed=1).abs() * 1e-3 + 1e-6).to(DEVICE)  # [M, 1] fp32
    ws = (randn(N, 1, seed=2).abs() * 1e-4 + 1e-7).to(DEVICE)  # [N, 1] fp32
    b = randn(N, seed=3).to(dtype).to(DEVICE) if bias else None  # [N]
    got = rescale_product_triton(acc, xs, ws, b, dtype)
    want = rescale_product(acc, xs, ws, b, dtype)
    assert got.dtype == dtype and got.shape == (M, N)
    assert torch.equal(got, want)


def test_rows_of_a_strided_product():
    acc = randn(4, 96, seed=4).to(DEVICE)[:, :64]  # a row stride of 96
    xs, ws = torch.ones(4, 1, device=DEVICE) * 0.5, torch.ones(64, 1, device=DEVICE) * 0.25
    assert torch.equal(rescale_product_triton(acc, xs, ws, None, torch.float32), acc * 0.125)


def test_shapes_are_checked():
    acc = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="w_scale"):
        rescale_product_triton(acc, torch.ones(2, 1, device=DEVICE), torch.ones(7, 1, device=DEVICE),
                               None, torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        rescale_product_triton(acc.half(), torch.ones(2, 1, device=DEVICE), torch.ones(8, 1, device=DEVICE),
                               None, torch.bfloat16)
