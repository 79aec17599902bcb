"""Progress of graph capture, which takes a while with every batch size captured.

One per process (a rank captures its graphs one after another): `capture_cuda_graph`
ticks it for each graph recorded; it logs how far it has got every few seconds, and the
rank reads the count and time at the end for its start-up summary. While the memory
profile runs (actors/worker/memory_profile.py) it also records the device memory each
graph took, by batch size.
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
        self._device = None  # the device whose memory is tracked, or None
        # batch size -> (device bytes its graphs took, bytes they keep allocated)
        self._bytes: dict[int, tuple[int, int]] = {}

    def reset(self) -> None:
        self.graphs = 0
        self._t0 = self._last_log = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._t0

    def track_memory(self, device) -> None:
        """Record each graph's device memory from now on (None: stop)."""
        self._device, self._bytes = device, {}

    def free_before(self) -> tuple[int, int] | None:
        """(the device's free bytes, this process's allocated bytes) now, where memory is
        tracked (a capture's start)."""
        if self._device is None:
            return None
        import torch
        return torch.cuda.mem_get_info(self._device)[0], torch.cuda.memory_allocated(self._device)

    def bytes_per_size(self) -> dict[int, tuple[int, int]]:
        """Batch size -> (device bytes its graphs took, bytes they keep allocated): a graph
        keeps its outputs; what it freed stays in the pool for the next graph to reuse."""
        return dict(self._bytes)

    def tick(self, size: int | None = None, before: tuple[int, int] | None = None) -> None:
        """One graph recorded, of batch `size`, captured from when `before` was read."""
        if before is not None and size is not None:
            free, allocated = self.free_before()
            dev, kept = self._bytes.get(size, (0, 0))
            self._bytes[size] = (dev + before[0] - free, kept + allocated - before[1])
        self.graphs += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.info("capturing graphs: %d so far in %.0fs", self.graphs, now - self._t0)


PROGRESS = CaptureProgress()
