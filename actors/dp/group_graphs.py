"""CUDA graphs under dp_attention: one forward mode and one padded size for the group.

As in SGLang, each rank's step sync row says whether the rank can replay a graph
(`can_run_graph`: its step is a decode, plain or speculative, whose batch fits a captured
size; an idle rank always can). When every row says so, the group replays the graphs of
one captured size, the next at or above the largest rank's batch (actors/dp/step_phases.py
`graph_step`): each busy rank its own batch padded to it, each idle rank all lanes
padded, so the collectives inside the captured forwards have the same shapes on every
rank and pair. Any other step (a prefill on some rank, a batch above the largest size)
runs eagerly on every rank: a prefill's shapes are its own, and a captured collective
must not meet an eager one of another size.

Graphs are captured here rather than at the worker's start-up: their forwards hold the
sharded layers' collectives, so every rank captures once the group has formed, the same
sizes in the same order (the warm-up runs before each capture execute the collectives).
Each captured graph then replays through :class:`PhasedGraph`, which takes the step's
phases the graph holds (actors/dp/attention_group.py `replay_graph`). Prefill chunks run
eagerly here (no prefill graphs): the sync row does not carry a chunk length on which
the ranks could agree.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from actors.graphs.cuda_graph_runner import EagerGraph, GraphKind
from actors.dp.attention_group import DPAttentionGroup
from actors.dp.step_phases import (DRAFT_EXTEND, TARGET, GraphStep, Phase, graph_phases,
                                   is_draft_decode)
from actors.worker.forward_batch import ForwardMode
from actors.worker.rank_worker import RankWorker
from actors.protocol.step_plan import StepPlan

log = logging.getLogger("kestrel.worker")

# The phases of a step that each kind of graph holds (the step graph: all of them).
_HOLDS = {GraphKind.TARGET_DECODE: lambda name: name == TARGET,
          GraphKind.TARGET_VERIFY: lambda name: name == TARGET,
          GraphKind.DRAFT_DECODE: is_draft_decode,
          GraphKind.DRAFT_EXTEND: lambda name: name == DRAFT_EXTEND,
          None: lambda name: True}


class PhasedGraph:
    """One captured graph (or its eager stand-in) of a size, and the phases it holds."""

    def __init__(self, graph: Any, phases: list[Phase], dp: DPAttentionGroup):
        self.graph, self.phases, self.dp = graph, phases, dp

    @property
    def output(self) -> Any:
        return self.graph.output

    def replay(self) -> None:
        self.dp.replay_graph(self.phases, self.graph.replay,
                             runs_python=isinstance(self.graph, EagerGraph))


class GroupGraphs:
    def __init__(self, worker: RankWorker, dp: DPAttentionGroup):
        self.w, self.dp = worker, dp

    def capture(self, sizes: list[int], use_cuda_graph: bool | None = None) -> None:
        """Capture every graph the worker replays alone (but prefill's) for `sizes`, on
        every rank at once; on CPU (use_cuda_graph None) the eager stand-in, which runs
        the same padded batches through the collectives at each replay."""
        w, dp = self.w, self.dp
        t0 = time.time()
        with dp.capturing():
            w.capture_decode_graphs(sizes, use_cuda_graph)  # sets w.decode_graphs
            if w.eagle is not None:
                w.eagle.capture_graphs(sizes, use_cuda_graph=use_cuda_graph)
        w.compiles.take_seconds()  # compiled at start-up: no stall of a step
        # Plain decode graphs are captured under speculation too, as alone (never replayed).
        self._wrap(w.decode_graphs, ForwardMode.DECODE, GraphKind.TARGET_DECODE)
        if w.eagle is not None:
            g = w.eagle.graphs
            for runner in (g.verify, g.draft_decode, g.draft_extend):
                if runner is not None:
                    self._wrap(runner, ForwardMode.TARGET_VERIFY, runner.kind)
            if w.eagle.step_graph is not None:
                self._wrap(w.eagle.step_graph, ForwardMode.TARGET_VERIFY, None)
        dp.graph_sizes = list(w.decode_graphs.sizes)
        w.group_graph_size = lambda: None if dp.graph is None else dp.graph.bs
        log.info("rank %d: dp_attention graphs for batch sizes %s in %.1fs%s", w.rank,
                 dp.graph_sizes, time.time() - t0,
                 "" if w.decode_graphs.use_cuda_graph else " (eager stand-in)")

    def _wrap(self, runner: Any, mode: ForwardMode, kind: GraphKind | None) -> None:
        holds = _HOLDS[kind]
        draft = self.dp.draft if mode == ForwardMode.TARGET_VERIFY else None
        runner.wrap_graphs(lambda bs, graph: PhasedGraph(
            graph, [p for p in graph_phases(GraphStep(mode, bs), draft) if holds(p.name)],
            self.dp))

    def can_run(self, plan: StepPlan) -> bool:
        """This rank's `can_run_graph` for a busy plan: a decode whose batch a graph holds."""
        w = self.w
        if plan.mode != "decode":
            return False
        runner = w.eagle.graphs.verify if w.eagle is not None and plan.use_spec else w.decode_graphs
        return runner.pad_size(len(plan.rows)) is not None

    def replay_idle(self, graph: GraphStep) -> None:
        """A rank with no work in a graph step replays the step's graphs at its size, every
        lane padding (row 0, slot 0, FILL lengths: docs/design.md, "CUDA graphs")."""
        w = self.w
        if graph.mode == ForwardMode.DECODE:
            w.decode_graphs.replay_all_padded(graph.bs)
            return
        e = w.eagle
        if e.step_graph is not None:  # one replay holds the whole iteration
            e.step_graph.run([], bs=graph.bs)
            return
        for runner in (e.graphs.draft_decode, e.graphs.verify, e.graphs.draft_extend):
            if runner is not None:
                runner.replay_all_padded(graph.bs)
