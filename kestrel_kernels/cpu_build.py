"""The CPU kernels' extension (kestrel_kernels/cpu_*.cpp): built once, loaded on first use.

`python -m kestrel_kernels.cpu_build` builds it (make setup does, so a server's start-up
does not); a process that finds it unbuilt builds it on first use, and logs so. Where it
cannot be built (no compiler) or run (a CPU without AVX2, FMA and F16C), load() returns
None and unavailable_reason() says why: the settings that need it are refused.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

__all__ = ["load", "unavailable_reason", "kernels"]

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_SOURCES = [_HERE / f for f in ("cpu_module.cpp", "cpu_q4.cpp", "cpu_attention.cpp", "cpu_layer_ops.cpp",
                                          "cpu_decoder.cpp")]
# Ignored by git (/build/); ninja rebuilds when a source or flag changes.
_BUILD_DIR = Path(os.environ.get("KESTREL_EXT_DIR", _HERE.parent / "build" / "ext"))
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]

_lock = threading.Lock()
_module = None
_error: str | None = None


def _cpu_supports() -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return None  # not Linux: let the compiler and the first call decide
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def load():
    """The extension module, built first where needed; None where it cannot be (the
    reason in unavailable_reason())."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        _error = _cpu_supports()
        if _error is not None:
            return None
        from torch.utils import cpp_extension

        _BUILD_DIR.mkdir(parents=True, exist_ok=True)
        built = any(_BUILD_DIR.glob("kestrel_cpu*.so"))
        if not built:
            log.warning("building the CPU kernels (kestrel_kernels/cpu_*.cpp) into %s: once, "
                        "about a minute", _BUILD_DIR)
        try:
            _module = cpp_extension.load(name="kestrel_cpu", sources=[str(s) for s in _SOURCES],
                                         extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                                         build_directory=str(_BUILD_DIR), verbose=not built)
        except Exception as e:  # no compiler, no ninja, a failed build: the caller refuses
            _error = f"building the CPU kernels failed: {type(e).__name__}: {str(e).strip()[-400:]}"
            log.error("%s", _error)
        return _module


def unavailable_reason() -> str | None:
    """None where the kernels load (building them if needed), else why not."""
    return None if load() is not None else _error


def kernels():
    """The loaded module; RuntimeError where it is unavailable."""
    m = load()
    if m is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {_error}")
    return m


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"kestrel_kernels/cpu_*.cpp: {reason}")
    print(f"kestrel_kernels/cpu_*.cpp: built in {_BUILD_DIR}")
