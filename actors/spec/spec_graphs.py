"""The speculative path's CUDA graphs: target verify, draft decode, draft extend (docs/design.md, "CUDA graphs").

One :class:`GraphRunner` per kind, captured at start-up over the same batch sizes as plain
decode. Each runner records the EAGLE worker's own forward body for that kind, so a
replay and an eager run execute the same code; on CPU a runner's "graph" is that body
called on the padded static buffers, which keeps the padding path testable without CUDA.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner, graph_backend

log = logging.getLogger("kestrel.worker")

Body = Callable[[GraphBatch], Any]


@dataclass
class SpecGraphs:
    verify: GraphRunner
    draft_decode: GraphRunner | None  # None with one draft step: no draft forward to replay
    draft_extend: GraphRunner


def capture_spec_graphs(eagle: Any, sizes: list[int], *,
                        use_cuda_graph: bool | None = None) -> SpecGraphs:
    """Build and capture the three runners of ``eagle`` (an EagleWorker) for ``sizes``.

    ``use_cuda_graph`` None: real graphs on CUDA, the eager stand-in elsewhere.
    """
    w, K, S, N = eagle.w, eagle.K, eagle.S, eagle.N
    common = {"device": w.device, "use_cuda_graph": use_cuda_graph}
    verify = GraphRunner(GraphKind.TARGET_VERIFY, sizes, graph_backend(w.target.backend),
                         width=N, mask_width=N, **common)
    draft_decode = None
    if S > 1:
        # K lanes per request; the S-1 steps write (S-1)*K scratch slots per request.
        draft_decode = GraphRunner(GraphKind.DRAFT_DECODE, sizes, graph_backend(eagle.decode_backend),
                                   width=K, slots_per_req=(S - 1) * K, topk=K,
                                   hidden_size=eagle.hidden_size, hidden_dtype=w.dtype, **common)
    draft_extend = GraphRunner(GraphKind.DRAFT_EXTEND, sizes, graph_backend(eagle.extend_backend),
                               width=N, hidden_size=eagle.feature_size, hidden_dtype=w.dtype,
                               **common)
    for name, runner, body in (("target verify", verify, eagle.graph_verify_body),
                               ("draft decode", draft_decode, eagle.draft_body),
                               ("draft extend", draft_extend, eagle.extend_body)):
        if runner is None:
            continue
        t0 = time.time()
        with torch.inference_mode():
            runner.capture(body)
        log.info("rank %d: captured %s graphs for batch sizes %s in %.1fs%s", w.rank, name,
                 runner.sizes, time.time() - t0, "" if runner.use_cuda_graph else " (eager stand-in)")
    return SpecGraphs(verify, draft_decode, draft_extend)
