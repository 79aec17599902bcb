"""The few-row GEMV's reduce="last" (each tile's last split to draw a ticket adds the splits
up) compiled on the GPU, where a tile's splits run at once and race for the ticket (the
interpreter runs them one after another): the bits of reduce="launch" (a second kernel) on
every one of many calls at Qwen2.5-7B's linear shapes and its LM head, bf16 and FP8, and in
a CUDA graph replayed on new inputs. tests/unit/test_triton_gemv.py has the exact cases in
the interpreter."""
from __future__ import annotations

import pytest
import torch

import kestrel_kernels.triton_gemv as kernels
from kestrel_kernels.fp8_linear import quantize_rows
from kestrel_kernels.triton_gemv import fp8_gemv, gemv
from kestrel_testing import require_compiled_triton

CALLS = 200
# Qwen2.5-7B's q/k/v (with its bias), o, gate/up and down projections, and its LM head.
SHAPES = [(4608, 3584, True), (3584, 3584, False), (37888, 3584, False), (3584, 18944, False),
          (152064, 3584, False)]


@pytest.fixture(autouse=True)
def _compiled():
    require_compiled_triton(kernels, "_gemv_kernel")


def randn(*shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda") * scale  # fp32


def linear(weights, N, K, bias):
    """(x [M, K] bf16, **config) -> [M, N] bf16 through fp8_gemv or gemv on a random weight."""
    b = randn(N, seed=2, scale=0.1).bfloat16() if bias else None  # [N] bf16
    w = randn(N, K, seed=N + K, scale=0.02)  # [N, K] fp32
    if weights == "bf16":
        w = w.bfloat16()
        return lambda x, **config: gemv(x, w, b, **config)
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    wq, ws = quantize_rows(w)  # [N, K] fp8, [N, 1] fp32
    del w

    def run(x, **config):
        xq, xs = quantize_rows(x)  # [M, K] fp8, [M, 1] fp32
        return fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16, **config)
    return run


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("N,K,bias", SHAPES)
def test_the_last_split_gives_the_launchs_bits_on_every_call(weights, N, K, bias):
    run = linear(weights, N, K, bias)
    # The default split (none for gate/up and the LM head), then 16 ways: more splits racing.
    for split in ({}, dict(split_k=16)):
        for M in (1, 16):
            x = randn(M, K, seed=M).bfloat16()  # [M, K] bf16
            want = run(x, reduce="launch", **split)
            wrong = torch.zeros((), dtype=torch.int64, device="cuda")  # [] calls with other bits
            for _ in range(CALLS):  # queued back to back, no host sync between them
                wrong += (run(x, reduce="last", **split) != want).any()
            assert wrong.item() == 0, f"{wrong.item()} of {CALLS} calls differ ({split}, M={M})"
            assert all(not t.any() for t in kernels._TICKETS.get(x.device, []))


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_the_last_split_in_a_cuda_graph(weights):
    N, K, bias = SHAPES[0]  # q/k/v: split by default, with a bias
    run = linear(weights, N, K, bias)
    x = randn(16, K, seed=3).bfloat16()  # [16, K] bf16 static input
    run(x, reduce="last")  # compiled and its counters allocated outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, reduce="last")
    for seed in range(4, 24):
        x.copy_(randn(16, K, seed=seed).bfloat16())
        graph.replay()
        assert torch.equal(out, run(x, reduce="launch"))
        assert torch.equal(out, run(x))  # the counters were zeroed by the previous replay


def test_a_capture_refuses_to_grow_the_counters(monkeypatch):
    monkeypatch.setattr(kernels, "_TICKETS", {})
    x = randn(1, 3584, seed=5).bfloat16()  # [1, K] bf16
    w = randn(3584, 3584, seed=6, scale=0.02).bfloat16()  # [N, K] bf16
    gemv(x, w, reduce="launch")  # compiled outside the capture, no counters allocated
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            gemv(x, w, reduce="last")
