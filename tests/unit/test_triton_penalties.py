"""The penalties kernel (kestrel_kernels/triton_penalties.py) against its torch reference
(kestrel_kernels/penalties.py `_penalize`): the rows' counts broadcast over tree nodes, counts per
entry (the tree's path recompute), with and without prompt flags, logits of both signs,
repetition below and above 1, bit for bit. In Triton's interpreter on CPU tensors without
CUDA, compiled with CUDA (tests/gpu/test_penalties_kernel_gpu.py has the full vocabulary)."""
from __future__ import annotations

import pytest
import torch

import triton_interpreter  # before kernels import triton: picks its interpreter without CUDA
from kestrel_kernels import penalties
from kestrel_kernels import triton_penalties as tpk

INTERPRETED, DEV, needs_triton = triton_interpreter.triton_setup(tpk, "_penalize_kernel")

pytestmark = needs_triton


def case(B: int, N: int, V: int, per_entry: bool, prompt: bool, gen: torch.Generator):
    x = torch.randn(B, N, V, generator=gen) * 4  # [B, N, V] float32
    shape = (B, N, V) if per_entry else (B, 1, V)
    count = torch.randint(0, 4, shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.3)
    count = count.float() if per_entry else count.to(torch.int32)  # path counts are float
    in_prompt = torch.rand(shape, generator=gen) < 0.2 if prompt else None
    rep = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.1][:B])
    freq = torch.tensor([0.0, 0.3, -0.5, 1.0, 0.25][:B])
    pres = torch.tensor([0.5, 0.0, 1.5, -0.2, 0.1][:B])
    return x, count, in_prompt, rep, freq, pres


@pytest.mark.parametrize("per_entry", [False, True])
@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize("B,N,V", [(5, 3, 37), (2, 1, 1500)])
def test_kernel_equals_the_reference(B, N, V, per_entry, prompt):
    gen = torch.Generator().manual_seed(B * 1000 + V + 7 * per_entry + 3 * prompt)
    x, count, in_prompt, rep, freq, pres = case(B, N, V, per_entry, prompt, gen)
    ref = penalties._penalize(x, count.float(), in_prompt, rep.view(B, 1, 1), freq.view(B, 1, 1),
                              pres.view(B, 1, 1))
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    out = tpk.penalize_triton(to(x), to(count), to(in_prompt), to(rep), to(freq), to(pres)).cpu()
    assert out.shape == (B, N, V) and out.dtype == torch.float32
    assert torch.equal(out, ref)
    # Entries the penalties leave alone keep their values exactly.
    untouched = (count == 0).expand(B, N, V) & (True if in_prompt is None else ~in_prompt.expand(B, N, V))
    assert torch.equal(out[untouched], x[untouched])
