"""What a decode step launches from the host outside its graphs, counted on the CPU.

On a GPU each eager device op of a step is a kernel launch the host pays for (about 5-10
us each on the H200 host) and that a CUDA graph replay would have folded into one. That
does not show in CPU timings, where the ops' own compute dominates, so this counts them:
aten ops dispatched while a decode plan runs, less views (no kernel), with what a graph's
eager stand-in runs counted as one op (on a GPU, one replay).
"""
from __future__ import annotations

import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

from actors.cuda_graph_runner import EagerGraph


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.steps = 0
        self.counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_decode_ops(workers):
    """Count, in the yielded OpCounter, the ops of the decode steps `workers` (RankWorkers)
    run in the block, outside graph replays (EagerGraph.replay: each stand-in is one replay)."""
    counter = OpCounter()
    replay = EagerGraph.replay

    def paused(graph):
        counter.counting, was = False, counter.counting
        try:
            return replay(graph)
        finally:
            counter.counting = was
            counter.ops += was  # the replay itself: one launch

    def counted(execute):
        def run(plan):
            counter.counting = plan.mode == "decode"
            counter.steps += counter.counting
            try:
                return execute(plan)
            finally:
                counter.counting = False
        return run

    EagerGraph.replay = paused
    for w in workers:
        w.execute = counted(w.execute)
    try:
        with counter:
            yield counter
    finally:
        EagerGraph.replay = replay
        for w in workers:
            del w.execute  # the class's method again
