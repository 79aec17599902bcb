"""The sort-free top-k/top-p kernel compiled on the GPU at serving sizes (512 tree nodes x
SmolLM2's 49152 ids): the reference's kept ids, up to ids whose mass before them lies
within fp32 summation error of the cut; then captured in a CUDA graph and replayed on new
rows. tests/unit/test_triton_top_p.py has the exact cases (dyadic rows, ties)."""
from __future__ import annotations

import pytest
import torch

# Imported first: on a CPU-only machine the unit module switches on Triton's interpreter
# before anything imports triton.
from unit.test_triton_top_p import near_the_cut  # isort: skip

from kestrel_kernels import triton_top_p as ttp  # noqa: E402
from kestrel_kernels.sampling import top_k_top_p_ref  # noqa: E402
from kestrel_testing import require_compiled_triton  # noqa: E402

T, V = 512, 49152


@pytest.fixture(autouse=True)
def _compiled():
    require_compiled_triton(ttp, "_top_k_top_p_kernel")


def rows(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.rand(T, 1, generator=gen, device="cuda") * 6  # flat to peaked rows
    probs = torch.softmax(torch.randn(T, V, generator=gen, device="cuda") * scale, dim=-1)  # [T, V] float32
    top_p = torch.rand(T, generator=gen, device="cuda") * 0.98 + 0.01  # [T] float32
    top_k = torch.randint(-1, 200, (T,), generator=gen, device="cuda")  # [T] int64, <= 0 = off
    top_k[::3] = 0
    return probs, top_p, top_k


def test_kept_ids_are_the_reference_ids_at_serving_size():
    for seed in range(3):
        probs, top_p, top_k = rows(seed)
        ref = top_k_top_p_ref(probs, top_p, top_k)
        out = ttp.top_k_top_p_triton(probs, top_p, top_k)
        differ = (out > 0) != (ref > 0)  # [T, V] bool
        assert int(differ.sum()) <= 4 and near_the_cut(probs, top_p, top_k, differ)
        same = ~differ.any(dim=-1)
        torch.testing.assert_close(out[same], ref[same], rtol=1e-5, atol=1e-9)


def test_replays_in_a_cuda_graph():
    probs, top_p, top_k = rows(10)
    out = ttp.top_k_top_p_triton(probs, top_p, top_k)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ttp.top_k_top_p_triton(probs, top_p, top_k)
    fresh = rows(11)
    for dst, src in zip((probs, top_p, top_k), fresh):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(out, ttp.top_k_top_p_triton(*fresh), rtol=0, atol=0)
