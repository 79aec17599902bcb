"""kestrel_kernels/small_rows_linear.py: weight @ x^T at a few rows against its reference,
F.linear, and where it applies."""
from __future__ import annotations

import pytest
import torch

from kestrel_kernels import small_rows_linear as srl


@pytest.fixture
def enabled():
    srl.set_enabled(True)
    yield
    srl.set_enabled(False)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(enabled, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)  # [N, K] float32
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)  # [rows, K]
    got = srl.linear(x, w, b)
    assert got.shape == (rows, 96) and got.is_contiguous()
    torch.testing.assert_close(got, srl.linear_ref(x, w, b), atol=1e-5, rtol=1e-5)


def test_leading_dims_and_the_module(enabled):
    layer = srl.SmallRowsLinear(8, 6, bias=True)
    x = torch.randn(2, 1, 8)  # [2, 1, K]: two rows
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer(x).shape == (2, 1, 6)


def test_applies_only_where_it_was_measured_faster(monkeypatch):
    """Off (the default until a rank enables it), and for other dtypes or row counts,
    the reference runs as is."""
    calls = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *a: calls.append(1) or real(*a))
    w, x = torch.randn(6, 8), torch.randn(3, 8)
    srl.set_enabled(False)
    srl.linear(x, w)
    srl.set_enabled(True)
    try:
        srl.linear(x.double(), w.double())
        srl.linear(torch.randn(srl.MAX_ROWS + 1, 8), w)
        assert calls == []
        srl.linear(x, w)
        assert calls == [1]
    finally:
        srl.set_enabled(False)


def test_measure_times_both_ways():
    plain, fast = srl.measure(torch.randn(64, 32), repeats=3)
    assert plain > 0 and fast > 0
