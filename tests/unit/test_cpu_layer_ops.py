"""The CPU layer kernels (kestrel_kernels/cpu_layer_ops.cpp) against their torch references,
and a row's result independent of the other rows."""
import pytest
import torch

from kestrel_kernels import activation, cpu_build, cpu_layer_ops
from kestrel_kernels import rmsnorm as rmsnorm_ref
from kestrel_kernels import rope as rope_ref

pytestmark = pytest.mark.skipif(cpu_build.unavailable_reason() is not None,
                                reason=f"the CPU kernels: {cpu_build.unavailable_reason()}")


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_equals_reference(with_residual):
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(5, 576, generator=g) * 3, torch.randn(5, 576, generator=g)
    w = torch.randn(576, generator=g)
    normed, total = cpu_layer_ops.add_rmsnorm(x, res if with_residual else None, w, 1e-5)
    if with_residual:
        ref, ref_total = rmsnorm_ref.fused_add_rmsnorm(x, res, w, 1e-5)
        assert torch.equal(total, ref_total)  # one float32 add either way
    else:
        ref = rmsnorm_ref.rmsnorm(x, w, 1e-5)
        assert torch.equal(total, x)
    assert torch.allclose(normed, ref, rtol=1e-5, atol=1e-6)
    # each row alone gives the same bits
    for i in range(5):
        alone = cpu_layer_ops.add_rmsnorm(x[i:i + 1], res[i:i + 1] if with_residual else None, w, 1e-5)[0]
        assert torch.equal(alone[0], normed[i])


def test_rope_equals_reference_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 15 * 64, generator=g)  # q, k and v heads side by side, as qkv_proj gives them
    q = qkv[:, :9 * 64].view(7, 9, 64)  # a view with the wider rows
    cos, sin = rope_ref.cos_sin(torch.arange(100, 107), 1 / 10000 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.equal(cpu_layer_ops.rope(q, cos, sin), rope_ref.apply_rotary(q, cos, sin))


def test_silu_and_mul_equals_reference():
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(4, 2 * 1536, generator=g) * 4
    out = cpu_layer_ops.silu_and_mul(gate_up)
    ref = activation.silu_and_mul(gate_up[:, :1536], gate_up[:, 1536:])
    assert out.shape == (4, 1536) and torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(cpu_layer_ops.silu_and_mul(gate_up[2:3])[0], out[2])
