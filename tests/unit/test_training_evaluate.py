"""Accept length per prompt category from training.evaluate: the grouping agrees with
measuring each category's prompts on their own, with the tiny target and a random head."""
from __future__ import annotations

import json

import pytest
import torch

from actors.models.loader import build_model
from configs.schema import load_config
from training.evaluate import (DEFAULT_SETTINGS, by_category, category_table, eval_acceptance, parse_setting,
                               read_eval_prompts)
from training.export import export_head
from training.train import init_head, make_spec


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_default_settings_include_chain_tree_and_wide_tree():
    shapes = {name: (k, s, n) for name, k, s, n in DEFAULT_SETTINGS}
    assert shapes["chain_k1_s3"] == (1, 3, 4) and shapes["tree_k4_s5_n8"] == (4, 5, 8)
    assert shapes["tree_k8_s8_n32"] == (8, 8, 32)


def test_any_draft_shape_parses_by_name():
    assert all(parse_setting(name) == (name, k, s, n) for name, k, s, n in DEFAULT_SETTINGS)
    assert parse_setting("tree_k4_s5_n16") == ("tree_k4_s5_n16", 4, 5, 16)
    assert parse_setting("chain_k1_s4") == ("chain_k1_s4", 1, 4, 5)
    for bad in ("tree_k4_s5", "chain_k2_s3", "tree_k4_s5_n16x"):
        with pytest.raises(ValueError, match="tree_kK_sS_nN"):
            parse_setting(bad)


def test_by_category_means_over_iterations():
    got = by_category(["code", "chat", "code", None], [[1, 3], [2], [4, 4, 4], []])
    assert got == {"chat": {"prompts": 1, "iterations": 1, "mean_accept_length": 2.0},
                   "code": {"prompts": 2, "iterations": 5, "mean_accept_length": 3.2},
                   "none": {"prompts": 1, "iterations": 0, "mean_accept_length": None}}


def test_accept_length_per_category_with_engine(tiny_llama_dir, tmp_path):
    target, _ = build_model(tiny_llama_dir, torch.float32, "cpu")
    head = init_head(make_spec(target.arch, "eagle", None), target, None, seed=3)
    export_head(head, tmp_path / "head", torch.float32)
    cfg = load_config(overrides=[f"model.path={tiny_llama_dir}", "model.dtype=float32", "device=cpu",
                                 "kv_cache.num_slots=4096", "scheduler.max_running_requests=8"])
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (5,), generator=g).tolist() for _ in range(6)]
    cats = ["chat", "code", "math", "code", "chat", "code"]
    settings = [s for s in DEFAULT_SETTINGS if s[0] == "chain_k1_s3"]  # each setting is an engine
    kw = dict(tokenizer=None, settings=settings, max_tokens=12, baseline=False, progress=False)
    res = eval_acceptance(cfg, str(tmp_path / "head"), prompts, categories=cats, **kw)
    for name, _, _, _ in settings:
        row = res["settings"][name]
        groups = row["by_category"]
        assert set(groups) == {"chat", "code", "math"}
        assert [groups[c]["prompts"] for c in ("chat", "code", "math")] == [2, 3, 1]
        assert sum(c["iterations"] for c in groups.values()) == row["iterations"]
    # the code prompts measured alone give the code row (greedy: the same outputs)
    code = [p for p, c in zip(prompts, cats) if c == "code"]
    alone = eval_acceptance(cfg, str(tmp_path / "head"), code, **kw)
    for name, _, _, _ in settings:
        assert res["settings"][name]["by_category"]["code"]["mean_accept_length"] == \
            alone["settings"][name]["mean_accept_length"]
    table = category_table(res).splitlines()
    assert table[0].split() == ["category", "prompts", "chain_k1_s3"]
    assert [line.split()[0] for line in table[1:]] == ["chat", "code", "math", "all"]


def test_read_eval_prompts_from_sample_files(tmp_path):
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "prompt_len": 2, "category": "code"},
            {"input_ids": [9, 10, 11], "loss_mask": [0, 1, 1], "prompt_len": 1, "source": "magpie"}]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, cats = read_eval_prompts(str(path), tokenizer=None)
    assert prompts == [[5, 6], [9]] and cats == ["code", "magpie"]


def test_each_engine_is_gone_before_the_next_is_built(tiny_llama_dir, tmp_path, monkeypatch):
    """On a GPU the next engine's memory profile counts whatever this process still holds as
    its weights: an engine kept alive by the loop left no room for the next one's KV."""
    import gc
    import weakref

    from serve_app.engine import llm_engine
    target, _ = build_model(tiny_llama_dir, torch.float32, "cpu")
    head = init_head(make_spec(target.arch, "eagle", None), target, None, seed=3)
    export_head(head, tmp_path / "head", torch.float32)
    cfg = load_config(overrides=[f"model.path={tiny_llama_dir}", "model.dtype=float32", "device=cpu",
                                 "kv_cache.num_slots=4096", "scheduler.max_running_requests=8"])
    built: list[weakref.ref] = []
    alive_at_build: list[int] = []

    class Counted(llm_engine.LLMEngine):
        def __init__(self, *a, **kw):
            gc.collect()  # what the loop released is collected; what it still holds is not
            alive_at_build.append(sum(r() is not None for r in built))
            super().__init__(*a, **kw)
            built.append(weakref.ref(self))

    monkeypatch.setattr(llm_engine, "LLMEngine", Counted)
    settings = [s for s in DEFAULT_SETTINGS if s[0] in ("chain_k1_s3", "tree_k4_s5_n8")]
    eval_acceptance(cfg, str(tmp_path / "head"), [[5, 6, 7]], tokenizer=None, settings=settings,
                    max_tokens=4, baseline=True, progress=False)
    assert alive_at_build == [0, 0, 0]


def test_each_setting_measures_its_own_shape_alone(tiny_llama_dir, tmp_path, monkeypatch):
    """A setting's mean accept length is its shape's: with adaptive shapes or plain steps
    (a GPU preset's, or the schema's default root-only shape) the policy could take smaller
    shapes on some steps and their accept lengths would count in the mean."""
    from serve_app.engine import llm_engine
    target, _ = build_model(tiny_llama_dir, torch.float32, "cpu")
    head = init_head(make_spec(target.arch, "eagle", None), target, None, seed=3)
    export_head(head, tmp_path / "head", torch.float32)
    cfg = load_config(overrides=[f"model.path={tiny_llama_dir}", "model.dtype=float32", "device=cpu",
                                 "kv_cache.num_slots=4096", "scheduler.max_running_requests=8",
                                 "draft.adaptive_shapes=[[1,1]]", "draft.plain_steps=true"])
    shapes: list = []

    class Seen(llm_engine.LLMEngine):
        def __init__(self, c, *a, **kw):
            shapes.append((c.draft.enabled, c.draft.shapes(), c.draft.plain_steps))
            super().__init__(c, *a, **kw)

    monkeypatch.setattr(llm_engine, "LLMEngine", Seen)
    settings = [s for s in DEFAULT_SETTINGS if s[0] in ("chain_k1_s3", "tree_k4_s5_n8")]
    eval_acceptance(cfg, str(tmp_path / "head"), [[5, 6, 7]], tokenizer=None, settings=settings,
                    max_tokens=4, baseline=False, progress=False)
    assert shapes == [(True, [(1, 3, 4)], False), (True, [(4, 5, 8)], False)]
