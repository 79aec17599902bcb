"""A byte range of a weights file read into fresh memory, not through a memory map.

Pages of a map that have been read stay resident, and counted in the process's memory,
until the whole map goes: a mapped 15 GB checkpoint read tensor by tensor would still end
up entirely resident. A plain read keeps one tensor's bytes, freed when it is dropped.
"""

from __future__ import annotations

from typing import BinaryIO

import numpy as np


def read_range(f: BinaryIO, offset: int, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` (contiguous) with the file's bytes from ``offset``; returns ``out``."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise EOFError(f"{f.name}: file ends {len(view) - done} bytes short of a tensor "
                           f"at offset {offset}")
        done += n
    return out
