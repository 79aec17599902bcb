"""Warm-up: run once, before serving, each eager path whose Triton kernels a graph does not
already compile.

CUDA graphs cover decode and prefill steps within the prefill-graph budget, but larger
prefills run eagerly, and their Triton kernels are compiled for each new combination of
tile sizes (chosen from the longest prompt chunk) and of the integer arguments Triton
specializes (1, multiples of 16, other). So is the accept kernel of sampled speculative
decoding (tree rejection sampling), which no greedy graph contains, and the penalties
kernel where no graph holds the node count (prefill sampling). Compiling one took
0.4-1 s on the H200, in front of the first token of every request of that batch: over
HTTP a burst of 32 requests waited a second for its first tokens. Running these shapes
at start-up moves that cost to the model load.

The warm-up writes KV for rows 1..B and their future-map entries; the scheduler rewrites
both before any request reads them (a row's slots are recorded when it is admitted, its
future values when its prefill ends), and the prefix cache knows nothing of them.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from actors.protocol.step_plan import RowProcessing, StepPlan, coins_per_request

log = logging.getLogger("kestrel.worker")

# Chunk lengths that meet each query-tile size (16, 32 or 64 rows of queries x the heads
# sharing a KV head) for any grouping up to 16 heads per KV head.
CHUNK_LENS = (1, 2, 4, 8, 16, 32, 64)


def prefill_shapes(num_rows: int, chunk_budget: int, num_slots: int, page: int) -> list[tuple[int, int]]:
    """(requests, tokens each): every chunk length alone and in as large a batch as one
    prefill step takes, so both single-request and batch-filling tilings compile."""
    usable_rows = max(1, num_rows - 2)  # row 0 is reserved, one row of slack
    shapes = []
    for n in CHUNK_LENS:
        stride = -(-n // page) * page  # each row starts on a page
        most = min(usable_rows, max(1, chunk_budget // n), max(1, (num_slots - page) // stride))
        shapes += [(1, n), (most, n)]
    return list(dict.fromkeys(shapes))


def warm_up_library(worker) -> None:
    """attention.library_prefill_min_tokens: cuDNN's plan for every call shape a long chunk
    can take here (kestrel_kernels/library_attention.py), built now rather than in front of
    a long prompt's first token (45-900 ms each on an H100)."""
    import torch

    from kestrel_kernels import library_attention as la
    n = getattr(worker.target.backend, "library_min_tokens", 0)
    if not n:
        return
    a = worker.arch
    shapes = la.plan_shapes(n, worker.cfg.scheduler.chunked_prefill_size, worker.max_context)
    log.info("rank %d: building cuDNN attention plans for %d call shapes (chunks of %d to %d "
             "queries, contexts up to %d)", worker.rank, len(shapes), n,
             worker.cfg.scheduler.chunked_prefill_size, worker.max_context)
    t0 = time.time()
    for i in range(0, len(shapes), 16):
        try:
            la.warm_up(a.num_heads, a.num_kv_heads, a.head_dim, worker.kv_dtype, worker.device,
                       shapes[i:i + 16])
        except RuntimeError as e:  # a layout the start-up probe (K/V heads only) passed
            raise ValueError(f"attention.library_prefill_min_tokens={n} cannot run here: cuDNN's "
                             f"attention refused {a.num_heads} query heads over {a.num_kv_heads} K/V "
                             f"heads: {str(e).splitlines()[0][:160]}; set it to 0") from e
        torch.cuda.synchronize(worker.device)
        log.info("rank %d: cuDNN attention plans %d/%d (%.1fs)", worker.rank, min(i + 16, len(shapes)),
                 len(shapes), time.time() - t0)


def warm_up_prefill(worker) -> None:
    """Run the prefill shapes eagerly on `worker` (a RankWorker) and wait for the GPU."""
    graphs, worker.prefill_graphs = worker.prefill_graphs, None  # their kernels: at capture
    try:
        _run_prefill_shapes(worker)
    finally:
        worker.prefill_graphs = graphs


def _run_prefill_shapes(worker) -> None:
    import torch
    cfg = worker.cfg
    page = cfg.kv_cache.page_size
    coins = coins_per_request(cfg)
    shapes = prefill_shapes(worker.num_rows, cfg.scheduler.chunked_prefill_size, worker.num_slots, page)
    t0 = time.time()
    for step, (batch, n) in enumerate(shapes):
        rows = list(range(1, batch + 1))
        stride = -(-n // page) * page
        starts = page + stride * np.arange(batch, dtype=np.int64)  # after the reserved page 0
        ids = (np.arange(batch * n, dtype=np.int64) * 7919 % worker.arch.vocab_size).tolist()
        worker.execute(StepPlan(
            -1 - step, "extend", rows,
            kv_writes=[(r, 0, starts[i] + np.arange(n, dtype=np.int64)) for i, r in enumerate(rows)],
            temperature=[0.0] * batch, top_p=[1.0] * batch, top_k=[-1] * batch,
            coins=np.zeros((batch, coins), dtype=np.float32), input_ids=ids,
            prefix_lens=[0] * batch, extend_lens=[n] * batch, last_chunk=[True] * batch,
            next_ids=[-1] * batch))
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    log.info("rank %d: prefill warmed up at %s (requests x tokens) in %.1fs", worker.rank,
             ", ".join(f"{b}x{n}" for b, n in shapes), time.time() - t0)


def warm_up_mixed(worker) -> None:
    """Mixed steps (scheduler.mixed_steps) at the prefill shapes: row 1 decodes (its
    verify tree, under speculation) in the forward of each shape's chunks, so the
    attention kernel's tilings for trees beside chunks compile at start-up. Row 1 gets a
    one-token prompt first, and room for every step's accepted tokens."""
    import torch
    cfg = worker.cfg
    if not cfg.scheduler.mixed_steps or cfg.parallel.dp_attention:
        return
    page, coins = cfg.kv_cache.page_size, coins_per_request(cfg)
    spec = worker.eagle is not None
    # Row 1's slots: its prompt token and a window per step (at most 2 shapes a length).
    room = -(-(1 + worker.window * (2 * len(CHUNK_LENS) + 1)) // page) * page
    shapes = prefill_shapes(worker.num_rows - 1, cfg.scheduler.chunked_prefill_size,
                            worker.num_slots - room, page)
    first = page + np.arange(room, dtype=np.int64)  # after the reserved page 0
    sampling = lambda b: dict(temperature=[0.0] * b, top_p=[1.0] * b, top_k=[-1] * b,
                              coins=np.zeros((b, coins), dtype=np.float32))
    t0 = time.time()
    worker.execute(StepPlan(-2000, "extend", [1], kv_writes=[(1, 0, first)], input_ids=[0],
                            prefix_lens=[0], extend_lens=[1], last_chunk=[True], next_ids=[-1],
                            **sampling(1)))
    for step, (batch, n) in enumerate(shapes):
        rows = list(range(2, batch + 2))
        stride = -(-n // page) * page
        starts = page + room + stride * np.arange(batch, dtype=np.int64)
        ids = (np.arange(batch * n, dtype=np.int64) * 7919 % worker.arch.vocab_size).tolist()
        worker.execute(StepPlan(
            -2001 - step, "mixed", [1] + rows, num_decode=1, use_spec=spec,
            kv_writes=[(r, 0, starts[i] + np.arange(n, dtype=np.int64)) for i, r in enumerate(rows)],
            input_ids=ids, prefix_lens=[0] * batch, extend_lens=[n] * batch,
            last_chunk=[True] * batch, next_ids=[-1] * batch, **sampling(batch + 1)))
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    log.info("rank %d: mixed steps warmed up at %d shapes in %.1fs", worker.rank, len(shapes),
             time.time() - t0)


def warm_up_sampled_decode(worker) -> None:
    """One sampled speculative iteration on row 1 (a one-token prompt, its window's slots
    after the reserved page), so tree rejection sampling is compiled before a client's
    first sampled request meets it (on the per-phase path; the sampled step graphs hold it
    since their capture). Row 1 samples through its processing table entry, as a
    scheduler's sampled request would, and is cleared afterwards. Nothing to do without
    speculation: plain sampling is torch ops."""
    if worker.eagle is None:
        return
    import torch
    page, coins = worker.cfg.kv_cache.page_size, coins_per_request(worker.cfg)
    slots = page + np.arange(1 + worker.window, dtype=np.int64)  # the prompt, then the window
    t0 = time.time()
    worker.execute(StepPlan(
        -1000, "extend", [1], kv_writes=[(1, 0, slots)], temperature=[0.0], top_p=[1.0],
        top_k=[-1], coins=np.zeros((1, coins), dtype=np.float32), input_ids=[0],
        prefix_lens=[0], extend_lens=[1], last_chunk=[True], next_ids=[-1]))
    worker.execute(StepPlan(
        -1001, "decode", [1], temperature=[1.0], top_p=[1.0], top_k=[-1],
        coins=np.full((1, coins), 0.5, dtype=np.float32), use_spec=True,
        processing_resets=[(1, RowProcessing(temperature=1.0))]))
    worker.execute(StepPlan(-1002, "idle", [], processing_resets=[(1, None)]))
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    log.info("rank %d: sampled speculative decoding warmed up in %.1fs", worker.rank, time.time() - t0)


def warm_up_processing(worker) -> None:
    """The logit processing once at each shape serving meets, so its Triton kernels are
    compiled at start-up, not in the step of the first request that needs them:
    kestrel_kernels/triton_penalties.py once per node count (a plain row's N = 1: prefill
    sampling, plain decode; with speculation the tree's N nodes on a chain of paths, and
    its path entries), on row 0, the reserved row, whose processing is none; and
    kestrel_kernels/triton_token_bitmask.py, which plain steps with grammar rows run eagerly."""
    import torch

    from kestrel_kernels.token_bitmask import mask_logits_
    dev, V = worker.device, worker.arch.vocab_size
    rows = torch.zeros(1, dtype=torch.int64, device=dev)  # [1] int64: row 0
    t0 = time.time()
    worker.process(rows, torch.zeros(1, 1, V, device=dev))  # [1, 1, V] float32 logits
    if worker.eagle is not None:
        N = worker.eagle.N
        path = torch.ones(N, N, dtype=torch.bool, device=dev).tril()  # [N, N] bool: a chain
        path[:, 0] = False  # the root is not on a path
        worker.process(rows, torch.zeros(1, N, V, device=dev),  # [1, N, V] float32 logits
                       None, torch.arange(N, device=dev)[None], path[None])
    for words in (16, 17):  # the grammar mask kernel: Triton compiles a width divisible by 16 apart
        mask_logits_(torch.zeros(1, V, device=dev),  # [1, V] float32 logits
                     torch.full((1, words), -1, dtype=torch.int32, device=dev))  # [1, words] int32
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    log.info("rank %d: logit processing warmed up in %.1fs", worker.rank, time.time() - t0)
