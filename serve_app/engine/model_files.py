"""The model's files on the node a replica starts on.

Every node that runs Engine replicas reads model.path (and draft.path) from its own disk:
nothing is copied between nodes. A replica whose node lacks them fails at once with an
error that names the path and the node, before it starts any actor; left to the rank
actors, the failure came back as a model loader's error from inside a Ray actor.
"""
from __future__ import annotations

import os

from configs.schema import KestrelConfig


class ModelFilesMissing(RuntimeError):
    pass


def check_model_files(cfg: KestrelConfig, node: str) -> str:
    """The target's path on this node; ModelFilesMissing if it (or the draft head) is not
    there. `node` names this node in the message."""
    from actors.models.loader import default_model_path
    hint = ("every node that runs replicas needs the model files at that path (docs/serve.md, "
            "\"Models on a cluster\")")
    try:
        path = cfg.model.path or default_model_path()
    except FileNotFoundError as e:
        raise ModelFilesMissing(f"node {node}: {e}; {hint}") from None
    missing = [p for p in (path, cfg.draft.path if cfg.draft.enabled else None)
               if p and p != "random" and not os.path.exists(p)]
    if missing:
        raise ModelFilesMissing(f"node {node} has no {' and no '.join(map(repr, missing))}: {hint}")
    return path
