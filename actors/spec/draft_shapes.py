"""Smaller draft shapes an iteration may take instead of the configured one.

At a few streams a step is bound by weight reads and a tree of 8 verified tokens costs
little more than one; at hundreds of streams it is bound by compute, and the same tree
can cost more than the tokens it gains. `draft.adaptive_shapes` lists smaller shapes
(fewer draft steps, fewer verified nodes; [1, 1] is the root alone: a plain decode step
that still runs the draft over the new token, so speculation can resume on the next
step). Each shape is a view of the EagleWorker with its own S and N and everything else
shared (models, KV pools, future map, plan stream), whose iterations replay as their own
step graphs; the rank measures each shape's replay cost per captured batch size at
start-up, and the scheduler's DraftPolicy (serve_app/engine/draft_policy.py) picks a
shape per step from those costs and the accept lengths it sees.

Without step graphs (the CPU, or attention.cuda_graphs off; draft.eager_shapes) a view
runs its iterations eagerly, through the same step code as the configured shape, and the
rank times each shape's eager iteration at a few batch sizes instead (eager_step_costs): on
a CPU a verify of several tokens per request costs little more than one token's at batch 1
(weight reads) but far more at large batches (compute).
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from typing import Any, Callable

import torch

from actors.protocol.step_plan import deepest_accept
from actors.spec.step_graph import StepGraph, Variant

COST_REPEATS = 5  # replays timed per shape and size (the median is kept)
# Eager iterations timed per shape and size, the shapes interleaved round by round so a
# burst of load from other processes falls on all of them; the median is kept, so the
# first round's one-off costs (buffers of a new size) drop out too.
EAGER_COST_ROUNDS = 3
EAGER_COST_SIZES = (1, 2, 4, 8, 16, 32, 64)  # capped at scheduler.max_running_requests

log = logging.getLogger("kestrel.worker")


def shape_view(eagle: Any, steps: int, nodes: int) -> Any:
    """An EagleWorker drafting `steps` steps into a tree of `nodes` nodes (root included)
    with the same top-k, sharing all of `eagle`'s state; its graphs are its own."""
    view = copy.copy(eagle)
    view.S, view.N = steps, nodes
    view.graphs = view.step_graph = None  # the configured shape's runners do not fit it
    view.shapes = [view]
    view.nested_nodes = view.nested_node_counts()
    return view


def replay_costs(replay: Callable[[int], Any], sizes: list[int]) -> list[float]:
    """Seconds of `replay(bs)` at each size, timed by the device's clock (the median of
    COST_REPEATS, after one warm replay: the first after capture uploads the graph)."""
    costs = []
    for bs in sizes:
        replay(bs)
        times = []
        for _ in range(COST_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay(bs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        costs.append(statistics.median(times))
    return costs


def step_costs(graph: StepGraph) -> list[float]:
    """Seconds of one greedy iteration replayed as `graph` at each of its sizes, every lane
    padded (rows -1 read row 0 and write slot 0, both reserved): what a step of that shape
    costs at that batch size."""
    return replay_costs(lambda bs: graph.run([], Variant(), bs), graph.sizes)


def plain_step_costs(worker: Any, sizes: list[int]) -> list[float]:
    """What a plain decode step (draft.plain_steps) costs at each size: the target's decode
    graph replayed with every lane padded, as the shapes' step graphs are timed, and the
    draft's KV written after it (eagerly, as it runs)."""
    def step(bs: int) -> None:
        worker.decode_graphs.replay_all_padded(bs)
        follow_padded(worker, bs)
    return replay_costs(step, sizes)


def follow_padded(worker: Any, bs: int) -> None:
    """EagleWorker.follow_plain_step over `bs` padded lanes: token 0 at position 0, slot 0
    (reserved)."""
    zeros = torch.zeros(bs, dtype=torch.int64, device=worker.device)  # [bs] int64
    worker.eagle.follow_plain_step(zeros, zeros, zeros, worker.plain_features[:bs])


class PlainStep:
    """The plain decode step as eager_step_costs times it beside the shapes' iterations:
    the target's decode of all-padded lanes (row 0 and slot 0, both reserved), the greedy
    pick, and the draft's KV at its position; no draft forward."""

    def __init__(self, worker: Any):
        self.w = worker

    def step_body(self, rows: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros_like(rows)  # [bs] int64: token 0 at position 0, row 0, slot 0
        tokens = self.w._decode_logits(zeros, zeros, zeros, zeros).argmax(-1)
        follow_padded(self.w, rows.numel())
        return tokens


def eager_cost_sizes(max_running: int) -> list[int]:
    """The batch sizes eager step costs are measured at: EAGER_COST_SIZES up to the running
    limit, and the limit itself (a batch between two sizes interpolates, DraftPolicy)."""
    return sorted({b for b in EAGER_COST_SIZES if b < max_running} | {max_running})


def eager_step_costs(shapes: list[Any], sizes: list[int], device: torch.device,
                     rank: int = 0) -> list[list[float]]:
    """Seconds of one greedy eager iteration of each shape (EagleWorker or view) at each
    size -> [shape][size]: step_body on all-padded lanes (rows -1: row 0 and slot 0, both
    reserved), as the graphs are timed, every shape the same way.

    With a PlainStep last: a shape that costs more than its deepest accept (every draft
    taken) is worth in plain steps, at two sizes in a row, is not timed at larger ones
    (infinite: DraftPolicy never takes or explores it there). An eager step's cost grows
    with the batch about as a plain step's does, and the largest sizes take most of the
    timing (a CPU's start-up)."""
    costs = [[0.0] * len(sizes) for _ in shapes]
    plain = len(shapes) - 1 if shapes and isinstance(shapes[-1], PlainStep) else None
    losing = [0] * len(shapes)  # sizes in a row at which each shape lost even at its most
    t0 = time.perf_counter()
    for j, bs in enumerate(sizes):
        rows = torch.full((bs,), -1, dtype=torch.int64, device=device)  # [bs] int64 padded lanes
        timed = [i for i in range(len(shapes)) if losing[i] < 2]
        times: list[list[float]] = [[] for _ in shapes]
        for _ in range(EAGER_COST_ROUNDS):
            for i in timed:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                shapes[i].step_body(rows)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[i].append(time.perf_counter() - start)
        for i in range(len(shapes)):
            costs[i][j] = statistics.median(times[i]) if i in timed else math.inf
        if plain is not None:
            for i in timed:
                if i != plain:
                    deepest = deepest_accept(shapes[i].S, shapes[i].N)
                    losing[i] = losing[i] + 1 if costs[i][j] >= deepest * costs[plain][j] else 0
        log.info("rank %d: eager draft shape step ms at batch %d: %s (%.1fs so far)", rank, bs,
                 [round(1000 * c[j], 1) for c in costs], time.perf_counter() - t0)
    return costs
