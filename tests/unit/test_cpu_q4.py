"""The block kernels (kestrel_kernels/cpu_q4.cpp) against their torch references: the
activations' int8 codes bit for bit, the products to float32 rounding, each row's result
independent of the other rows of the call, and GGUF blocks packed back exactly. The Q4_1
kernel's tests run on its VNNI (AVX-VNNI or AVX512-VNNI) and AVX2 paths (the q4_isa fixture), which give the same
bits."""
import numpy as np
import pytest
import torch

from kestrel_kernels import cpu_build
from kestrel_kernels.cpu_q4 import (BLOCK, Q4_1Weights, isa, q4_1_linear, q4_1_linear_ref, q8_0_linear,
                                    q8_0_linear_ref, quantize_activations_ref, quantize_q4_1, quantize_q8_0,
                                    set_isa)
from kestrel_testing import q4_kernel_on

pytestmark = pytest.mark.skipif(cpu_build.unavailable_reason() is not None,
                                reason=f"the block kernels: {cpu_build.unavailable_reason()}")


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 rounding of sums of |x| |w| products: a few ulps of the absolute sum."""
    return 4e-6 * (x.abs() @ w.abs().T) + 1e-6


# The kernels' pieces of a row: 9 blocks = 8 + 1, 7 = 4 + 2 + 1; 18 = 8 + 8 + 2 and 48:
# SmolLM2's; 36 = 4 * 8 + 4: the draft head's fc.
@pytest.mark.parametrize("rows,blocks", [(1, 9), (3, 9), (4, 18), (5, 48), (9, 2), (8, 7), (2, 36)])
def test_q4_1_kernel_equals_reference(q4_isa, rows, blocks):
    g = torch.Generator().manual_seed(rows * 100 + blocks)
    w = quantize_q4_1(torch.randn(67, blocks * BLOCK, generator=g))
    x = torch.randn(rows, blocks * BLOCK, generator=g)
    out, ref = q4_1_linear(x, w), q4_1_linear_ref(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, 67)
    assert ((out - ref).abs() <= _bound(x, w.dequantize())).all()
    # the int8 activations stay close to the float product
    exact = x @ w.dequantize().T
    assert ((out - exact).abs() <= 0.02 * (x.abs() @ w.dequantize().abs().T)).all()


@pytest.mark.parametrize("rows,blocks,limit", [(1, 18, None), (4, 9, 50), (6, 3, 7), (8, 7, None), (3, 36, 99)])
def test_q8_0_kernel_equals_reference(rows, blocks, limit):
    g = torch.Generator().manual_seed(rows * 10 + blocks)
    w = quantize_q8_0(torch.randn(120, blocks * BLOCK, generator=g))
    x = torch.randn(rows, blocks * BLOCK, generator=g)
    out, ref = q8_0_linear(x, w, limit), q8_0_linear_ref(x, w, limit)
    assert out.shape == (rows, limit or 120)
    assert ((out - ref).abs() <= _bound(x, w.dequantize()[:limit])).all()


def test_activation_codes_equal_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4 * BLOCK, generator=g) * torch.tensor([1e-3, 1.0, 30.0])[:, None]
    x[0, :BLOCK] = 0  # an all-zero block: scale 0, codes 0
    x[1, BLOCK] = 127 / 8  # amax: the codes are x * 8 exactly ...
    x[1, BLOCK + 1:2 * BLOCK] = (torch.arange(BLOCK - 1) - 15 + 0.5) / 8  # ... and these ties, to even
    q, s, qs = cpu_build.kernels().quantize_activations(x)
    rq, rs, rqs = quantize_activations_ref(x)
    assert torch.equal(q.float(), rq.reshape(3, -1)) and torch.equal(s, rs) and torch.equal(qs, rqs)
    assert q.abs().max() <= 127 and (q[0, :BLOCK] == 0).all() and s[0, 0] == 0
    assert q[1, BLOCK + 1:BLOCK + 5].tolist() == [-14, -14, -12, -12]  # -14.5, -13.5, -12.5, -11.5


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_rows_result_does_not_depend_on_the_other_rows(q4_isa, kind):
    """Batch invariance: row i alone and row i among 3, 4, 8 or 9 rows (different tiles of
    the kernel, different neighbours) give the same bits: what makes a verify of several
    rows and a one-row decode step agree."""
    g = torch.Generator().manual_seed(2)
    K = 18 * BLOCK
    quant, fn = (quantize_q4_1, q4_1_linear) if kind == "q4_1" else (quantize_q8_0, q8_0_linear)
    w = quant(torch.randn(200, K, generator=g))
    x = torch.randn(9, K, generator=g)
    alone = torch.cat([fn(x[i:i + 1], w) for i in range(9)])
    for m in (3, 4, 8, 9):
        others = torch.randn(m, K, generator=g) * 3
        for i in range(9):
            j = i % m
            others[j] = x[i]
            assert torch.equal(fn(others, w)[j], alone[i]), (m, i)


# Rows from one up to past a tile (4); SmolLM2's 18 and 48 blocks, and 7 = 4 + 2 + 1 and
# 9 = 8 + 1 for every piece size.
@pytest.mark.parametrize("rows", [1, 3, 8, 32, 64])
def test_q4_1_avx_vnni_equals_avx2_bit_for_bit(avx_vnni, rows):
    g = torch.Generator().manual_seed(rows)
    for blocks in (18, 48, 7, 9):
        w = quantize_q4_1(torch.randn(70, blocks * BLOCK, generator=g))
        x = torch.randn(rows, blocks * BLOCK, generator=g) * torch.logspace(-3, 2, rows)[:, None]
        assert isa() in ("avxvnni", "avx512vnni")
        vnni = q4_1_linear(x, w)
        with q4_kernel_on("avx2"):
            assert isa() == "avx2"
            avx2 = q4_1_linear(x, w)
        assert torch.equal(vnni, avx2), blocks


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_q8_0_vnni_equals_avx2_bit_for_bit(avx_vnni, rows):
    g = torch.Generator().manual_seed(100 + rows)
    for blocks in (18, 48, 7, 9):
        w = quantize_q8_0(torch.randn(70, blocks * BLOCK, generator=g))
        x = torch.randn(rows, blocks * BLOCK, generator=g) * torch.logspace(-3, 2, rows)[:, None]
        vnni = q8_0_linear(x, w, 50)
        with q4_kernel_on("avx2"):
            avx2 = q8_0_linear(x, w, 50)
        assert torch.equal(vnni, avx2), blocks


def test_q8_0_largest_products_do_not_saturate(q4_isa):
    """Codes +-127 against activation codes +-127: AVX2's maddubs pair sums reach
    2 * 127 * 127, short of int16 saturation, so every path gives the exact integers."""
    K, N = 9 * BLOCK, 2
    w = quantize_q8_0(torch.ones(N, K))  # codes 127, d = 1 / 127
    w.codes[1] = -127
    x = torch.full((2, K), 127.0)  # [2, K]: codes 127 with s = 1, then -127
    x[1] = -127
    out = q8_0_linear(x, w)
    assert torch.equal(out, q8_0_linear_ref(x, w))


def test_q4_1_largest_products_do_not_saturate(q4_isa):
    """Codes 15 against activation codes +-127 in every input: AVX2's int16 sums reach
    8 * 2 * 15 * 127 in an 8-block piece, short of maddubs' saturation, so both paths give
    the reference's exact integers."""
    K, N = 9 * BLOCK, 3  # pieces of 8 and 1 blocks
    L = quantize_q4_1(torch.zeros(N, K)).layout
    codes = torch.full((N, K // 2), 0xFF, dtype=torch.uint8)  # [N, K/2]: every code 15
    dm = torch.zeros(N, L.slots // 8, 2, 8, dtype=torch.float16)  # [N, P, 2, 8]: d = 1, m = 0
    dm[:, :, 0] = 1
    w = Q4_1Weights(codes, dm)
    x = torch.full((2, K), 127.0)  # [2, K]: codes 127 with s = 1, then -127
    x[1] = -127
    out = q4_1_linear(x, w)  # sums below 2^24: exact in float32
    assert torch.equal(out, q4_1_linear_ref(x, w))
    assert out[:, 0].tolist() == [K * 15 * 127, -K * 15 * 127]


def test_the_q4_1_kernels_isa_is_chosen_once_and_can_be_forced():
    with q4_kernel_on("avx2"):
        assert isa() == "avx2"
    assert isa() in ("avxvnni", "avx512vnni", "avx2")  # auto: whichever this CPU runs
    with pytest.raises(RuntimeError, match="avx2 or auto"):
        set_isa("avx512")


def test_gguf_blocks_pack_back_exactly():
    """Weights dequantized from Q4_1 and Q8_0 blocks (llama.cpp's formats, via gguf-py) pack
    back into the same codes and scales: the kernels compute with the file's weights."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((48, 8 * BLOCK)).astype(np.float32) * 0.05
    for kind, pack in ((T.Q4_1, quantize_q4_1), (T.Q8_0, quantize_q8_0)):
        raw = quantize(w, kind)
        deq = torch.from_numpy(dequantize(raw, kind).reshape(w.shape))
        packed = pack(deq)
        assert torch.equal(packed.dequantize(), deq)
        blocks = raw.reshape(-1, raw.shape[-1] // 8)  # [48 * 8, bytes per block]
        d = torch.from_numpy(blocks[:, :2].copy().view(np.float16)).view(48, 8)
        assert torch.equal(packed.d, d)
        if kind == T.Q4_1:
            m = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16)).view(48, 8)
            assert torch.equal(packed.m, m)
            raw_codes = torch.from_numpy(blocks[:, 4:].copy()).view(48, 8, BLOCK // 2).long()
            # GGUF byte j of a block: input j in the low nibble, j + 16 in the high one
            assert torch.equal(packed.codes4(), torch.cat([raw_codes & 15, raw_codes >> 4], -1))
        else:
            assert torch.equal(packed.codes8(), torch.from_numpy(blocks[:, 2:].copy().view(np.int8)).view(48, 8, BLOCK))


def test_float_weights_land_within_half_a_step():
    w = torch.randn(30, 4 * BLOCK, generator=torch.Generator().manual_seed(4))
    q4, q8 = quantize_q4_1(w), quantize_q8_0(w)
    step4 = ((w.view(30, 4, BLOCK).amax(-1) - w.view(30, 4, BLOCK).amin(-1)) / 15)[..., None]
    err4 = (q4.dequantize() - w).view(30, 4, BLOCK).abs() / step4
    err8 = (q8.dequantize() - w).view(30, 4, BLOCK).abs() / q8.d.float()[..., None]
    assert err4.max() < 0.52 and err8.max() < 0.52
