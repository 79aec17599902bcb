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
"""
from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

from actors.spec.step_graph import StepGraph, Variant

COST_REPEATS = 5  # replays timed per shape and size (the median is kept)


def shape_view(eagle: Any, steps: int, nodes: int) -> Any:
    """An EagleWorker drafting `steps` steps into a tree of `nodes` nodes (root included)
    with the same top-k, sharing all of `eagle`'s state; its graphs are its own."""
    view = copy.copy(eagle)
    view.S, view.N = steps, nodes
    view.graphs = view.step_graph = None  # the configured shape's runners do not fit it
    view.shapes = [view]
    return view


def step_costs(graph: StepGraph) -> list[float]:
    """Seconds of one greedy iteration replayed as `graph` at each of its sizes, every lane
    padded (rows -1 read row 0 and write slot 0, both reserved), timed by the device's
    clock: what a step of that shape costs at that batch size."""
    costs = []
    for bs in graph.sizes:
        graph.run([], Variant(), bs)  # warm: the first replay after capture uploads the graph
        times = []
        for _ in range(COST_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.run([], Variant(), bs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        costs.append(statistics.median(times))
    return costs
