"""Host <-> device copies that do not wait for the GPU.

PyTorch's blocking copies (`torch.tensor(values, device=cuda)`, `.to(cuda)`, `.tolist()`)
synchronize the stream. The rank worker queues step N+1 on the GPU while step N still
runs (actors/worker/step_channel.py), so a blocking copy while it queues N+1 would hold the host
until N had finished and the GPU would idle again between steps. Inputs go up through
pinned memory without a wait; outputs come down into pinned memory behind the work that
made them, and only `HostCopy.wait()` blocks, when the step's result is needed.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array as a tensor on `device`, copied without synchronizing."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host if host.device == device else host.to(device)
    # The caching host allocator keeps the pinned block until the copy has run.
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, values) -> None:
    """Host values into the device tensor `dst` (a graph's static buffer), one copy that
    does not synchronize."""
    host = torch.as_tensor(values, dtype=dst.dtype)
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    dst.copy_(host.pin_memory(), non_blocking=True)  # the pinned block is kept as in to_device


class HostCopy:
    """Device tensors on their way to the host, copied in stream order behind the kernels
    that write them (so a later replay that overwrites a graph's output buffer cannot
    change what was copied)."""

    def __init__(self, *tensors: torch.Tensor):
        dev = tensors[0].device
        self.event = None
        if dev.type != "cuda":
            self.host = [t.clone() for t in tensors]  # the next step may overwrite the buffer
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for t in tensors]
        self.event = torch.cuda.Event(enable_timing=True)  # also the step's end on the device clock
        self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host
