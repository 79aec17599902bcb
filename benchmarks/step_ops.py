"""What a decode step launches from the host outside its graphs, counted on the CPU.

On a GPU each eager device op of a step is a kernel launch the host pays for (about 5-10
us each on the H200 host) and that a CUDA graph replay would have folded into one. That
does not show in CPU timings, where the ops' own compute dominates, so this counts them:
aten ops dispatched while a decode plan runs, less views (no kernel), with what a graph's
eager stand-in runs counted as one op (on a GPU, one replay).

It also finds the host reads of device values in a decode step's launch (`find_host_reads`):
on a GPU each waits for the stream to drain, so the host cannot queue step N+1 while step
N runs (actors/step_channel.py). On a CPU they do not wait, but they dispatch the same ops.
"""
from __future__ import annotations

import contextlib

import torch
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


# aten ops that read a device value on the host: a scalar (item, bool, int, float of a
# tensor; under inference mode the mode sees item and is_nonzero themselves, elsewhere what
# they decompose into), or the data that sizes an output.
_READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "_unique2",
          "unique_dim", "unique_consecutive", "equal"}


def _reads(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in _READS:
        return True
    if name == "repeat_interleave":  # tensor repeats: sized by their sum, unless given
        repeats = args[0] if func._overloadname == "Tensor" else args[1]
        return isinstance(repeats, torch.Tensor) and (kwargs or {}).get("output_size") is None
    if name in ("index", "index_put", "index_put_"):  # a boolean mask index: sized by its count
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in (args[1] or ()) if i is not None)
    return False


class HostReads(TorchDispatchMode):
    """Records, while `watching`, each dispatched op that reads device data on the host;
    Tensor.tolist and Tensor.numpy, which read without dispatching an op on a CPU tensor,
    are recorded by find_host_reads."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.watching = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.watching and _reads(func, args, kwargs):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def find_host_reads(workers):
    """Record, in the yielded HostReads, the host reads of the decode steps `workers`
    (RankWorkers) launch in the block (RankWorker.launch; `finish` reads the tokens by
    design), outside graph replays (EagerGraph.replay: a captured graph cannot read)."""
    reads = HostReads()
    replay, tolist, numpy = EagerGraph.replay, torch.Tensor.tolist, torch.Tensor.numpy

    def paused(graph):
        reads.watching, was = False, reads.watching
        try:
            return replay(graph)
        finally:
            reads.watching = was

    def recorded(method, name):
        def read(t, *args, **kwargs):
            if reads.watching:
                reads.reads.append(name)
            return method(t, *args, **kwargs)
        return read

    def watched(launch):
        def run(plan):
            reads.watching = plan.mode == "decode"
            try:
                return launch(plan)
            finally:
                reads.watching = False
        return run

    EagerGraph.replay = paused
    torch.Tensor.tolist, torch.Tensor.numpy = recorded(tolist, "Tensor.tolist"), recorded(numpy, "Tensor.numpy")
    for w in workers:
        w.launch = watched(w.launch)
    try:
        with reads:
            yield reads
    finally:
        EagerGraph.replay = replay
        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
        for w in workers:
            del w.launch  # the class's method again
