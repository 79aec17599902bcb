"""Host tensors into device memory through two small pinned buffers, chunk by chunk.

Copies from pageable memory go through the driver's own bounce buffer at a fraction of the
link's speed, and pinning each whole tensor would double its host footprint. Two fixed
pinned buffers instead: while one chunk crosses the link, the next is packed into the other.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 64 << 20


class PinnedStaging:
    def __init__(self, device: torch.device | str, chunk_bytes: int = CHUNK_BYTES):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        if self.cuda:
            self._bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
                          for _ in range(2)]  # [chunk_bytes] uint8 each, pinned
            self._done = [None, None]  # the event after the last copy out of each buffer
            self._next = 0

    @torch.no_grad()
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (on the device, contiguous: a parameter or a row slice of one) <- src (host),
        cast to dst's dtype on the device."""
        if not self.cuda or src.device.type != "cpu":
            dst.copy_(src)
            return
        src = src.contiguous().view(-1)
        out = dst.view(-1)
        per_chunk = self.chunk_bytes // src.element_size()
        for start in range(0, src.numel(), per_chunk):
            n = min(per_chunk, src.numel() - start)
            i = self._next
            self._next ^= 1
            if self._done[i] is not None:
                self._done[i].synchronize()  # the buffer's previous chunk has left it
            stage = self._bufs[i][:n * src.element_size()].view(src.dtype)  # [n] pinned
            stage.copy_(src[start:start + n])
            out[start:start + n].copy_(stage, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))  # the stream the copy went on
            self._done[i] = ev

    def finish(self) -> None:
        """Wait for the copies in flight (the source tensors may be freed after this)."""
        if self.cuda:
            for ev in self._done:
                if ev is not None:
                    ev.synchronize()
