"""A whole greedy speculative iteration as one CUDA graph per batch size (docs/design.md, "CUDA graphs").

The per-phase runners (spec_graphs.py) replay draft decode, verify and draft extend, but
the small ops between them (tree build, accept, KV move, draft-extend inputs, the
future-map store) run eagerly, and at batch 1 on the H200 they cost about as much as the
verify forward. With a backend that builds its attention metadata on the device
(triton), nothing in a greedy iteration needs the host, so this graph records all of it:
its inputs are the batch's request rows and, when it samples, their coins, its one
output the accept lengths and tokens, and the carried state (lengths, bonus, top-k,
hidden) moves through the future map inside the graph.

Padded lanes carry row -1: the body maps them to row 0 and slot 0 (both reserved) with
length FILL and zero draft state, rewritten on every replay (C06), and zero coins.
Batches above the largest size take the per-phase path. On CPU the "graph" is the body
run on the same padded rows buffer, so CPU tests drive the same padding path.

A variant is (processed, logprobs, sampled, filtered): whether the body applies the
rows' logit processing (actors/sampling/processing_table.py: read by row on the device, so it
needs no host input), computes the emitted tokens' logprobs (MAX_TOP alternatives), and
samples: each row with temperature > 0 in the processing table accepts by tree rejection
sampling on its processed distribution with its coins, the others by the greedy walk,
both run on every row and merged by row. `filtered` adds the top-k/top-p/min-p
truncation, whose sort over all B*N*V node logits is most of the sampling's cost, so a
sampled batch without any truncating row takes the variant without it (the plan's
lists tell the host which; both give the same tokens for such a batch). Each captured
variant is a graph per size, all in one pool (replays never overlap): with
attention.feature_graphs, the four greedy variants and eight sampled ones (the 2 x 2
processed/logprobs combinations, sampled unfiltered or filtered), twelve per size, where a
sampled batch used to leave the graph for the per-phase path. The memory the pool holds
beyond one graph's working set is each graph's outputs (a few [bs, S+1] tensors, with
logprobs [bs, S+1, MAX_TOP] twice); the cost is capture time at start-up. The verify
part's logits, the one large output, go to the EagleWorker's verify_logits, one buffer
for every size.

Grammars need the host in the middle of an iteration: their masks are walked over the
drafted tree on the host while the target verifies it. For them (``mask_words``) the
iteration is also captured in three parts, chained through the parts' static outputs:
draft (draft decode and tree), verify, and accept (processing, the masks from a static
buffer the host fills, the accept, draft extend, the store), one accept graph per
variant, sampled ones included; the host walks between the first two replays' ends.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from actors.graphs.cuda_graph_runner import EagerGraph, capture_cuda_graph, padded_size
from actors.worker.host_copy import to_device
from actors.sampling.step_coins import StepCoins


class Variant(NamedTuple):
    processed: bool = False
    logprobs: bool = False
    sampled: bool = False
    filtered: bool = False  # with sampled: top-k/top-p/min-p truncation


class StepGraph:
    def __init__(self, eagle: Any, sizes: list[int], device: torch.device, use_cuda_graph: bool,
                 variants: tuple[Variant, ...] = (Variant(),), mask_words: int = 0):
        """``eagle``: the EagleWorker whose step_body (whole) and step_draft / step_verify /
        step_accept (parts, with ``mask_words`` > 0: int32 words of a grammar mask) it records."""
        self.eagle, self.sizes, self.device = eagle, sorted(set(sizes)), device
        self.use_cuda_graph, self.variants = use_cuda_graph, variants
        M = self.sizes[-1]
        self.rows = torch.full((M,), -1, dtype=torch.int64, device=device)  # [M] int64
        self.coins = StepCoins(M, eagle.N + 1, device)  # [M, N+1]: N node coins, then the final one
        self.masks = None  # [M, N, W] int32, each node's grammar mask (all ones: none)
        if mask_words:
            self.masks = torch.full((M, eagle.N, mask_words), -1, dtype=torch.int32, device=device)
        self.pool = None  # the CUDA graph memory pool, once captured
        self._graphs: dict = {}  # ("whole", variant, bs) / ("draft", bs) / ("verify", bs) / ("accept", variant, bs)

    def pad_size(self, raw_bs: int) -> int | None:
        """The smallest captured size >= raw_bs, or None (too big: the per-phase path)."""
        return padded_size(self.sizes, raw_bs)

    def holds(self, raw_bs: int, variant: Variant) -> bool:
        return variant in self.variants and self.pad_size(raw_bs) is not None

    def holds_parts(self, raw_bs: int, variant: Variant) -> bool:
        return self.masks is not None and self.holds(raw_bs, variant)

    def _forwards(self, bs: int) -> list[tuple[tuple, Callable, Any]]:
        """(key, forward, its input) of every graph of size bs, in capture order. The parts
        read the parts before them from their graphs' outputs (static on a GPU)."""
        e, rows, out = self.eagle, self.rows[:bs], lambda *key: self._graphs[key].output
        coins = self.coins.buffer[:bs]  # [bs, N+1] float32
        whole = [(("whole", v, bs), functools.partial(e.step_body, variant=v, coins=coins), rows)
                 for v in self.variants]
        if self.masks is None:
            return whole
        masks = self.masks[:bs]
        return whole + [(("draft", bs), e.step_draft, rows),
                        (("verify", bs), lambda _: e.step_verify(out("draft", bs), e.verify_logits[:bs * e.N]),
                         None)] + [
            (("accept", v, bs), lambda _, v=v: e.step_accept(out("draft", bs), *out("verify", bs), masks, v, coins), None)
            for v in self.variants]

    def capture(self, pool: Any = None) -> None:
        """Record every graph; in `pool` when given (another step graph's, whose replays
        never overlap these: one rank runs one step at a time)."""
        if not self.use_cuda_graph:
            self._graphs = {key: EagerGraph(f, view) for bs in self.sizes for key, f, view in self._forwards(bs)}
            return
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.pool = pool
        stream = torch.cuda.Stream(self.device)
        self.rows.fill_(-1)  # capture with every lane padded: it writes only row 0 and slot 0
        self.coins.buffer.zero_()
        for bs in reversed(self.sizes):  # largest first: smaller sizes reuse its pool blocks
            for key, f, view in self._forwards(bs):
                self._graphs[key] = capture_cuda_graph(f, view, pool, stream, bs)
        torch.cuda.synchronize(self.device)

    def _load(self, rows: list[int], key: Callable[[int], tuple], bs: int | None = None) -> int:
        """Put ``rows`` padded to ``bs`` (default: the next captured size; under
        dp_attention the group's) into the rows buffer; returns bs."""
        raw = len(rows)
        bs = self.pad_size(raw) if bs is None else bs
        if bs is None or key(bs) not in self._graphs or bs < raw:
            raise ValueError(f"no step graph holds a batch of {raw} (captured {sorted(self._graphs)})")
        self.rows[:bs].copy_(to_device(rows + [-1] * (bs - raw), torch.int64, self.device))
        return bs

    def load_coins(self, coins: np.ndarray, raw_bs: int, bs: int | None = None) -> None:
        """A sampled batch's coins [raw_bs, N+1] (plan.coins), before its run or run_accept
        at size ``bs`` (default: the next captured size)."""
        self.coins.load(coins, self.pad_size(raw_bs) if bs is None else bs)

    def run(self, rows: list[int], variant: Variant = Variant(),
            bs: int | None = None) -> tuple[torch.Tensor, ...]:
        """One iteration for request ``rows`` at captured size ``bs`` (default: the next)
        -> step_body's outputs cut to len(rows) rows: [len(rows), S+2+J] int64, then with
        logprobs their three tensors. Views of the graph's outputs, overwritten by the next
        replay of that graph."""
        bs = self._load(rows, lambda bs: ("whole", variant, bs), bs)
        graph = self._graphs["whole", variant, bs]
        graph.replay()
        return tuple(t[:len(rows)] for t in graph.output)

    def run_draft(self, rows: list[int]):
        """The draft part for request ``rows`` -> its Drafted (all bs lanes, padded ones last)."""
        bs = self._load(rows, lambda bs: ("draft", bs))
        graph = self._graphs["draft", bs]
        graph.replay()
        return graph.output

    def run_verify(self, raw_bs: int) -> None:
        self._graphs["verify", self.pad_size(raw_bs)].replay()

    def run_accept(self, raw_bs: int, variant: Variant) -> tuple[torch.Tensor, ...]:
        """The accept part, after self.masks[:bs] holds the batch's masks -> run's outputs."""
        graph = self._graphs["accept", variant, self.pad_size(raw_bs)]
        graph.replay()
        return tuple(t[:raw_bs] for t in graph.output)

    def wrap_graphs(self, wrap) -> None:
        """Put each graph inside ``wrap(bs, graph)`` (GraphRunner.wrap_graphs); every key
        ends with its size."""
        self._graphs = {key: wrap(key[-1], g) for key, g in self._graphs.items()}
