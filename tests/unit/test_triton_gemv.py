"""The few-row GEMV (kestrel_kernels/triton_gemv.py) against fp8_linear_ref's math (FP8
weights) and F.linear's (16-bit weights): the same products summed in fp32 in another order;
a row's bits independent of the other rows and of the run; the splits of K reduced by their
last program (reduce="last") to the reduce launch's bits; and model.fp8_gemv_max_rows and
model.gemv_max_rows routing rows to it. On CPU in Triton's interpreter (small shapes: it is
slow), on a GPU compiled (model shapes too)."""
from tests.triton_interpreter import triton_setup  # noqa: I001 - before triton is imported
import pytest
import torch

import kestrel_kernels.fp8_linear as fp8_linear
import kestrel_kernels.small_rows_linear as small_rows_linear
import kestrel_kernels.triton_gemv as kernels
from kestrel_kernels.fp8_linear import fp8_linear_ref, fp8_linear_scaled_mm, quantize_rows
from kestrel_kernels.triton_gemv import MAX_ROWS, default_config, fp8_gemv, gemv
from kestrel_testing import alternately_long

INTERPRETED, DEVICE, pytestmark = triton_setup(kernels, "_gemv_kernel")
gpu_only = pytest.mark.skipif(DEVICE == "cpu", reason="model shapes: too slow in the interpreter")


def randn(*shape, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def layer(N, K, seed, bias_dtype=None):
    wq, ws = quantize_rows(randn(N, K, seed=seed, scale=0.05))  # [N, K] fp8, [N, 1] fp32
    b = randn(N, seed=seed + 1, dtype=bias_dtype) if bias_dtype else None  # [N]
    return wq, ws, b


def check_close(got, want):
    """Equal up to the fp32 summation order, then one rounding to the output dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(want.dtype, 1e-5)
    big = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps * big)


# Odd N and K (neither a multiple of a block), K looping over several tiles, and K split
# (split_k 3: the last split shorter; 4 on K = 1000 in tiles of 128: a split dropped).
# The tensor-core kernel (mma) on the same shapes: N not a multiple of its 16-channel tile.
CASES = [(37, 200, {}), (45, 1000, dict(block_k=128, split_k=3)), (20, 1000, dict(block_k=128, split_k=4)),
         (37, 200, dict(mma=True, block_n=16, block_k=64)),
         (45, 1000, dict(mma=True, block_n=32, block_k=128, split_k=3))]


@pytest.mark.parametrize("M", [1, 3, 8, 16])
@pytest.mark.parametrize("N,K,config", CASES)
@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, True), (torch.float32, False)])
def test_equals_the_reference(M, N, K, config, dtype, bias):
    check_case(M, N, K, config, dtype, bias)


def check_case(M, N, K, config, dtype, bias):
    x = randn(M, K, seed=M + K, dtype=dtype)  # [M, K]
    x[0, : K // 3] *= 50  # a row with a wide range
    wq, ws, b = layer(N, K, seed=N, bias_dtype=dtype if bias else None)
    xq, xs = quantize_rows(x)  # [M, K] fp8, [M, 1] fp32
    check_close(fp8_gemv(xq, xs, wq, ws, b, dtype, **config), fp8_linear_ref(x, wq, ws, b))


@pytest.mark.parametrize("config", [{}, dict(block_k=128, split_k=3),
                                    dict(mma=True, block_n=16, block_k=128, split_k=3)])
def test_a_row_is_the_same_alone_among_others_and_run_to_run(config):
    N, K = 29, 600
    wq, ws, b = layer(N, K, seed=3, bias_dtype=torch.bfloat16)
    xq, xs = quantize_rows(randn(8, K, seed=4, dtype=torch.bfloat16))  # [8, K] fp8, [8, 1] fp32
    others_q, others_s = quantize_rows(randn(8, K, seed=5, dtype=torch.bfloat16))
    batch = fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16, **config)  # [8, N]
    assert torch.equal(fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16, **config), batch)  # run to run
    for r in (0, 5):
        alone = fp8_gemv(xq[r:r + 1], xs[r:r + 1], wq, ws, b, torch.bfloat16, **config)
        assert torch.equal(alone[0], batch[r])
    # Row 5 among other rows, at another batch size.
    mixed_q, mixed_s = others_q[:3].clone(), others_s[:3].clone()
    mixed_q[1], mixed_s[1] = xq[5], xs[5]
    assert torch.equal(fp8_gemv(mixed_q, mixed_s, wq, ws, b, torch.bfloat16, **config)[1], batch[5])


def linear_ref(x, w, b):
    """F.linear's math in fp32, one rounding to x's dtype: what gemv computes."""
    out = x.float() @ w.float().t()  # [M, N] fp32
    return (out + b.float() if b is not None else out).to(x.dtype)


# 16-bit weights through the same kernels: the tensor-core kernel multiplies them as they
# are, the unrolled GEMV widens them to fp32.
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("N,K,config", [c for c in CASES if c[2].get("mma")]
                         + [(37, 200, {}), (45, 1000, dict(mma=False, block_k=128, split_k=3))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_weights_equal_the_reference(M, N, K, config, dtype):
    x = randn(M, K, seed=M + K, dtype=dtype)  # [M, K]
    w = randn(N, K, seed=N, scale=0.05, dtype=dtype)  # [N, K]
    b = randn(N, seed=N + 1, dtype=dtype) if M % 2 else None  # [N]
    check_close(gemv(x, w, b, **config), linear_ref(x, w, b))


def test_sixteen_bit_rows_are_the_same_alone_and_among_others():
    N, K = 29, 600
    w = randn(N, K, seed=3, scale=0.05, dtype=torch.bfloat16)
    x = randn(16, K, seed=4, dtype=torch.bfloat16)  # [16, K]
    batch = gemv(x, w, None, split_k=3)  # [16, N]
    assert torch.equal(gemv(x[7:8], w, None, split_k=3)[0], batch[7])
    with pytest.raises(ValueError, match="one 16-bit float dtype"):
        gemv(x, w.float())
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
        gemv(randn(MAX_ROWS + 1, K, seed=5, dtype=torch.bfloat16), w)


# reduce="last": each tile's last split to arrive adds the splits up instead of a second
# launch. N not a multiple of the tile; K split 1, 2, 4 and 8 ways, the last split shorter.
LAST_CASES = [(37, 1000, dict(block_k=64, split_k=s)) for s in (1, 2, 4, 8)] \
    + [(45, 1000, dict(mma=False, block_n=8, block_k=128, split_k=4))]


def counters_are_zero(device):
    return all(not t.any() for t in kernels._TICKETS.get(device, []))


# The unrolled kernel at 16 rows takes seconds a call in the interpreter: 1 and 3 rows there.
# Every case with both weights in make test, one with a bias and the other without,
# alternating; the other bias of each in make test-long (the bias is added once the
# splits are summed, the same code with or without).
LAST_GRID = [(M, *case) for M in (1, 3, 16) for case in LAST_CASES if M < 16 or case[2].get("mma", True)]
LAST_PARAMS = alternately_long(LAST_GRID, [("fp8", False), ("fp8", True), ("bf16", True), ("bf16", False)])


@pytest.mark.parametrize("M,N,K,config,weights,bias", LAST_PARAMS)
def test_the_last_split_reducing_gives_the_launchs_bits(M, N, K, config, weights, bias):
    x = randn(M, K, seed=M + K, dtype=torch.bfloat16)  # [M, K]
    b = randn(N, seed=N + 1, dtype=torch.bfloat16) if bias else None  # [N]
    if weights == "fp8":
        wq, ws, _ = layer(N, K, seed=N)
        xq, xs = quantize_rows(x)  # [M, K] fp8, [M, 1] fp32
        launch = fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16, reduce="launch", **config)
        last = fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16, reduce="last", **config)
        check_close(last, fp8_linear_ref(x, wq, ws, b))
    else:
        w = randn(N, K, seed=N, scale=0.05, dtype=torch.bfloat16)  # [N, K]
        launch, last = gemv(x, w, b, reduce="launch", **config), gemv(x, w, b, reduce="last", **config)
        check_close(last, linear_ref(x, w, b))
    assert torch.equal(last, launch)
    assert counters_are_zero(x.device)


def test_the_counters_grow_with_the_grid_and_are_zero_after_each_call(monkeypatch):
    monkeypatch.setattr(kernels, "_TICKETS", {})
    x = randn(3, 600, seed=20, dtype=torch.bfloat16)  # [3, K]
    config = dict(block_n=16, block_k=64, split_k=4)
    for N in (20, 70, 20):  # 2 tiles, then 5 (a bigger buffer), then 2 again
        w = randn(N, 600, seed=N, scale=0.05, dtype=torch.bfloat16)  # [N, K]
        assert torch.equal(gemv(x, w, reduce="last", **config), gemv(x, w, reduce="launch", **config))
        assert counters_are_zero(x.device)
    assert [t.numel() for t in kernels._TICKETS[x.device]] == [2, 5]


def test_the_default_config_depends_on_the_shape_only_and_fills_the_gpu():
    # Qwen2.5-7B's o (3584 x 3584) and down projections: 448 tiles of 8 channels, so K splits.
    assert default_config(3584, 3584)["split_k"] > 1 and default_config(3584, 18944)["split_k"] > 1
    assert default_config(59136, 8192)["split_k"] == 1  # 7392 tiles already
    for N, K in [(3584, 3584), (3584, 18944), (10240, 8192), (37, 200)]:
        c = default_config(N, K, sms=132)
        programs = -(-N // c["block_n"]) * c["split_k"]
        # Four waves of programs, unless a further split would leave under two tiles of K.
        assert programs >= 4 * 132 or -(-K // (2 * c["split_k"])) < 2 * c["block_k"]


def test_refuses_what_it_cannot_run():
    wq, ws, _ = layer(16, 64, seed=6)
    xq, xs = quantize_rows(randn(MAX_ROWS + 1, 64, seed=7))
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
        fp8_gemv(xq, xs, wq, ws, None, torch.float32)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fp8_gemv(xq[:2], xs[:2], wq.t().contiguous().t(), ws, None, torch.float32)
    with pytest.raises(ValueError, match="block_n >= 16 with mma"):
        fp8_gemv(xq[:2], xs[:2], wq, ws, None, torch.float32, mma=True, block_n=8)
    with pytest.raises(ValueError, match="unknown config"):
        fp8_gemv(xq[:2], xs[:2], wq, ws, None, torch.float32, block=64)
    with pytest.raises(ValueError, match="reduce 'launch' or 'last'"):
        fp8_gemv(xq[:2], xs[:2], wq, ws, None, torch.float32, reduce="atomic")


@pytest.fixture
def routed(monkeypatch):
    """fp8_linear_scaled_mm with its torch._scaled_mm calls counted (on CPU also answered with
    zeros, which no CPU torch may run) and, on CPU, the Triton path taken as on CUDA."""
    calls = []
    real = torch._scaled_mm

    def scaled_mm(a, b, **kw):
        calls.append(a.shape[0])
        if a.is_cuda:
            return real(a, b, **kw)
        return torch.zeros(a.shape[0], b.shape[1], dtype=kw["out_dtype"])

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    if DEVICE == "cpu":
        monkeypatch.setattr(fp8_linear, "use_triton", lambda t, force_torch=False: True)
    yield calls
    fp8_linear.set_gemv_max_rows(0)


def test_the_setting_routes_few_rows_to_the_gemv(routed):
    K, N = 96, 48
    wq, ws, b = layer(N, K, seed=8, bias_dtype=torch.bfloat16)
    x = randn(5, K, seed=9, dtype=torch.bfloat16)  # [5, K]
    fp8_linear.set_gemv_max_rows(4)
    for M in (1, 4):
        got = fp8_linear_scaled_mm(x[:M].view(1, M, K), wq, ws, b)  # leading dims pass through
        xq, xs = quantize_rows(x[:M])
        assert got.shape == (1, M, N) and torch.equal(got[0], fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16))
        check_close(got[0], fp8_linear_ref(x[:M], wq, ws, b))
    assert routed == []
    fp8_linear_scaled_mm(x, wq, ws, b)  # 5 rows: the GEMM
    fp8_linear.set_gemv_max_rows(0)  # off: one row takes the GEMM too
    fp8_linear_scaled_mm(x[:1], wq, ws, b)
    assert routed == [5, 1]
    with pytest.raises(ValueError, match=f"0..{MAX_ROWS}"):
        fp8_linear.set_gemv_max_rows(MAX_ROWS + 1)


def test_the_setting_routes_few_sixteen_bit_rows_to_the_gemv(monkeypatch):
    calls = []
    real = torch.nn.functional.linear

    def linear(x, w, b=None):
        calls.append(x.numel() // x.shape[-1])
        return real(x, w, b)

    monkeypatch.setattr(small_rows_linear.F, "linear", linear)
    if DEVICE == "cpu":
        monkeypatch.setattr(small_rows_linear, "use_triton", lambda t, force_torch=False: True)
    K, N = 96, 48
    w = randn(N, K, seed=8, scale=0.05, dtype=torch.bfloat16)  # [N, K]
    b = randn(N, seed=9, dtype=torch.bfloat16)  # [N]
    x = randn(5, K, seed=10, dtype=torch.bfloat16)  # [5, K]
    try:
        small_rows_linear.set_gpu_max_rows(4)
        for M in (1, 4):
            got = small_rows_linear.linear(x[:M].view(1, M, K), w, b)  # leading dims pass through
            assert got.shape == (1, M, N) and torch.equal(got[0], gemv(x[:M], w, b))
        assert calls == []
        small_rows_linear.linear(x, w, b)  # 5 rows: F.linear
        small_rows_linear.linear(x[:1].float(), w.float())  # float32: F.linear
        small_rows_linear.set_gpu_max_rows(0)  # off: one row takes F.linear too
        small_rows_linear.linear(x[:1], w, b)
        assert calls == [5, 1, 1]
        with pytest.raises(ValueError, match=f"0..{MAX_ROWS}"):
            small_rows_linear.set_gpu_max_rows(MAX_ROWS + 1)
    finally:
        small_rows_linear.set_gpu_max_rows(0)


def test_the_schema_setting():
    from pydantic import ValidationError

    from configs.schema import ModelConfig, load_config
    assert ModelConfig().fp8_gemv_max_rows == 0  # off unless a preset without a draft turns it on
    assert 0 < load_config("configs/h200-72b.yaml").model.fp8_gemv_max_rows <= MAX_ROWS
    assert 0 < load_config("configs/h200-7b.yaml").model.gemv_max_rows <= MAX_ROWS
    assert ModelConfig(fp8_gemv_max_rows=8).fp8_gemv_max_rows == 8
    assert ModelConfig().gemv_max_rows == 0 and ModelConfig(gemv_max_rows=MAX_ROWS).gemv_max_rows == MAX_ROWS
    for key in ("fp8_gemv_max_rows", "gemv_max_rows"):
        with pytest.raises(ValidationError):
            ModelConfig(**{key: MAX_ROWS + 1})


# Qwen2.5-7B's and 72B's GEMMs (N, K), on a GPU with their default configs.
MODEL_SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (10240, 8192), (8192, 29568)]


@gpu_only
@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("N,K", MODEL_SHAPES)
def test_model_shapes_on_the_gpu(M, N, K):
    x = randn(M, K, seed=M, dtype=torch.bfloat16)  # [M, K] bf16
    wq, ws, b = layer(N, K, seed=N + K, bias_dtype=torch.bfloat16)
    xq, xs = quantize_rows(x)
    got = fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16)
    check_close(got, fp8_linear_ref(x, wq, ws, b))
    assert torch.equal(fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16), got)
    alone = fp8_gemv(xq[-1:], xs[-1:], wq, ws, b, torch.bfloat16)
    assert torch.equal(alone[0], got[-1])


@gpu_only
def test_in_a_cuda_graph():
    wq, ws, b = layer(4608, 3584, seed=10, bias_dtype=torch.bfloat16)
    x = randn(8, 3584, seed=11, dtype=torch.bfloat16)  # [8, K] static input
    xq, xs = quantize_rows(x)
    fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16)
    for seed in (12, 13):
        q, s = quantize_rows(randn(8, 3584, seed=seed, dtype=torch.bfloat16))
        xq.copy_(q)
        xs.copy_(s)
        graph.replay()
        assert torch.equal(out, fp8_gemv(xq, xs, wq, ws, b, torch.bfloat16))


@gpu_only
@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("N,K", MODEL_SHAPES[:4] + [(152064, 3584)])  # the 7B's, its LM head
def test_sixteen_bit_model_shapes_on_the_gpu(M, N, K):
    x = randn(M, K, seed=M, dtype=torch.bfloat16)  # [M, K] bf16
    w = randn(N, K, seed=N + K, scale=0.02, dtype=torch.bfloat16)  # [N, K] bf16
    got = gemv(x, w)
    check_close(got, linear_ref(x, w, None))
    assert torch.equal(gemv(x[-1:], w)[0], got[-1])  # the same bits alone
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    x.copy_(randn(M, K, seed=M + 1, dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(out, gemv(x, w))
