"""A whole greedy speculative iteration as one CUDA graph per batch size (DESIGN.md 6).

The per-phase runners (spec_graphs.py) replay draft decode, verify and draft extend, but
the small ops between them (tree build, accept, KV move, draft-extend inputs, the
future-map store) run eagerly, and at batch 1 on the H200 they cost about as much as the
verify forward. With a backend that builds its attention metadata on the device
(triton), nothing in a greedy iteration needs the host, so this graph records all of it:
its one input is the batch's request rows, its one output the accept lengths and
tokens, and the carried state (lengths, bonus, top-k, hidden) moves through the future
map inside the graph.

Padded lanes carry row -1: the body maps them to row 0 and slot 0 (both reserved) with
length FILL and zero draft state, rewritten on every replay (C06). Sampled batches and
batches above the largest size take the per-phase path. On CPU the "graph" is the body
run on the same padded rows buffer, so CPU tests drive the same padding path.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from actors.cuda_graph_runner import EagerGraph, capture_cuda_graph, padded_size
from actors.host_copy import to_device


class StepGraph:
    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor], sizes: list[int],
                 device: torch.device, use_cuda_graph: bool):
        self.body, self.sizes, self.device = body, sorted(set(sizes)), device
        self.use_cuda_graph = use_cuda_graph
        self.rows = torch.full((self.sizes[-1],), -1, dtype=torch.int64, device=device)  # [M] int64
        self._graphs: dict = {}

    def pad_size(self, raw_bs: int) -> int | None:
        """The smallest captured size >= raw_bs, or None (too big: the per-phase path)."""
        return padded_size(self.sizes, raw_bs)

    def capture(self) -> None:
        if not self.use_cuda_graph:
            self._graphs = {bs: EagerGraph(self.body, self.rows[:bs]) for bs in self.sizes}
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        self.rows.fill_(-1)  # capture with every lane padded: it writes only row 0 and slot 0
        for bs in reversed(self.sizes):  # largest first: smaller sizes reuse its pool blocks
            self._graphs[bs] = capture_cuda_graph(self.body, self.rows[:bs], pool, stream)
        torch.cuda.synchronize(self.device)

    def run(self, rows: list[int], bs: int | None = None) -> torch.Tensor:
        """One iteration for request ``rows`` at captured size ``bs`` (default: the next)
        -> [len(rows), S+2] int64 (see step_body); a view of the graph's output,
        overwritten by the next replay of that size."""
        raw = len(rows)
        bs = self.pad_size(raw) if bs is None else bs
        if bs is None or bs not in self._graphs or bs < raw:
            raise ValueError(f"no step graph holds a batch of {raw} (captured {sorted(self._graphs)})")
        self.rows[:bs].copy_(to_device(rows + [-1] * (bs - raw), torch.int64, self.device))
        graph = self._graphs[bs]
        graph.replay()
        return graph.output[:raw]

    def wrap_graphs(self, wrap) -> None:
        """Put each size's graph inside ``wrap(bs, graph)`` (GraphRunner.wrap_graphs)."""
        self._graphs = {bs: wrap(bs, g) for bs, g in self._graphs.items()}
