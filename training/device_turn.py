"""Engines in processes that share one GPU take turns.

An engine's memory profile reads the device's free memory, so an engine another process
builds meanwhile (its KV cache: most of its share) is counted as this one's activations
and leaves this one no room for a KV cache. Heads trained side by side on one GPU
(training/smollm2_h200.sh with more heads than GPUs) are evaluated in turns instead.
"""
from __future__ import annotations

import contextlib
import fcntl
import tempfile
from pathlib import Path


def device_key(device: str) -> str | None:
    """The GPU that `device` ("cuda", "cuda:1", "cpu") names, as a name every process
    sees alike (its UUID, whatever CUDA_VISIBLE_DEVICES renumbers); None off the GPU."""
    if not device.startswith("cuda"):
        return None
    import torch
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


@contextlib.contextmanager
def device_turn(key: str | None, lock_dir: str | None = None):
    """Hold `key`'s turn (an exclusive file lock, released when the block ends or the
    process dies) while the block runs; no lock when `key` is None."""
    if key is None:
        yield
        return
    path = Path(lock_dir or tempfile.gettempdir()) / f"kestrel-device-turn-{key}.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
