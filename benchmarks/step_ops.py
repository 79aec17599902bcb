"""What a decode step launches from the host outside its graphs, counted on the CPU.

On a GPU each eager device op of a step is a kernel launch the host pays for (about 5-10
us each on the H200 host) and that a CUDA graph replay would have folded into one. That
does not show in CPU timings, where the ops' own compute dominates, so this counts them:
aten ops dispatched while a decode plan runs, less views (no kernel), with what a graph's
eager stand-in runs counted as one op (on a GPU, one replay).

It also finds the host reads of device values in a decode step's launch (`find_host_reads`):
on a GPU each waits for the stream to drain, so the host cannot queue step N+1 while step
N runs (actors/worker/step_channel.py). On a CPU they do not wait, but they dispatch the same ops.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actors.graphs.cuda_graph_runner import EagerGraph


class StepWatch(TorchDispatchMode):
    """A dispatch mode that looks at ops only while `active`: watch_decode_steps turns it
    on for the decode plans a worker runs and off inside graph replays (`paused`)."""

    def __init__(self):
        super().__init__()
        self.active = False

    @contextlib.contextmanager
    def paused(self):
        """Ops run in the block go unseen; yields whether the watch was active."""
        self.active, was = False, self.active
        try:
            yield was
        finally:
            self.active = was

    def stepped(self) -> None:
        """A decode step begins."""

    def replayed(self, was_active: bool) -> None:
        """A graph replay ran (its ops unseen)."""


@contextlib.contextmanager
def watch_decode_steps(watch: StepWatch, method: str, workers):
    """Yield `watch`, active while each of `workers` (RankWorkers) runs a decode plan through
    its `method` ("execute", "launch") in the block, paused inside graph replays
    (EagerGraph.replay: each eager stand-in is one replay on a GPU)."""
    replay = EagerGraph.replay

    def paused(graph):
        with watch.paused() as was:
            out = replay(graph)
        watch.replayed(was)
        return out

    def watched(step):
        def run(plan):
            watch.active = plan.mode == "decode"
            if watch.active:
                watch.stepped()
            try:
                return step(plan)
            finally:
                watch.active = False
        return run

    EagerGraph.replay = paused
    for w in workers:
        setattr(w, method, watched(getattr(w, method)))
    try:
        with watch:
            yield watch
    finally:
        EagerGraph.replay = replay
        for w in workers:
            delattr(w, method)  # the class's method again


class OpCounter(StepWatch):
    def __init__(self):
        super().__init__()
        self.ops = self.steps = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active and not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def stepped(self) -> None:
        self.steps += 1

    def replayed(self, was_active: bool) -> None:
        self.ops += was_active  # the replay itself: one launch


def count_decode_ops(workers):
    """Count, in the yielded OpCounter, the ops of the decode steps `workers` (RankWorkers)
    run in the block, outside graph replays (each stand-in's replay counts as one op)."""
    return watch_decode_steps(OpCounter(), "execute", workers)


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


class HostReads(StepWatch):
    """Records, while `active`, each dispatched op that reads device data on the host;
    Tensor.tolist and Tensor.numpy, which read without dispatching an op on a CPU tensor,
    are recorded by find_host_reads."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active and _reads(func, args, kwargs):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def find_host_reads(workers):
    """Record, in the yielded HostReads, the host reads of the decode steps `workers`
    (RankWorkers) launch in the block (RankWorker.launch; `finish` reads the tokens by
    design), outside graph replays (a captured graph cannot read)."""
    reads = HostReads()
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy

    def recorded(method, name):
        def read(t, *args, **kwargs):
            if reads.active:
                reads.reads.append(name)
            return method(t, *args, **kwargs)
        return read

    torch.Tensor.tolist, torch.Tensor.numpy = recorded(tolist, "Tensor.tolist"), recorded(numpy, "Tensor.numpy")
    try:
        with watch_decode_steps(reads, "launch", workers):
            yield reads
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
