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

A variant is (processed, logprobs): whether the body applies the rows' logit processing
(actors/processing_table.py: read by row on the device, so it needs no host input) and
computes the emitted tokens' logprobs (MAX_TOP alternatives). Each captured variant is
a graph per size, all in one pool (replays never overlap).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from actors.cuda_graph_runner import EagerGraph, capture_cuda_graph, padded_size
from actors.host_copy import to_device


Variant = tuple[bool, bool]  # (processed, logprobs)


class StepGraph:
    def __init__(self, body: Callable[[torch.Tensor, bool, bool], Any], sizes: list[int],
                 device: torch.device, use_cuda_graph: bool,
                 variants: tuple[Variant, ...] = ((False, False),)):
        self.body, self.sizes, self.device = body, sorted(set(sizes)), device
        self.use_cuda_graph, self.variants = use_cuda_graph, variants
        self.rows = torch.full((self.sizes[-1],), -1, dtype=torch.int64, device=device)  # [M] int64
        self._graphs: dict = {}  # (variant, size) -> graph

    def pad_size(self, raw_bs: int) -> int | None:
        """The smallest captured size >= raw_bs, or None (too big: the per-phase path)."""
        return padded_size(self.sizes, raw_bs)

    def holds(self, raw_bs: int, variant: Variant) -> bool:
        return variant in self.variants and self.pad_size(raw_bs) is not None

    def capture(self) -> None:
        bodies = {v: functools.partial(self.body, processed=v[0], logprobs=v[1]) for v in self.variants}
        if not self.use_cuda_graph:
            self._graphs = {(v, bs): EagerGraph(bodies[v], self.rows[:bs])
                            for v in self.variants for bs in self.sizes}
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        self.rows.fill_(-1)  # capture with every lane padded: it writes only row 0 and slot 0
        for v in self.variants:
            for bs in reversed(self.sizes):  # largest first: smaller sizes reuse its pool blocks
                self._graphs[v, bs] = capture_cuda_graph(bodies[v], self.rows[:bs], pool, stream)
        torch.cuda.synchronize(self.device)

    def run(self, rows: list[int], variant: Variant = (False, False)):
        """One iteration for request ``rows`` -> step_body's outputs cut to len(rows) rows:
        [len(rows), S+2] int64, then with logprobs their three tensors. Views of the graph's
        outputs, overwritten by the next replay of that graph."""
        raw = len(rows)
        bs = self.pad_size(raw)
        if bs is None or (variant, bs) not in self._graphs:
            raise ValueError(f"no step graph holds a batch of {raw} as {variant} (captured "
                             f"{sorted(self._graphs)})")
        self.rows[:bs].copy_(to_device(rows + [-1] * (bs - raw), torch.int64, self.device))
        graph = self._graphs[variant, bs]
        graph.replay()
        return tuple(t[:raw] for t in graph.output)
