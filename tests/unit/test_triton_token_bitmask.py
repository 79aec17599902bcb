"""The grammar mask kernel (kestrel_kernels/triton_token_bitmask.py) against its torch reference
(kestrel_kernels/token_bitmask.py `mask_logits_torch_`): random words, a mask narrower than the
vocabulary (the ids past it disallowed) and one wider, rows at a stride, exactly. In
Triton's interpreter on CPU tensors without CUDA, compiled with CUDA
(tests/gpu/test_token_bitmask_kernel_gpu.py has the serving size and a CUDA graph)."""
from __future__ import annotations

import pytest
import torch

import triton_interpreter  # before kernels import triton: picks its interpreter without CUDA
from kestrel_kernels import triton_token_bitmask as tbk
from kestrel_kernels.token_bitmask import mask_logits_torch_

INTERPRETED, DEV, needs_triton = triton_interpreter.triton_setup(tbk, "_mask_logits_kernel")

pytestmark = needs_triton


def words(R: int, W: int, gen: torch.Generator) -> torch.Tensor:
    """[R, W] int32 random bitmask words, with an all-allowed and an all-banned word in."""
    m = torch.randint(-2 ** 31, 2 ** 31 - 1, (R, W), dtype=torch.int32, generator=gen)
    m[0, 0], m[-1, -1] = -1, 0
    return m


@pytest.mark.parametrize("R,V,W", [(5, 37, 2), (3, 100, 3), (3, 100, 5), (2, 1500, 47)])
def test_kernel_equals_the_reference(R, V, W):
    gen = torch.Generator().manual_seed(R * 1000 + V + W)
    logits = torch.randn(R, V, generator=gen)  # [R, V] float32
    bitmask = words(R, W, gen)
    want = mask_logits_torch_(logits.clone(), bitmask)
    got = logits.to(DEV)
    out = tbk.mask_logits_triton_(got, bitmask.to(DEV))
    assert out is got  # in place
    assert torch.equal(got.cpu(), want)
    if 32 * W < V:  # the ids past the mask are banned whatever its words say
        assert torch.isinf(got.cpu()[:, 32 * W:]).all()


def test_rows_at_a_stride_leave_the_rest_of_the_buffer_alone():
    gen = torch.Generator().manual_seed(3)
    R, V, W = 4, 70, 3
    buffer = torch.randn(R, V + 9, generator=gen)  # rows of V logits, then 9 other values each
    bitmask = words(R, W, gen)
    want = buffer.clone()
    mask_logits_torch_(want[:, :V], bitmask)
    got = buffer.to(DEV)
    tbk.mask_logits_triton_(got[:, :V], bitmask.to(DEV))
    assert torch.equal(got.cpu(), want)
