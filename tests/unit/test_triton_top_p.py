"""The sort-free top-k/top-p kernel (kestrel_kernels/triton_top_p.py) against its sorted reference.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (small vocabularies);
with CUDA compiled (tests/gpu/test_top_p_gpu.py adds 512 x 49152). The kept ids must be
the reference's, ties ranked by id, except an id whose mass before it is top_p itself
or within rounding of it (the reference decides that on renormalised fp32 sums, the
kernel on unnormalised ones): `near_the_cut` checks that each such difference is one.
Rows summing to a power of two are exact in both, and must agree exactly.
"""
from __future__ import annotations

import pytest
import torch

import triton_interpreter  # before kernels import triton: picks its interpreter without CUDA
from kestrel_kernels import sampling
from kestrel_kernels import triton_top_p as ttp

INTERPRETED, DEV, needs_triton = triton_interpreter.triton_setup(ttp, "_top_k_top_p_kernel")

pytestmark = needs_triton


def dyadic_rows(T: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """[T, V] float32 of multiples of 1/64 with many ties and zeros, not normalised."""
    return torch.randint(0, 6, (T, V), generator=gen).float() ** 2 / 64  # [T, V] float32


def settings(T: int, V: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """top_p [T] float32 and top_k [T] int64 covering off, edge and ordinary values."""
    ps = torch.tensor([1.0, 0.5, 0.9, 0.05, 0.25, 0.999, 0.75])
    ks = torch.tensor([0, 1, 3, 7, V, V + 5, -1, 2])
    return (ps[torch.randint(0, len(ps), (T,), generator=gen)],
            ks[torch.randint(0, len(ks), (T,), generator=gen)])


def near_the_cut(probs, top_p, top_k, differ, tol: float = 1e-5) -> bool:
    """Whether every id that differs ([T, V] bool) has, in float64 over its row's sorted
    top-k, a mass before it within `tol` of top_p x the top-k mass."""
    V = probs.shape[1]
    for r in differ.any(dim=-1).nonzero().flatten().tolist():
        order = torch.sort(probs[r].double().cpu(), descending=True, stable=True)
        k = int(top_k[r]) if 0 < int(top_k[r]) < V else V
        kept = order.values[:k]
        before = torch.cumsum(kept, 0) - kept  # [k] float64
        rank = {int(i): j for j, i in enumerate(order.indices[:k].tolist())}
        for i in differ[r].nonzero().flatten().tolist():
            if i not in rank or abs(float(before[rank[i]]) - float(top_p[r]) * float(kept.sum())) > tol:
                return False
    return True


def both(probs, top_p, top_k):
    ref = sampling.top_k_top_p_ref(probs, top_p, top_k)
    out = ttp.top_k_top_p_triton(probs.to(DEV), top_p.to(DEV), top_k.to(DEV)).cpu()
    return ref, out


@pytest.mark.parametrize("V", [37, 160])
def test_dyadic_rows_keep_the_reference_ids(V):
    gen = torch.Generator().manual_seed(V)
    T = 24
    probs = dyadic_rows(T, V, gen)
    top_p, top_k = settings(T, V, gen)
    ref, out = both(probs, top_p, top_k)
    differ = (out > 0) != (ref > 0)  # [T, V] bool
    assert int(differ.any(dim=-1).sum()) <= 2 and near_the_cut(probs, top_p, top_k, differ), (top_p, top_k)
    same = ~differ.any(dim=-1)
    torch.testing.assert_close(out[same], ref[same], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.sum(-1), torch.ones(T), rtol=1e-5, atol=1e-5)


def test_boundaries_falling_inside_a_run_of_ties():
    """top_p and top_k cutting through equal probabilities: the lower ids stay."""
    V = 16
    row = torch.tensor([1, 4, 2, 4, 4, 1, 0, 4, 2, 2, 0, 1, 4, 0, 2, 1], dtype=torch.float32) / 32
    probs = row.repeat(6, 1)  # [6, 16] float32, sums to 1
    top_p = torch.tensor([0.3, 0.5, 0.55, 1.0, 0.7, 0.3])  # 0.5 = exactly four 4/32 ids
    top_k = torch.tensor([0, 0, 0, 2, 6, 3])
    ref, out = both(probs, top_p, top_k)
    assert torch.equal(out > 0, ref > 0)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    # Spelled out for one row: top_k 2 keeps ids 1 and 3 of the five tied 4/32 ids.
    assert (out[3] > 0).nonzero().flatten().tolist() == [1, 3]


# 1.0 long, for make test's budget: the same kernel path as 0.3 (peaked rows) and 2.5 (flat).
@pytest.mark.parametrize("temperature", [0.3, pytest.param(1.0, marks=pytest.mark.long), 2.5])
def test_softmax_rows_keep_the_reference_ids(temperature):
    gen = torch.Generator().manual_seed(7)
    T, V = 12, 256
    probs = torch.softmax(torch.randn(T, V, generator=gen) * 3 / temperature, dim=-1)  # [T, V] float32
    top_p, top_k = settings(T, V, gen)
    ref, out = both(probs, top_p, top_k)
    differ = (out > 0) != (ref > 0)  # [T, V] bool
    assert int(differ.any(dim=-1).sum()) <= 1 and near_the_cut(probs, top_p, top_k, differ)
    same = ~differ.any(dim=-1)
    torch.testing.assert_close(out[same], ref[same], rtol=1e-5, atol=1e-7)


def test_process_logits_dispatches_to_the_kernel_on_cuda(monkeypatch):
    """On CUDA tensors process_logits' truncation is the kernel's; elsewhere the reference's."""
    calls = []
    real = ttp.top_k_top_p_triton
    monkeypatch.setattr(sampling, "top_k_top_p_triton", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(3, 40, device=DEV)
    args = (torch.ones(3, device=DEV), torch.full((3,), 0.8, device=DEV),
            torch.zeros(3, dtype=torch.int64, device=DEV))
    sampling.process_logits(logits, *args)
    assert len(calls) == (1 if DEV == "cuda" else 0)
