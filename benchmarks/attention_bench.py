"""Decode attention at length (GPU): the Triton paged-attention kernel over one layer's K/V at
a model's head layout, by batch, context length, key splits and tile shape.

    PYTHONPATH=. python benchmarks/attention_bench.py [--heads 28 4 128] [--batch 1 8]
        [--context 1024 8192 32768] [--splits 16 32 64] [--exact-splits] [--tiles 64/2/2 128/4/3 ...]
        [--prefill-chunk 8192 [--peers]]

A tile is BLOCK_N/num_warps/num_stages or BLOCK_M/BLOCK_N/num_warps/num_stages; "default" is
the launcher's own choice. With --prefill-chunk the tiles apply to the causal chunk, and
--peers times the same chunk by torch's SDPA, by cuDNN in two parts merged by their
log-sum-exps (kestrel_kernels/library_attention.py, the gather from the paged cache included:
attention.library_prefill_min_tokens) and by FlashInfer's FA2 and FA3; --first-calls
times that cuDNN path's first call of a new chunk shape (its plan built then) against the
calls after it, beside the Triton kernel, over a long prompt's chunk shapes. Each launch
is timed as a replayed CUDA graph (decode steps run that way), and the figure printed beside
it is the K/V bytes read over that time, the figure a long-context decode is judged by
against the device's copy bandwidth (benchmarks/copy_bandwidth.py).
"""
from __future__ import annotations

import argparse
import json

import torch

from kestrel_kernels import triton_attention


def bench(fn) -> float:
    """Microseconds per call, from a replayed CUDA graph."""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=100) * 1e3


def decode_case(batch: int, context: int, heads: int, kv_heads: int, dim: int):
    """One layer's decode inputs: `batch` requests of `context` keys each, slots contiguous."""
    dev = torch.device("cuda")
    slots = batch * context
    k = torch.randn(slots, kv_heads, dim, device=dev, dtype=torch.bfloat16)  # [S, Hkv, D] bf16
    v = torch.randn_like(k)
    req_to_token = torch.arange(slots, device=dev, dtype=torch.int32).view(batch, context)  # [B, L]
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16)  # [B, H, D] bf16
    rows = torch.arange(batch, device=dev, dtype=torch.int64)  # [B]
    prefix = torch.full((batch,), context - 1, device=dev, dtype=torch.int32)  # [B]
    new = torch.ones(batch, device=dev, dtype=torch.int32)  # [B]
    indptr = torch.arange(batch + 1, device=dev, dtype=torch.int32)  # [B+1]
    return q, k, v, req_to_token, rows, prefix, new, indptr


def prefill_case(context: int, chunk: int, heads: int, kv_heads: int, dim: int):
    """One request's last `chunk` prompt tokens attending causally over `context` keys (a
    chunked prefill's last chunk)."""
    q, k, v, req_to_token, rows, _, _, _ = decode_case(1, context, heads, kv_heads, dim)
    dev = q.device
    q = torch.randn(chunk, heads, dim, device=dev, dtype=torch.bfloat16)  # [chunk, H, D] bf16
    prefix = torch.tensor([context - chunk], device=dev, dtype=torch.int32)  # [1]
    new = torch.tensor([chunk], device=dev, dtype=torch.int32)  # [1]
    indptr = torch.tensor([0, chunk], device=dev, dtype=torch.int32)  # [2]
    return q, k, v, req_to_token, rows, prefix, new, indptr


def use_tile(tile: str, original) -> None:
    """Make the launcher take `tile` ("default", BLOCK_N/warps/stages, or
    BLOCK_M/BLOCK_N/warps/stages) for the next launches."""
    if tile == "default":
        triton_attention._launch_config = original
        return
    parts = [int(x) for x in tile.split("/")]
    keys = ("BLOCK_N", "num_warps", "num_stages") if len(parts) == 3 else \
        ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")

    def config(max_q_len, group, head_dim):
        return dict(original(max_q_len, group, head_dim), **dict(zip(keys, parts)))
    triton_attention._launch_config = config


def prefill(args) -> None:
    """--prefill-chunk: the causal chunk's time and TFLOP/s (QK^T and PV over the keys each
    query sees) at each context and tile, default splits."""
    H, Hkv, D = args.heads
    original = triton_attention._launch_config
    for context in args.context:
        chunk = min(args.prefill_chunk, context)
        case = prefill_case(context, chunk, H, Hkv, D)
        flops = 4 * H * D * chunk * (context - chunk + (chunk + 1) / 2)

        def timed(label: str, fn) -> None:
            head = f"prefill chunk={chunk:<5} ctx={context:<6} {label:<17}"
            try:
                us = bench(fn)
            except Exception as e:  # a tile that does not fit, a peer this build lacks: go on
                print(f"{head} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                return
            print(f"{head} {us:9.1f} us  {flops / us / 1e6:6.1f} TFLOP/s", flush=True)

        for tile in args.tiles:
            use_tile(tile, original)
            timed(f"tile={tile}", lambda: triton_attention.paged_attention(*case, max_q_len=chunk))
        if args.peers:
            for name, fn in peer_prefills(case, context, chunk, H, Hkv, D):
                timed(name, fn)
        del case
        torch.cuda.empty_cache()
    triton_attention._launch_config = original


def peer_prefills(case, context: int, chunk: int, H: int, Hkv: int, D: int):
    """The same causal chunk by other kernels: (name, launch) pairs. torch's SDPA over
    contiguous K/V (the queries aligned to the last keys), and FlashInfer's paged prefill
    (FA2 and Hopper's FA3) at page sizes 1 and 16, planned once outside the timed launch."""
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = case[0], case[1], case[2]  # [chunk, H, D], [S, Hkv, D] bf16
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, chunk, D]
    ks = k[:context].transpose(0, 1).unsqueeze(0)  # [1, Hkv, context, D]
    vs = v[:context].transpose(0, 1).unsqueeze(0)
    bias = causal_lower_right(chunk, context)
    yield "sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=bias, enable_gqa=True)
    from kestrel_kernels.library_attention import chunk_attention
    req_to_token, prefix = case[3], context - chunk
    slots = req_to_token[0, :context].long()  # [context] int64, the gather's index
    yield "cudnn-split", lambda: chunk_attention(q, k, v, slots, prefix, D ** -0.5)
    try:
        import flashinfer
    except ImportError:
        return
    dev = q.device
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)  # FlashInfer's scratch
    for backend in ("fa2", "fa3"):
        for page in (1, 16):
            pages = context // page
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
            qo_indptr = torch.tensor([0, chunk], dtype=torch.int32, device=dev)  # [2]
            kv_indptr = torch.tensor([0, pages], dtype=torch.int32, device=dev)  # [2]
            kv_indices = torch.arange(pages, dtype=torch.int32, device=dev)  # [pages]
            last = torch.tensor([page], dtype=torch.int32, device=dev)  # [1]
            try:
                wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, H, Hkv, D, page, causal=True,
                             q_data_type=q.dtype, kv_data_type=k.dtype)
            except Exception as e:
                print(f"flashinfer {backend} page {page}: plan failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]}", flush=True)
                continue
            kv = (k[:context].view(pages, page, Hkv, D), v[:context].view(pages, page, Hkv, D))
            yield f"flashinfer-{backend}-p{page}", lambda w=wrapper, kv=kv: w.run(q, kv)


def first_calls(args) -> None:
    """--first-calls: a long prompt's chunk shapes (prefix, chunk), in ms: cuDNN's first call
    (its plans built where the shape is new), its second, and the Triton kernel's steady
    time; then library_attention.warm_up over every shape chunks of 4096-8192 queries reach
    in a 32k context, and new (prefix, chunk) pairs' first calls after it."""
    import time

    from kestrel_kernels import library_attention as la
    H, Hkv, D = args.heads
    before = [(0, 8192), (8192, 8192), (16384, 8192), (24576, 7001), (0, 7001), (12000, 6100),
              (12100, 6000), (31000, 1700), (0, 2048)]
    after = [(24000, 8192), (5000, 5000), (20001, 4321), (12345, 5999), (28000, 4500)]
    S = max(p + c for p, c in before + after)
    _, k, v, req_to_token, rows, _, _, _ = decode_case(1, S, H, Hkv, D)
    dev = k.device

    def ms(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def run(shapes, label):
        for prefix, chunk in shapes:
            q = torch.randn(chunk, H, D, device=dev, dtype=torch.bfloat16)  # [chunk, H, D] bf16
            slots = req_to_token[0, :prefix + chunk].long()  # [P+C] int64
            lib = lambda: la.chunk_attention(q, k, v, slots, prefix, D ** -0.5)  # noqa: E731
            first, second = ms(lib), ms(lib)
            i = lambda x: torch.tensor(x, device=dev, dtype=torch.int32)  # noqa: E731
            tri = lambda: triton_attention.paged_attention(  # noqa: E731
                q, k, v, req_to_token[:, :prefix + chunk].contiguous(), rows, i([prefix]), i([chunk]),
                i([0, chunk]), max_q_len=chunk)
            tri()
            steady = min(ms(tri) for _ in range(3))
            print(f"first calls {label} P={prefix:<6} C={chunk:<5} cudnn-split first {first:8.2f} ms, "
                  f"then {second:7.2f}; triton {steady:7.2f}", flush=True)

    run(before, "cold")
    shapes = la.plan_shapes(4096, 8192, 32768)
    t = ms(lambda: la.warm_up(H, Hkv, D, torch.bfloat16, dev, shapes))
    print(f"warm-up: {len(shapes)} plans (chunks of 4096-8192 queries, 32k context) in {t / 1e3:.1f} s",
          flush=True)
    run(after, "warm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs=3, default=[28, 4, 128], metavar=("H", "HKV", "D"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--splits", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--exact-splits", action="store_true",
                    help="run exactly --splits key splits (default: at most, the launcher choosing)")
    ap.add_argument("--tiles", nargs="+", default=["default", "64/4/3", "128/4/3", "128/8/3", "64/4/4"])
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="time a causal prefill chunk of this many queries instead of decode")
    ap.add_argument("--peers", action="store_true",
                    help="with --prefill-chunk: also time torch's SDPA and FlashInfer's FA2/FA3 prefill")
    ap.add_argument("--first-calls", action="store_true",
                    help="time cuDNN's first call of each new chunk shape against the next")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.first_calls:
        return first_calls(args)
    if args.prefill_chunk:
        return prefill(args)
    H, Hkv, D = args.heads
    original = triton_attention._launch_config
    rows = []
    for batch in args.batch:
        for context in args.context:
            case = decode_case(batch, context, H, Hkv, D)
            ref = triton_attention.paged_attention_ref(*case, max_q_len=1)
            kv_bytes = 2 * batch * context * Hkv * D * 2
            for tile in args.tiles:
                use_tile(tile, original)
                for splits in args.splits:
                    forced = splits if args.exact_splits else None

                    def run(splits=splits, forced=forced):
                        return triton_attention.paged_attention(
                            *case, max_q_len=1, max_kv_splits=splits, num_kv_splits=forced)
                    err = (run().float() - ref.float()).abs().max().item()
                    us = bench(run)
                    row = dict(batch=batch, context=context, tile=tile, max_splits=splits,
                               us=round(us, 2), tb_s=round(kv_bytes / us / 1e6, 3), max_err=err)
                    rows.append(row)
                    print(f"B={batch:<3} ctx={context:<6} tile={tile:<8} splits<={splits:<3} "
                          f"{us:8.1f} us  {row['tb_s']:.2f} TB/s  err {err:.2e}", flush=True)
            del case
            torch.cuda.empty_cache()
    triton_attention._launch_config = original
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
