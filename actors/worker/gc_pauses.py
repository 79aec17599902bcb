"""The garbage collector's passes: a full one stops its process while it walks the heap.

A rank's process holds some 300,000 tracked objects once started (torch, the model, the
graphs, Ray); a full (generation 2) pass walks all of them: 110 ms on the development
CPU, and the step loop waits behind it, so every stream stops at once. A burst of
requests makes enough long-lived objects to set one off. `freeze_heap` at the end of
start-up moves what is alive then out of the collector's sight (gc.freeze), so later
passes walk only what serving made since (vLLM freezes its engine's heap likewise).
`GcPauses` times the passes that remain: a step reports them as its `gc` phase, and in
a serving process (`serving`) a long one is logged.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time

log = logging.getLogger("kestrel.gc")

LOG_MS = 20.0  # passes at least this long are logged


def freeze_heap(who: str) -> None:
    """Collect what start-up left behind, then freeze the rest (once start-up is done:
    what is frozen is never collected, cycles included)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    if _watch is not None:
        _watch.seconds = 0.0  # start-up's collection is no pause of serving
    log.info("%s: %d objects frozen out of the collector's passes (%.0f ms)", who,
             gc.get_freeze_count(), 1000 * (time.perf_counter() - t0))


class GcPauses:
    """The collector's time in this process since the last take (gc.callbacks are the
    process's: one watch per process, `watch()`)."""

    def __init__(self) -> None:
        self.seconds = 0.0  # not yet taken
        self.full = 0  # generation-2 passes seen
        self.log_long = False  # log passes of LOG_MS or more (serving processes)
        self._t0 = 0.0

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        if info["generation"] == 2:
            self.full += 1
        if self.log_long and dt * 1000 >= LOG_MS:
            log.warning("a generation-%d garbage collection held this process %.0f ms "
                        "(%d objects collected)", info["generation"], 1000 * dt, info["collected"])

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


_watch: GcPauses | None = None


def watch() -> GcPauses:
    """This process's watch, installed on first use."""
    global _watch
    if _watch is None:
        _watch = GcPauses()
        gc.callbacks.append(_watch._on)
    return _watch


def serving(who: str, freeze: bool) -> None:
    """The end of a serving process's start-up: freeze its heap (serve.gc_freeze) and log
    the long passes from now on."""
    if freeze:
        freeze_heap(who)
    watch().log_long = True


@contextlib.contextmanager
def frozen_heap(who: str, freeze: bool):
    """A benchmark's in-process engine run as a serving process runs (serve.gc_freeze): the
    heap frozen for the block, then unfrozen, because a frozen object is never collected,
    cycles included, and a second engine in the same process would find the first still
    holding its GPU memory."""
    if freeze:
        freeze_heap(who)
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


def stats() -> dict[str, int]:
    """This process: objects frozen, and the full passes the watch has seen."""
    return {"frozen": gc.get_freeze_count(), "full_passes": _watch.full if _watch else 0}
