"""The grammar mask kernel compiled on the GPU at serving size (64 rows of 8-node trees x
SmolLM2's 49152 ids, a tokenizer-wide mask of 1536 words and a wider graph buffer of
words): the torch reference's logits exactly, in place; captured in a CUDA graph and
replayed on new logits and new masks. tests/unit/test_triton_token_bitmask.py has the
small cases in the interpreter."""
from __future__ import annotations

import pytest
import torch

# Imported first: on a CPU-only machine the unit module switches on Triton's interpreter
# before anything imports triton.
from unit.test_triton_token_bitmask import words  # isort: skip

from kestrel_kernels import triton_token_bitmask as tbk  # noqa: E402
from kestrel_kernels.token_bitmask import mask_logits_, mask_logits_torch_  # noqa: E402
from kestrel_testing import require_compiled_triton  # noqa: E402

B, N, V, W = 64, 8, 49152, 1536


@pytest.fixture(autouse=True)
def _compiled():
    require_compiled_triton(tbk, "_mask_logits_kernel")


@pytest.mark.parametrize("width", [W, W + 16])  # the graph's buffer may be wider than the mask
def test_kernel_at_serving_size_and_in_a_graph(width):
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(B, N, V, generator=gen)  # [B, N, V] float32
    bitmask = torch.zeros(B, N, width, dtype=torch.int32)
    bitmask[..., :W] = words(B * N, W, gen).view(B, N, W)
    want = mask_logits_torch_(logits.clone(), bitmask)
    got = logits.cuda()
    assert mask_logits_(got, bitmask.cuda()) is got
    assert torch.equal(got.cpu(), want)
    static_logits, static_masks = logits.cuda(), bitmask.cuda()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mask_logits_(static_logits, static_masks)
    new_logits = torch.randn(B, N, V, generator=gen)
    new_masks = torch.zeros_like(bitmask)
    new_masks[..., :W] = words(B * N, W, gen).view(B, N, W)
    static_logits.copy_(new_logits.cuda())
    static_masks.copy_(new_masks.cuda())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_logits.cpu(), mask_logits_torch_(new_logits, new_masks))
