"""What one weight load cost: seconds, bytes, and host memory above the process's baseline,
with a progress bar while it runs."""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger("kestrel.loader")

_PAGE = os.sysconf("SC_PAGE_SIZE")


def host_rss() -> int:
    """Resident bytes of this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class LoadMeter:
    def __init__(self, what: str, tensors: int):
        self.what = what
        self.baseline = host_rss()
        self.peak = self.baseline
        self.bytes = 0
        self.t0 = time.perf_counter()
        # The peak is sampled at each tensor, while it is held on the host: that is when
        # the load holds the most.
        self.tensors, self.done = tensors, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=tensors, desc=f"loading {os.path.basename(what)}", unit="tensor",
                            mininterval=2.0, leave=False)
        except ImportError:  # a line per tenth instead
            self.bar = None

    def tick(self, src: torch.Tensor) -> None:
        self.bytes += src.numel() * src.element_size()
        self.peak = max(self.peak, host_rss())
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.done * 10 // self.tensors != (self.done - 1) * 10 // self.tensors:
            log.info("loading %s: %d/%d tensors, %.2f GB, %.0f s", self.what, self.done,
                     self.tensors, self.bytes / 1e9, time.perf_counter() - self.t0)

    def close(self) -> dict[str, float]:
        """Totals, also logged: seconds, GB read, GB/s, peak host GB above the baseline."""
        if self.bar is not None:
            self.bar.close()
        secs = time.perf_counter() - self.t0
        out = {"seconds": secs, "gb": self.bytes / 1e9, "gb_per_s": self.bytes / 1e9 / max(secs, 1e-9),
               "peak_host_gb_above_baseline": (self.peak - self.baseline) / 1e9}
        log.info("loaded %s: %.2f GB in %.1f s (%.2f GB/s), host memory peak %.2f GB above the "
                 "%.2f GB before loading", self.what, out["gb"], secs, out["gb_per_s"],
                 out["peak_host_gb_above_baseline"], self.baseline / 1e9)
        return out
