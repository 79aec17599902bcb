"""Progress of graph capture, which takes a while with every batch size captured.

One per process (a rank captures its graphs one after another): `capture_cuda_graph`
ticks it for each graph recorded; it logs how far it has got every few seconds, and the
rank reads the count and time at the end for its start-up summary.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("kestrel.worker")

LOG_EVERY_S = 5.0


class CaptureProgress:
    def __init__(self):
        self.graphs = 0
        self._t0 = self._last_log = time.monotonic()

    def reset(self) -> None:
        self.graphs = 0
        self._t0 = self._last_log = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._t0

    def tick(self) -> None:
        self.graphs += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.info("capturing graphs: %d so far in %.0fs", self.graphs, now - self._t0)


PROGRESS = CaptureProgress()
