"""Draft heads shipped with Kestrel (weights as package data, SGLang/EAGLE folder format).

`draft.path: null` with the default target (model.path null) means the head trained for
SmolLM2-135M-Instruct here; how it was trained and measured: heads/README.md.
"""
from __future__ import annotations

from pathlib import Path

SMOLLM2_135M_INSTRUCT_EAGLE3 = Path(__file__).parent / "smollm2-135m-instruct-eagle3"


def default_head_path() -> str:
    return str(SMOLLM2_135M_INSTRUCT_EAGLE3)
