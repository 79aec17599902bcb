"""Triton compilations met while serving: each stalls the step that meets it.

A Triton kernel compiles on first launch for each new combination of its constexprs and
of the integer arguments Triton specializes (1, multiples of 16, other). The warm-up at
start-up runs the shapes serving meets, so a compilation after it is a stall a client saw
(0.5-1 s on the H200) and a shape the warm-up missed. Once armed, the watch logs each one
with the kernel's signature and counts the seconds, which the step reports as its
`compile` phase.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kestrel.worker")


class CompileWatch:
    def __init__(self) -> None:
        self.count = 0
        self.kernels: list[str] = []  # signatures of the first compilations (for reports)
        self.seconds = 0.0  # compile seconds not yet taken by `take_seconds`
        self._start: dict[int, float] = {}  # thread id -> when its compile began
        self._armed = False

    def arm(self) -> bool:
        """Start watching (after the warm-up); False where Triton is absent."""
        try:
            from triton import knobs
        except ImportError:
            return False
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after
        self._armed = True
        return True

    @staticmethod
    def pause_all() -> None:
        """Stop whichever watch is armed: the hooks are global to the process, and a new
        worker's start-up compiles (a second engine in a test or benchmark) are no stall."""
        try:
            from triton import knobs
        except ImportError:
            return
        knobs.runtime.jit_cache_hook = None
        knobs.runtime.jit_post_compile_hook = None

    def disarm(self) -> None:
        if not self._armed:
            return
        from triton import knobs
        if knobs.runtime.jit_cache_hook == self._before:
            knobs.runtime.jit_cache_hook = None
            knobs.runtime.jit_post_compile_hook = None
        self._armed = False

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    # Triton calls the cache hook before a compile (a true result would skip it) and the
    # post-compile hook after; both with the kernel's signature as `repr`.
    def _before(self, *, repr: str, **_) -> bool:
        self._start[threading.get_ident()] = time.perf_counter()
        return False

    def _after(self, *, repr: str, **_) -> None:
        t0 = self._start.pop(threading.get_ident(), None)
        dt = time.perf_counter() - t0 if t0 is not None else 0.0
        self.count += 1
        self.seconds += dt
        if len(self.kernels) < 32:
            self.kernels.append(repr)
        log.warning("Triton compiled a kernel while serving (%.0f ms; a shape the warm-up "
                    "missed): %s", 1000 * dt, repr)
