"""Prefill warm-up: run prefill once at each kind of shape it meets before serving.

CUDA graphs cover decode, but prefill runs eagerly, and its Triton kernels are compiled
for each new combination of tile sizes (chosen from the longest prompt chunk) and of the
integer arguments Triton specializes (1, multiples of 16, other). Compiling one took
0.5-1 s on the H200, in front of the first token of every request of that batch: over
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

from actors.step_plan import StepPlan

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


def warm_up_prefill(worker) -> None:
    """Run the prefill shapes on `worker` (a RankWorker) and wait for the GPU."""
    import torch
    cfg = worker.cfg
    page = cfg.kv_cache.page_size
    coins = (cfg.draft.num_draft_tokens + 1) if cfg.draft.enabled else 1
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
