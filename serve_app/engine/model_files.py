"""The model's files where it is loaded: on the node a replica starts on, or on the machine
`kestrel generate` runs on.

model.path is a path that every such node has (nothing is copied between nodes), or a URI
that each node fetches into its own model.download_dir (model_download.py). local_model
is the one way both the Serve replica and the in-process engine turn the config into local
files: it fetches a URI, then checks that the target (and the draft head) are there, so a
node without them fails at once with an error that names the path (or the URI) and the
node, before it starts any actor; left to the rank actors, the failure came back as a
model loader's error from inside a Ray actor.
"""
from __future__ import annotations

import os

from configs.schema import KestrelConfig


class ModelFilesMissing(RuntimeError):
    pass


def local_model(cfg: KestrelConfig, node: str | None = None) -> tuple[KestrelConfig, str]:
    """(cfg with a URI model.path replaced by its local copy, the target's local path);
    ModelFilesMissing if the URI cannot be fetched or the files are not there. `node` names
    this node in the messages (None: the machine the command runs on)."""
    from actors.models.loader import default_model_path
    where = f"node {node}: " if node else ""
    hint = ("every node that runs replicas needs the model files at that path (docs/serve.md, "
            "\"Models on a cluster\")")
    if cfg.model.path and "://" in cfg.model.path:
        from serve_app.engine.model_download import ModelDownloadError, fetch_model
        try:
            path = fetch_model(cfg.model.path, cfg.model.download_dir)
        except ModelDownloadError as e:
            raise ModelFilesMissing(f"{where}{e}") from None
        cfg = cfg.model_copy(deep=True)
        cfg.model.path = path
    try:
        path = cfg.model.path or default_model_path()
    except FileNotFoundError as e:
        raise ModelFilesMissing(f"{where}{e}" + (f"; {hint}" if node else "")) from None
    missing = ' and no '.join(repr(p) for p in (path, cfg.draft.path if cfg.draft.enabled else None)
                              if p and p != "random" and not os.path.exists(p))
    if missing:
        raise ModelFilesMissing(f"node {node} has no {missing}: {hint}" if node
                                else f"there is no {missing}")
    return cfg, path
