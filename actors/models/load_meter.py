"""What one weight load cost: seconds, bytes, and host memory above the process's baseline,
with a progress bar while it runs."""

from __future__ import annotations

import logging
import os
import time

import torch
from tqdm import tqdm

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
        self.bar = tqdm(total=tensors, desc=f"loading {os.path.basename(what)}", unit="tensor",
                        mininterval=2.0, leave=False)

    def tick(self, src: torch.Tensor) -> None:
        self.bytes += src.numel() * src.element_size()
        self.peak = max(self.peak, host_rss())
        self.bar.update(1)

    def close(self) -> dict[str, float]:
        """Totals, also logged: seconds, GB read, GB/s, peak host GB above the baseline."""
        self.bar.close()
        secs = time.perf_counter() - self.t0
        out = {"seconds": secs, "gb": self.bytes / 1e9, "gb_per_s": self.bytes / 1e9 / max(secs, 1e-9),
               "peak_host_gb_above_baseline": (self.peak - self.baseline) / 1e9}
        log.info("loaded %s: %.2f GB in %.1f s (%.2f GB/s), host memory peak %.2f GB above the "
                 "%.2f GB before loading", self.what, out["gb"], secs, out["gb_per_s"],
                 out["peak_host_gb_above_baseline"], self.baseline / 1e9)
        return out
