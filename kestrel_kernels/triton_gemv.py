"""Triton GEMV for a linear layer at a few rows (1 to 16): the FP8 linear's product from
activations already quantized per row (kestrel_kernels/fp8_linear.py, `fp8_gemv`),

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * xs[m] * ws[n] (+ bias[n])

and the same kernels on 16-bit weights (`gemv`: F.linear, no scales), summed in fp32.

At a few rows the layer is a read of the weight: cuBLASLt's row-scaled FP8 GEMM runs it as
128x128 tiles, far from the bandwidth, and cuBLAS's bf16 GEMV splits K into extra reduce
launches (docs/benchmarks.md, "FP8 at one stream", "Few-row GEMVs").

Two kernels share the tiling. The default (`mma`) pads the rows to 16 and multiplies each
weight tile by them on the tensor cores (FP8 tiles widened to fp16, 16-bit ones as they
are): its time is flat from 1 to 16 rows. Past 16 rows the library GEMMs win (a 64-row pad
was measured slower than cuBLASLt at every 7B and 72B shape). The unrolled GEMV (mma=False)
is a few percent faster at one row and grows with the rows; the benchmark's sweep keeps it.

In the GEMV each program owns BLOCK_N output channels and a slice of K: per iteration it
loads a [BLOCK_N, BLOCK_K] weight tile (16-byte loads along K, which is contiguous),
converts it to fp32 (E4M3 and 16-bit values and their products are exact in fp32) and
multiplies it by every row's [BLOCK_K] values, so the weight is read once for all M rows.
Each row's tile is summed into an fp32 accumulator of [M, BLOCK_N]; the rows are unrolled
(M is a compile-time constant) so a row's sum takes the same steps whichever other rows are
in the batch.

Where N / BLOCK_N programs would not fill the GPU a few times over, K is split SPLIT_K ways:
each split writes its fp32 sums to a [SPLIT_K, M, N] buffer, and they are added in split
order, then scaled, biased and cast (the same bits every run, whichever split ends first).
The config's `reduce` says by whom: "last" (the default), the tile's split that ends last,
saving a second launch (1-3% of a 7B layer's four GEMVs on an H100: docs/benchmarks.md,
"FP8 at 16 to 256 rows"); "launch", a second kernel. With "last" each split, its
sums stored, draws a ticket from its tile's int32 counter (an atomic add, acq_rel: the
release publishes its sums, the last ticket's acquire sees them all), and the one drawing
the last reduces and zeroes the counter for the next call. Both modes give the same bits.

A row's summation order depends on BLOCK_N, BLOCK_K, SPLIT_K and num_warps, so the default
config depends on the layer's shape (and the GPU's SM count), never on M: a token's output
is the same bits at one row as among sixteen. No host reads of device values: the call can
be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import torch

from kestrel_kernels.fp8_format import FP8
from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "MAX_ROWS", "default_config", "fp8_gemv", "gemv"]

MAX_ROWS = 16  # the tensor-core kernel's padded rows (one MMA's); past them the GEMMs win
_SMS_WITHOUT_CUDA = 132  # the interpreter has no SM count; an H100/H200's keeps configs alike

if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(X, XS, W, WS, BIAS, OUT, PART, TICKETS, N, K, stride_xm, stride_xs, stride_wn,
                         stride_om, k_per_split, M: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                         LAST_REDUCES: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
        pid_k, offs_m, offs_n, offs_k, w_ptrs, k_start, k_end = _tile(
            W, N, K, stride_wn, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = k0 + offs_k < k_end
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32)
            for m in tl.static_range(M):
                x = tl.load(X + m * stride_xm + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N] this tile's sum for row m
                acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
        _finish(acc, offs_m, offs_n, pid_k, M, N, XS, WS, BIAS, OUT, PART, TICKETS, stride_xs,
                stride_om, SPLIT_K, LAST_REDUCES, HAS_BIAS, SCALED)

    @triton.jit
    def _mma_kernel(X, XS, W, WS, BIAS, OUT, PART, TICKETS, M, N, K, stride_xm, stride_xs,
                        stride_wn, stride_om, k_per_split, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        LAST_REDUCES: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
        """The same sums on the tensor cores: the rows padded to BLOCK_M (16) with zeros, FP8
        tiles widened to fp16 (exact: E4M3's 3 mantissa bits and 2^-9..448 fit; 16-bit tiles
        as they are) and multiplied by tl.dot into fp32. An output element's sum does not
        depend on the other rows' values, so a row's bits are the same alone or among
        fifteen others."""
        pid_k, offs_m, offs_n, offs_k, w_ptrs, k_start, k_end = _tile(
            W, N, K, stride_wn, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K)
        m_ok = offs_m < M
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = k0 + offs_k < k_end
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
            if SCALED:
                x, w = x.to(tl.float16), w.to(tl.float16)
            acc = tl.dot(x, tl.trans(w), acc)  # [BLOCK_M, BLOCK_N] fp32
        _finish(acc, offs_m, offs_n, pid_k, M, N, XS, WS, BIAS, OUT, PART, TICKETS, stride_xs,
                stride_om, SPLIT_K, LAST_REDUCES, HAS_BIAS, SCALED)

    @triton.jit
    def _tile(W, N, K, stride_wn, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
        """This program's split of K, its rows, channels and K offsets, and its weight tile's
        pointers [BLOCK_N, BLOCK_K]. Channels past N re-read channel N-1 instead of being
        masked: the weight loads keep only the K mask (uniform over each 16-byte vector), and
        those columns are never stored."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
        w_ptrs = W + rows_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        return pid_k, offs_m, offs_n, offs_k, w_ptrs, k_start, k_end

    @triton.jit
    def _finish(acc, offs_m, offs_n, pid_k, M, N, XS, WS, BIAS, OUT, PART, TICKETS, stride_xs,
                stride_om, SPLIT_K: tl.constexpr, LAST_REDUCES: tl.constexpr,
                HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] fp32 sums -> (scaled) output, or this split's sums to PART;
        with LAST_REDUCES the tile's last split to arrive then reduces them to the output."""
        if SPLIT_K == 1:
            _epilogue(acc, offs_m, offs_n, M, N, XS, WS, BIAS, OUT, stride_xs, stride_om,
                      HAS_BIAS, SCALED)
        else:
            ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            part_ptrs = PART + offs_m[:, None] * N + offs_n[None, :]  # [BLOCK_M, BLOCK_N] split 0's
            tl.store(part_ptrs + pid_k * M * N, acc, mask=ok)
            if LAST_REDUCES:
                # The ticket is one thread's atomic: the barrier orders all threads' stores
                # before it, and its release publishes them to the split drawing the last.
                tl.debug_barrier()
                ticket = tl.atomic_add(TICKETS + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
                if ticket == SPLIT_K - 1:
                    tl.debug_barrier()  # all threads' loads after the (one thread's) acquire
                    out = tl.load(part_ptrs, mask=ok, other=0.0)
                    for s in tl.static_range(1, SPLIT_K):  # _reduce_kernel's order: its bits
                        out += tl.load(part_ptrs + s * M * N, mask=ok, other=0.0)
                    _epilogue(out, offs_m, offs_n, M, N, XS, WS, BIAS, OUT, stride_xs, stride_om,
                              HAS_BIAS, SCALED)
                    tl.store(TICKETS + tl.program_id(0), 0)  # zeroed for the next call or replay

    @triton.jit
    def _epilogue(out, offs_m, offs_n, M, N, XS, WS, BIAS, OUT, stride_xs, stride_om,
                  HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
        """out [BLOCK_M, BLOCK_N] fp32 sums -> scaled, biased, cast and stored."""
        m_ok = offs_m < M
        n_ok = offs_n < N
        if SCALED:
            xs = tl.load(XS + offs_m * stride_xs, mask=m_ok, other=0.0)
            ws = tl.load(WS + offs_n, mask=n_ok, other=0.0)
            # The reference's order: (sum * xs) * ws, then the bias, in fp32.
            out = out * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            out = out + tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], out.to(OUT.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _reduce_kernel(PART, XS, WS, BIAS, OUT, N, stride_xs, stride_om, M: tl.constexpr,
                                SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                                SCALED: tl.constexpr):
        m = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        n_ok = offs_n < N
        out = tl.load(PART + m * N + offs_n, mask=n_ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):  # split order, fixed: deterministic
            out += tl.load(PART + (s * M + m) * N + offs_n, mask=n_ok, other=0.0)
        if SCALED:
            out = out * tl.load(XS + m * stride_xs) * tl.load(WS + offs_n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            out = out + tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(OUT + m * stride_om + offs_n, out.to(OUT.dtype.element_ty), mask=n_ok)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _SMS_WITHOUT_CUDA
    return torch.cuda.get_device_properties(device).multi_processor_count


_TICKETS: dict[torch.device, list[torch.Tensor]] = {}  # device -> its counters, the newest last


def _tickets(device: torch.device, n_tiles: int) -> torch.Tensor:
    """reduce="last"'s counters on `device`: one int32 a tile of N, zero between calls (the
    last split to arrive at a tile zeroes its counter). Shared by every call, so calls on
    one device must be ordered on one stream (the model runs on one). A bigger grid than
    any before allocates a bigger buffer, which a call made during CUDA graph capture
    refuses to do; older buffers are kept, as graphs captured with them still use them."""
    held = _TICKETS.setdefault(device, [])
    if not held or held[-1].numel() < n_tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gemv(reduce='last'): {n_tiles} tiles need a bigger counter buffer than "
                               f"this device's ({held[-1].numel() if held else 0}); make one such call "
                               f"before capturing the CUDA graph")
        held.append(torch.zeros(n_tiles, dtype=torch.int32, device=device))  # [n_tiles] int32
    return held[-1]


def default_config(N: int, K: int, sms: int = _SMS_WITHOUT_CUDA, block_n: int = 32,
                   block_k: int | None = None, mma: bool = True, elem_bytes: int = 1) -> dict:
    """The launch config for a weight [N, K] of `elem_bytes`-byte values on a GPU of `sms`
    SMs: the tensor-core kernel on 32 channels by 256 bytes of K a tile (flat from 1 to 16
    rows, where the unrolled GEMV's time grows with the rows: docs/benchmarks.md), K split in
    two, four, ... while the programs fill the SMs fewer than four times and each split keeps
    at least two tiles of K. A function of the shape only, not of M (see the module
    docstring). Other tile sizes get their split by the same rule (the benchmark's sweep)."""
    block_k = 256 // elem_bytes if block_k is None else block_k
    block_k = min(block_k, max(16, 1 << (K - 1).bit_length()))  # no wider than K
    n_blocks = -(-N // block_n)
    split = 1
    while split < 16 and n_blocks * split < 4 * sms and -(-K // (2 * split)) >= 2 * block_k:
        split *= 2
    return dict(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=3, mma=mma,
                reduce="last")


def fp8_gemv(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, **config) -> torch.Tensor:
    """xq [M, K] fp8 and xs [M, 1] fp32 (quantize_rows' output, M <= MAX_ROWS), wq [N, K]
    fp8, ws [N, 1] fp32, bias [N] or None -> [M, N] out_dtype. `config` overrides
    default_config's keys (block_n, block_k, split_k, num_warps, num_stages, mma: the
    tensor-core kernel, reduce: who adds the splits up): the benchmark's sweep. Without
    split_k, K is split by default_config's rule for the tile asked for."""
    M, K = xq.shape
    N = wq.shape[0]
    if xq.dtype != FP8 or wq.dtype != FP8 or wq.shape[1] != K or xq.stride(1) != 1 or wq.stride(1) != 1:
        raise ValueError(f"fp8_gemv needs xq [M, K] and wq [N, K] in {FP8} with a contiguous last dim; "
                         f"got {xq.dtype} {tuple(xq.shape)}, {wq.dtype} {tuple(wq.shape)}")
    if not 1 <= M <= MAX_ROWS or xs.shape != (M, 1) or ws.shape != (N, 1):
        raise ValueError(f"fp8_gemv takes 1..{MAX_ROWS} rows with xs [M, 1] and ws [N, 1]; got "
                         f"M={M}, xs {tuple(xs.shape)}, ws {tuple(ws.shape)}")
    return _launch(xq, xs, wq, ws.reshape(N), bias, out_dtype, config)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, **config) -> torch.Tensor:
    """F.linear(x, w, bias) at a few rows by the same kernels, on 16-bit weights: x [M, K]
    and w [N, K] of one dtype (bfloat16 or float16), M <= MAX_ROWS, bias [N] or None ->
    [M, N] x.dtype, summed in fp32. `config` as for fp8_gemv (block_k counts values:
    default_config's 256 bytes are 128 of them)."""
    M, K = x.shape
    N = w.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or w.shape[1] != K \
            or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"gemv needs x [M, K] and w [N, K] of one 16-bit float dtype with a contiguous "
                         f"last dim; got {x.dtype} {tuple(x.shape)}, {w.dtype} {tuple(w.shape)}")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {M}")
    return _launch(x, None, w, None, bias, x.dtype, config)


def _launch(x: torch.Tensor, xs: torch.Tensor | None, w: torch.Tensor, ws: torch.Tensor | None,
            bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (* xs [M, 1] * ws [N] where given) + bias -> [M, N] out_dtype."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.fp8_linear.fp8_linear_ref "
                           "or torch.nn.functional.linear")
    M, K = x.shape
    N = w.shape[0]
    unknown = set(config) - {"block_n", "block_k", "split_k", "num_warps", "num_stages", "mma", "reduce"}
    if unknown:
        raise ValueError(f"gemv: unknown config keys {sorted(unknown)}")
    blocks = {k: config[k] for k in ("block_n", "block_k", "mma") if k in config}
    cfg = {**default_config(N, K, _sm_count(x.device), elem_bytes=w.element_size(), **blocks), **config}
    block_n, block_k, split = cfg["block_n"], cfg["block_k"], cfg["split_k"]
    if any(v < 1 or v & (v - 1) for v in (block_n, block_k)) or block_k < 16 or split < 1 \
            or (cfg["mma"] and block_n < 16) or cfg["reduce"] not in ("launch", "last"):
        raise ValueError(f"gemv: block_n and block_k must be powers of two (block_k >= 16, "
                         f"block_n >= 16 with mma), split_k >= 1, reduce 'launch' or 'last'; got {cfg}")
    # Splits a whole number of tiles long, so every tile but a split's last is unmasked.
    k_per_split = -(-K // (split * block_k)) * block_k
    split = -(-K // k_per_split)  # a split that would start past K is dropped
    scaled = xs is not None
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)  # [M, N]
    part = (torch.empty((split, M, N), dtype=torch.float32, device=x.device)  # [SPLIT_K, M, N] fp32 sums
            if split > 1 else out)
    has_bias = bias is not None
    bias = bias.contiguous() if has_bias else out  # [N]; any pointer: not read without a bias
    xs, ws = (xs, ws) if scaled else (out, out)  # not read unscaled
    grid = (triton.cdiv(N, block_n), split)
    last = split > 1 and cfg["reduce"] == "last"
    tickets = _tickets(x.device, grid[0]) if last else out  # [>= N tiles] int32; else not read
    launch = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, LAST_REDUCES=last, HAS_BIAS=has_bias,
                  SCALED=scaled, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    xs_stride = xs.stride(0) if scaled else 0
    if cfg["mma"]:  # M a runtime value: one compiled kernel for 1..16 rows
        _mma_kernel[grid](x, xs, w, ws, bias, out, part, tickets, M, N, K, x.stride(0), xs_stride,
                              w.stride(0), out.stride(0), k_per_split, BLOCK_M=MAX_ROWS, **launch)
    else:
        _gemv_kernel[grid](x, xs, w, ws, bias, out, part, tickets, N, K, x.stride(0), xs_stride,
                               w.stride(0), out.stride(0), k_per_split, M=M,
                               BLOCK_M=triton.next_power_of_2(M), **launch)
    if split > 1 and not last:
        block = 1024
        _reduce_kernel[(M, triton.cdiv(N, block))](part, xs, ws, bias, out, N, xs_stride,
                                                             out.stride(0), M=M, SPLIT_K=split,
                                                             BLOCK=block, HAS_BIAS=has_bias,
                                                             SCALED=scaled, num_warps=4)
    return out
