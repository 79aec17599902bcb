"""EAGLE head training on CPU: loss falls, training-time test drafts exactly as the engine
does, export round trip, draft vocabulary, Magpie data with the engine, the CLI, resume."""
from __future__ import annotations

import json
import math

import pytest
import torch
from spec_helpers import FIXED

from actors.models.eagle import load_eagle_head
from actors.models.loader import build_model
from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams
from training.export import export_head
from training.train import Trainer, TrainConfig, init_head, make_spec, unroll
from training.vocab import build_draft_vocab, count_assistant_tokens, coverage, from_d2t

ARCHS = ["eagle", "eagle3"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_cfg(path: str, *extra: str):
    return load_config(overrides=[f"model.path={path}", "model.dtype=float32", "device=cpu",
                                  "kv_cache.num_slots=4096", "scheduler.max_running_requests=32",
                                  "draft.enabled=false", *extra])


@pytest.fixture(scope="module")
def tiny_target(tiny_llama_dir):
    model, _ = build_model(tiny_llama_dir, torch.float32, "cpu")
    return model


@pytest.fixture(scope="module")
def synthetic(tiny_llama_dir) -> list[dict]:
    """32 sequences the tiny target wrote itself with the engine: 4 prompt + 40 output
    tokens, the first 16 greedy (the engine test below replays their prompts), the rest
    sampled at T=1."""
    prompts = _prompts(32, seed=1)
    eng = LLMEngine(tiny_cfg(tiny_llama_dir), load_tokenizer=False)
    params = [SamplingParams(max_tokens=40, temperature=0.0 if i < 16 else 1.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    reqs = eng.generate(prompts, params)
    return [{"input_ids": p + r.output_ids, "loss_mask": [0] * len(p) + [1] * len(r.output_ids),
             "prompt_len": len(p)} for p, r in zip(prompts, reqs)]


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (4,), generator=g).tolist() for _ in range(n)]


# 32 samples in batches of 8: 4 steps an epoch. At 200 steps the loss is down to 0.62
# (EAGLE) and 0.58 (EAGLE-3) of its start (test_loss_falls asks < 0.7), each TTT step's
# accuracy up 0.67-0.77 (asks > 0.2), and the engine agrees with the unrolled head on 8 of
# 8 prompts at 2.5-2.9 tokens a round (asks 7 and 1.5); 300 steps gained little on that.
TRAIN_EPOCHS = 50


def _config(arch: str, **kw) -> TrainConfig:
    base = dict(arch=arch, epochs=TRAIN_EPOCHS, batch_size=8, lr=1e-2, ttt_steps=3, log_every=10, save_every=0)
    base.update(kw)
    return TrainConfig(**base)


def _new_head(arch, target, samples):
    vocab = build_draft_vocab(samples, 128, 64) if arch == "eagle3" else None
    return init_head(make_spec(target.arch, arch, vocab), target, vocab), vocab


@pytest.fixture(scope="module")
def trained(tiny_target, synthetic):
    """Both heads trained for 200 steps; shared by the tests below."""
    out = {}
    for arch in ARCHS:
        head, vocab = _new_head(arch, tiny_target, synthetic)
        res = Trainer(tiny_target, head, _config(arch), vocab).fit(synthetic, progress=False)
        out[arch] = res
    return out


# ---- (a) the loss falls ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_loss_falls(trained, arch):
    res = trained[arch]
    assert res.steps == TRAIN_EPOCHS * 4
    first, last = res.history[0], res.history[-1]
    assert last["loss"] < 0.7 * first["loss"], (first, last)
    assert all(b > a + 0.2 for a, b in zip(first["acc"], last["acc"])), (first["acc"], last["acc"])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_dense_ttt_attention_trains_the_same(tiny_target, synthetic, arch, monkeypatch):
    """--ttt-attention dense: the same loss and gradients as the default, a step apart."""
    import training.train as tt
    calls = []
    dense = tt.ttt_attention_dense
    monkeypatch.setattr(tt, "ttt_attention_dense", lambda *a: calls.append(1) or dense(*a))
    collate = tt.collate
    grads = {}
    for how in ("diagonal", "dense"):
        head, vocab = _new_head(arch, tiny_target, synthetic)
        trainer = Trainer(tiny_target, head, _config(arch, ttt_steps=4, ttt_attention=how), vocab)
        ids, mask, lens = collate(synthetic, list(range(4)), 64, torch.device("cpu"))
        loss, _ = trainer.losses(ids, mask, lens)
        loss.backward()
        grads[how] = (loss.detach(), [p.grad.clone() for p in head.parameters() if p.grad is not None])
    assert len(calls) == 4  # the dense run's four steps, and only its
    torch.testing.assert_close(grads["diagonal"][0], grads["dense"][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads["diagonal"][1], grads["dense"][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_chunked_token_loss_trains_as_the_autograd_path(tiny_target, synthetic, arch, monkeypatch):
    """The trainer's soft_ce (gradient formed in the forward, a few rows at a time) gives
    the loss, the per-step agreement and the gradients of the plain autograd path."""
    import training.soft_ce as sc
    import training.train as tt
    collate = tt.collate
    results = {}
    for how in ("chunked", "reference"):
        if how == "chunked":
            monkeypatch.setattr(tt, "soft_ce", lambda *a: sc.soft_ce(*a, chunk=7))
        else:
            monkeypatch.setattr(tt, "soft_ce", sc.soft_ce_reference)
        head, vocab = _new_head(arch, tiny_target, synthetic)
        trainer = Trainer(tiny_target, head, _config(arch, ttt_steps=3), vocab)
        ids, mask, lens = collate(synthetic, list(range(6)), 64, torch.device("cpu"))
        loss, stats = trainer.losses(ids, mask, lens)
        loss.backward()
        results[how] = (loss.detach(), [int(c) for _, c, _ in stats],
                        [p.grad.clone() for p in head.parameters() if p.grad is not None])
    (loss_a, corr_a, grads_a), (loss_b, corr_b, grads_b) = results["chunked"], results["reference"]
    torch.testing.assert_close(loss_a, loss_b, atol=1e-5, rtol=1e-5)
    assert corr_a == corr_b
    assert len(grads_a) == len(grads_b) > 0
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_hard_targets_score_the_target_argmax_alone(tiny_target, synthetic, arch, monkeypatch):
    """--hard-targets: every step's token loss is taken against a one-hot of the target's
    argmax (among the draft's ids for EAGLE-3), the argmax of the distribution the soft loss
    uses, and the agreement counted is the same."""
    import training.train as tt
    seen = {}
    real = tt.soft_ce

    def spy(x, weight, t_probs, rows, w, dtype, how):
        seen.setdefault(how, []).append(t_probs[rows])
        return real(x, weight, t_probs, rows, w, dtype)
    ids, mask, lens = tt.collate(synthetic, list(range(6)), 64, torch.device("cpu"))
    correct = {}
    for how in ("soft", "hard"):
        monkeypatch.setattr(tt, "soft_ce", lambda *a, how=how: spy(*a, how))
        head, vocab = _new_head(arch, tiny_target, synthetic)
        trainer = Trainer(tiny_target, head, _config(arch, ttt_steps=2, hard_targets=how == "hard"), vocab)
        _, stats = trainer.losses(ids, mask, lens)
        correct[how] = [int(c) for _, c, _ in stats]
    assert correct["soft"] == correct["hard"]
    for soft, hard in zip(seen["soft"], seen["hard"]):
        assert torch.equal(hard.sum(-1), torch.ones(hard.shape[0]))
        assert torch.equal(hard.max(-1).values, torch.ones(hard.shape[0]))  # one-hot rows
        assert torch.equal(hard.argmax(-1), soft.argmax(-1))
        assert not torch.equal(hard, soft)


def test_feature_scale_trains_on_scaled_features_and_folds_into_the_fc(tiny_target, synthetic, tmp_path):
    """feature_scale=rms: features divided per dimension by their RMS (calibrated on the first
    batches, kept across a resume); folded into the fc, the head computes the same losses
    from the target's raw features, which is what the engine feeds it."""
    import training.train as tt
    head, vocab = _new_head("eagle3", tiny_target, synthetic)
    cfg = _config("eagle3", feature_scale="rms", epochs=1, save_every=0)
    trainer = Trainer(tiny_target, head, cfg, vocab)
    state = tmp_path / "state.pt"
    trainer.fit(synthetic, state, progress=False, stop_at=2)
    scale = trainer.feat_scale
    assert scale is not None and scale.shape == (3 * tiny_target.arch.hidden_size,)
    assert float(scale.max() / scale.min()) > 1.5  # dimensions differ: not a no-op
    ids, mask, lens = tt.collate(synthetic, list(range(4)), 64, torch.device("cpu"))
    with torch.no_grad():
        before, stats_before = trainer.losses(ids, mask, lens)
    resumed = Trainer(tiny_target, head, cfg, vocab)
    resumed.load(state)
    torch.testing.assert_close(resumed.feat_scale, scale)
    trainer.fold_feature_scale()
    assert trainer.feat_scale is None
    with torch.no_grad():
        after, stats_after = trainer.losses(ids, mask, lens)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert [int(c) for _, c, _ in stats_after] == [int(c) for _, c, _ in stats_before]


def test_aux_layers_choice(tiny_target):
    L = tiny_target.arch.num_layers
    assert make_spec(tiny_target.arch, "eagle3", None, (0, 1, L)).aux_layers == (0, 1, L)
    with pytest.raises(ValueError, match="three layers"):
        make_spec(tiny_target.arch, "eagle3", None, (0, 1, L + 1))
    with pytest.raises(ValueError, match="EAGLE-3 option"):
        make_spec(tiny_target.arch, "eagle", None, (0, 1, 2))
    with pytest.raises(ValueError, match="EAGLE-3 option"):
        Trainer(tiny_target, init_head(make_spec(tiny_target.arch, "eagle", None), tiny_target, None),
                _config("eagle", feature_scale="rms"))


# ---- training-time test drafts as the engine does ---------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_unrolled_steps_predict_engine_accept_lengths(trained, tiny_target, tiny_llama_dir, tmp_path, arch):
    """Greedy chain drafting (K=1, S=3) in the real engine accepts exactly what the unrolled
    head predicts on the same (teacher-forced) sequence: the pairing of tokens, features,
    positions and attention in training is the engine's."""
    head = trained[arch].head
    export_head(head, tmp_path, torch.float32)
    S = 3
    eng = LLMEngine(tiny_cfg(tiny_llama_dir, "draft.enabled=true", f"draft.path={tmp_path}", "draft.topk=1",
                             f"draft.num_steps={S}", f"draft.num_draft_tokens={S + 1}", *FIXED),
                    load_tokenizer=False)
    prompts = _prompts(8, seed=1)  # greedy training prompts: the head knows them, so it gets accepted
    reqs = eng.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    same = 0
    total_accepts = 0
    for p, r in zip(prompts, reqs):
        seq = torch.tensor([p + r.output_ids])  # [1, T]
        T = seq.shape[1]
        with torch.no_grad():
            hidden, aux = tiny_target(seq[0], torch.arange(T), _causal(T), head.aux_layers)
            feat = torch.cat(aux, -1) if head.eagle3 else hidden
            guesses = [head.topk(h, 1)[1][:, 0] for h in unroll(head, seq, feat, S)]  # S x [T] target ids
        predicted, pos = [], len(p) - 1  # chain p = last prompt position after the prefill
        for _ in r.accept_lengths[:-1]:  # the last round may run past the known tokens
            n = 0
            while n < S and pos + 2 + n < T and int(guesses[n][pos]) == int(seq[0, pos + 2 + n]):
                n += 1
            predicted.append(n + 1)
            pos += n + 1
        same += predicted == r.accept_lengths[:-1]
        total_accepts += sum(r.accept_lengths)
    assert total_accepts > 1.5 * sum(len(r.accept_lengths) for r in reqs), "head accepts too little to test"
    assert same >= 7, "unrolled training steps disagree with the engine's draft"


def _causal(T):
    from training.ttt_attention import CausalAttention
    return CausalAttention(1, T)


# ---- (b) export -> load round trip -------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_export_load_round_trip(trained, tiny_target, tmp_path, arch):
    head = trained[arch].head
    for dtype in (torch.float32, torch.bfloat16):
        out = tmp_path / str(dtype)
        files = export_head(head, out, dtype, max_shard_bytes=40_000)  # forces several shards
        assert len(files) > 1 and (out / "model.safetensors.index.json").exists()
        for f in files:
            from safetensors.torch import load_file
            t = load_file(str(f))
            size = sum(v.numel() * v.element_size() for v in t.values())
            assert size <= 40_000 or len(t) == 1  # only a lone tensor may exceed the limit
        back = load_eagle_head(str(out), tiny_target, "auto", dtype, torch.device("cpu"))
        assert back.spec == head.spec
        want = {k: v.to(dtype) if v.is_floating_point() else v for k, v in head.state_for_export().items()}
        got = back.state_for_export()
        assert want.keys() == got.keys()
        for k in want:
            assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3" if arch == "eagle3" else "LlamaForCausalLMEagle"]
        assert cfg["torch_dtype"] == str(dtype).removeprefix("torch.")
    # published names: SpecForge's for EAGLE-3, the EAGLE repository's (no "model.") for EAGLE-1
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    if arch == "eagle3":
        assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"} <= names
    else:
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
                "layers.0.post_attention_layernorm.weight"} <= names
        assert not any(n.startswith("model.") for n in names)
    one = export_head(head, tmp_path / "single", torch.bfloat16)
    assert [f.name for f in one] == ["model.safetensors"]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_widened_head_computes_what_it_did_and_serves_losslessly(trained, tiny_target, tiny_llama_dir,
                                                                   synthetic, tmp_path, arch):
    """--intermediate-size with --init-head: the narrower head's MLP channels first, the new
    down-projection columns zero, so before training the widened head's held-out loss and
    top-1 per step are the narrow head's; the wider head exports, loads by its config and
    keeps greedy speculative output equal to plain output."""
    from actors.models.eagle import read_head_state
    from training.train import widen_mlp
    narrow = trained[arch].head
    export_head(narrow, tmp_path / "narrow", torch.float32)
    vocab = from_d2t(narrow.d2t.long().cpu(), tiny_target.arch.vocab_size) if arch == "eagle3" else None
    width = 2 * narrow.spec.intermediate_size + 3
    wide = init_head(make_spec(tiny_target.arch, arch, vocab, intermediate_size=width), tiny_target, vocab, seed=5)
    fresh = Trainer(tiny_target, wide, _config(arch), vocab).evaluate(synthetic[:16])
    wide.load_checkpoint_state(widen_mlp(read_head_state(tmp_path / "narrow"), wide))
    before = Trainer(tiny_target, narrow, _config(arch), vocab).evaluate(synthetic[:16])
    after = Trainer(tiny_target, wide, _config(arch), vocab).evaluate(synthetic[:16])
    assert after["acc"] == before["acc"] and after["loss"] == pytest.approx(before["loss"], rel=1e-5)
    assert fresh["loss"] != pytest.approx(before["loss"], rel=1e-2)  # the copy is what made them equal
    with pytest.raises(ValueError, match="widen a head, not narrow"):
        widen_mlp(wide.state_for_export(), narrow)
    export_head(wide, tmp_path / "wide", torch.float32)
    assert load_eagle_head(str(tmp_path / "wide"), tiny_target, "auto", torch.float32,
                           torch.device("cpu")).spec.intermediate_size == width
    prompts = _prompts(4, seed=2)
    outs = []
    for spec in ("draft.enabled=false", "draft.enabled=true"):
        eng = LLMEngine(tiny_cfg(tiny_llama_dir, spec, f"draft.path={tmp_path / 'wide'}", *FIXED),
                        load_tokenizer=False)
        outs.append([r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))])
    assert outs[0] == outs[1]


def test_export_t2d_matches_d2t(trained, tmp_path):
    from safetensors.torch import load_file
    head = trained["eagle3"].head
    export_head(head, tmp_path, torch.bfloat16)
    st = load_file(str(tmp_path / "model.safetensors"))
    d2t, t2d = st["d2t"], st["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.numel() == 128
    assert torch.equal(t2d.nonzero().squeeze(1), d2t + torch.arange(d2t.numel()))


# ---- (c) draft vocabulary ----------------------------------------------------------------------
def test_draft_vocab_mapping_and_coverage():
    # assistant tokens: 50 x7, 9 x5, 30 x3, 3 x1; prompt tokens (mask 0) never count
    samples = [{"input_ids": [99, 99, 99] + [50] * 7 + [9] * 5 + [30] * 3 + [3],
                "loss_mask": [0, 0, 0] + [1] * 16}]
    v = build_draft_vocab(samples, target_vocab_size=100, draft_vocab_size=3)
    assert v.token_ids.tolist() == [9, 30, 50]  # the 3 most frequent, ascending
    assert torch.equal(torch.arange(3) + v.d2t, v.token_ids)  # target id = draft id + d2t
    assert v.t2d.dtype == torch.bool and v.t2d.nonzero().squeeze(1).tolist() == [9, 30, 50]
    assert v.coverage == pytest.approx(15 / 16)
    t2d_index = v.target_to_draft()
    assert t2d_index[[9, 30, 50, 3, 99]].tolist() == [0, 1, 2, -1, -1]
    # ties go to the lower id; always_include comes first
    v2 = build_draft_vocab(samples, 100, 2, always_include=[3])
    assert v2.token_ids.tolist() == [3, 50] and v2.coverage == pytest.approx(8 / 16)
    # fewer distinct assistant tokens than asked: prompt tokens, then low ids fill it
    v3 = build_draft_vocab(samples, 100, 6)
    assert v3.size == 6 and {3, 9, 30, 50, 99} <= set(v3.token_ids.tolist())
    assert v3.coverage == 1.0
    # a loaded head's d2t gives the same vocabulary back
    assert torch.equal(from_d2t(v.d2t, 100).t2d, v.t2d)
    assert coverage(count_assistant_tokens(samples), v.t2d) == v.coverage


# ---- (d) Magpie data with the real engine ---------------------------------------------------------
@pytest.fixture(scope="module")
def wide_vocab_target(tmp_path_factory, tokenizer) -> str:
    """A tiny random Llama over SmolLM2's vocabulary, so its tokens decode with the real tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("wide_vocab")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_user_turn_prefix_smollm2(tokenizer):
    from training.data import user_turn_prefix
    prefix, eot = user_turn_prefix(tokenizer)
    assert eot == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.decode(prefix)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>user\n")


def test_degenerate_filter():
    from training.data import is_degenerate
    assert is_degenerate([5] * 20)
    assert is_degenerate([1, 2, 3, 4, 5, 6] * 30)
    assert not is_degenerate(list(range(200)))
    assert not is_degenerate([7, 7, 7, 1, 2, 3])


def test_in_loop_reads_the_tail_alone():
    from training.data import in_loop, is_degenerate
    diverse = list(range(1000, 1200))
    looping = diverse + [1, 2, 3, 4, 5, 6] * 20  # the answer fell into a loop at its end
    assert in_loop(looping) and is_degenerate(looping)
    assert not in_loop(diverse) and not is_degenerate(diverse)
    early_run = [9] * 20 + diverse  # a run long ago: the end is no loop, the whole is degenerate
    assert not in_loop(early_run) and is_degenerate(early_run)
    assert in_loop(diverse + [9] * 16)


def test_generate_dataset_with_engine(wide_vocab_target, tokenizer):
    from training.data import generate_dataset, user_turn_prefix
    cfg = tiny_cfg(wide_vocab_target, "kv_cache.prefix_caching=true")
    eng = LLMEngine(cfg, tokenizer=tokenizer)
    users = ["Name a color.", "  name a COLOR. ", "Name a fruit."]  # the second is a duplicate
    # a random model almost never ends its user turn: accept unfinished prompts here
    ds = generate_dataset(eng, tokenizer, n_samples=8, max_prompt_tokens=12, max_response_tokens=12,
                          user_prompts=users, require_prompt_end=False, eval_fraction=0.25,
                          seed=3, progress=False)
    rows = ds.train + ds.eval
    assert ds.stats["prompts_duplicate"] >= 1
    assert len(ds.eval) >= 1 and len(ds.train) >= 4
    assert sum(r["source"] == "user" for r in rows) >= 1 and sum(r["source"] == "magpie" for r in rows) >= 1
    assert len({tuple(r["input_ids"]) for r in rows}) == len(rows)  # deduped
    prefix, _ = user_turn_prefix(tokenizer)
    for r in rows:
        n, P = len(r["input_ids"]), r["prompt_len"]
        assert 0 < P < n
        assert r["loss_mask"] == [0] * P + [1] * (n - P)  # assistant tokens only
        assert r["input_ids"][:len(prefix)] == prefix
        assert tokenizer.decode(r["input_ids"][:P]).endswith("<|im_start|>assistant\n")


def test_assistant_mask_marks_earlier_answers(tokenizer):
    from training.data import assistant_mask, render_prompt, user_turn_prefix
    _, eot = user_turn_prefix(tokenizer)
    msgs = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Leaves fall slowly."},
            {"role": "user", "content": "Now make it rhyme."}]
    ids = render_prompt(tokenizer, msgs)
    mask = assistant_mask(tokenizer, msgs, ids, eot)
    assert len(mask) == len(ids)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "Leaves fall slowly.<|im_end|>"
    assert assistant_mask(tokenizer, msgs[:1], render_prompt(tokenizer, msgs[:1]), eot) == \
        [0] * len(render_prompt(tokenizer, msgs[:1]))


def test_category_mix_parsing():
    from training.categories import DEFAULT_MIX, parse_mix
    assert parse_mix("chat=3,code=1") == {"chat": 0.75, "code": 0.25}
    assert abs(sum(parse_mix(DEFAULT_MIX).values()) - 1) < 1e-9
    for bad in ("chat", "poetry=1", "chat=0", "chat=-1,code=2"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_generate_dataset_categories(wide_vocab_target, tokenizer):
    """Seeded prompts carry their category and seed words, multi-turn samples hold two
    answered exchanges with both answers in the loss, contaminated prompts are dropped,
    and the coverage report adds up."""
    from training.categories import SEEDS
    from training.contamination import ContaminationFilter, EvalPromptIndex
    from training.data import generate_dataset
    cfg = tiny_cfg(wide_vocab_target, "kv_cache.prefix_caching=true")
    eng = LLMEngine(cfg, tokenizer=tokenizer)
    index = EvalPromptIndex()
    index.add("Name a color that you like.", "evalset")
    flt = ContaminationFilter(index)
    users = ["name a colour that you like", "Name a fruit you like."]  # the first is an evaluation prompt
    ds = generate_dataset(eng, tokenizer, n_samples=10, max_prompt_tokens=8, max_response_tokens=8,
                          user_prompts=users, user_categories=[None, "chat"],
                          category_mix={"code": 0.5, "multiturn": 0.5}, contamination=flt,
                          require_prompt_end=False, eval_fraction=0.2, seed=5, progress=False)
    rows = ds.train + ds.eval
    assert ds.stats["prompts_contaminated"] >= 1 and ds.stats["contamination"]["dropped_by"]["near:evalset"] == 1
    assert {r["category"] for r in rows} == {"code", "multiturn", "chat"}
    assert sum(r["source"] == "user" for r in rows) == 1
    for r in rows:
        P, mask = r["prompt_len"], r["loss_mask"]
        prompt = tokenizer.decode(r["input_ids"][:P])
        assert prompt.endswith("<|im_start|>assistant\n") and all(mask[P:])
        runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        if r["category"] == "multiturn":
            assert prompt.count("<|im_start|>user\n") == 2 and runs == 2
            assert r["kind"] in {k for c in ("chat", "code", "math") for k in SEEDS[c]}
        else:
            assert prompt.count("<|im_start|>user\n") == 1 and runs == 1
        if r["category"] == "code":
            assert r["kind"].startswith("code/")
            assert any(prompt.split("<|im_start|>user\n", 1)[1].startswith(s) for s in SEEDS["code"][r["kind"]])
    cov = ds.stats["categories"]
    assert sum(c["train"] + c["eval"] for c in cov.values()) == len(rows)
    assert sum(c["assistant_tokens"] for c in cov.values()) == ds.stats["assistant_tokens"]
    assert cov["multiturn"]["train"] + cov["multiturn"]["eval"] >= 1
    # what was left out, per category, adds up to the totals; the contaminated prompt was the
    # user's, without a category
    dropped = ds.stats["dropped_by_category"]
    assert dropped["user"]["prompts_contaminated"] == 1
    reasons = {r for per in dropped.values() for r in per}
    assert reasons and all(sum(per.get(r, 0) for per in dropped.values()) == ds.stats[r] for r in reasons)


def test_join_samples_drops_repeats_and_held_out_prompts():
    from training.data import join_samples

    def row(prompt, response):
        return {"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response),
                "prompt_len": len(prompt)}
    a = [row([1, 2], [3]), row([4], [5, 6])]
    b = [row([1, 2], [3]), row([7], [8]), row([9, 9], [1])]  # a repeat, a new one, a held-out prompt
    held = [row([9, 9], [2])]
    joined = join_samples([a, b], held)
    assert [r["input_ids"] for r in joined] == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert len(join_samples([a, b])) == 4


# ---- the CLI end to end, and resume -------------------------------------------------------------
def test_cli_train_export_eval(tiny_llama_dir, synthetic, tmp_path):
    from training.data import save_jsonl
    from serve_app.cli import main  # `kestrel train-draft ...`, options straight after the subcommand
    half = len(synthetic) // 2  # two files, as two generators write them
    save_jsonl(synthetic[:half], tmp_path / "a.jsonl")
    save_jsonl(synthetic[half:], tmp_path / "b.jsonl")
    out = tmp_path / "head"
    report = main(["train-draft", "--target", tiny_llama_dir, "--arch", "eagle3", "--out", str(out),
                   "--data", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--draft-vocab", "64", "--epochs", "3",
                   "--batch-size", "8", "--lr", "1e-2", "--ttt-steps", "3", "--device", "cpu",
                   "--set", "model.dtype=float32", "--set", "kv_cache.num_slots=4096",
                   "--eval-samples", "4", "--eval-max-tokens", "12"])
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert (out / "train_state" / "state.pt").exists()
    saved = json.loads((out / "report.json").read_text())
    assert saved["draft_vocab"]["size"] == 64 and 0 < saved["draft_vocab"]["train_coverage"] <= 1
    settings = saved["acceptance"]["heldout"]["settings"]
    assert set(settings) == {"no_spec", "chain_k1_s3", "chain_k1_s5", "tree_k4_s5_n8", "tree_k8_s8_n32"}
    for name, row in settings.items():
        if name != "no_spec":
            assert row["mean_accept_length"] >= 1.0
    assert report["train"]["steps"] > 0
    assert report["data"]["train"] + report["data"]["eval"] == len({tuple(r["input_ids"]) for r in synthetic})


def test_resume_continues_bit_exactly(tiny_target, synthetic, tmp_path):
    arch = "eagle3"
    cfg = _config(arch, epochs=2, save_every=3)
    straight, vocab = _new_head(arch, tiny_target, synthetic)
    Trainer(tiny_target, straight, cfg, vocab).fit(synthetic, progress=False)
    state = tmp_path / "state.pt"
    first, _ = _new_head(arch, tiny_target, synthetic)
    Trainer(tiny_target, first, cfg, vocab).fit(synthetic, state, progress=False, stop_at=5)  # "crash"
    second, _ = _new_head(arch, tiny_target, synthetic)
    res = Trainer(tiny_target, second, cfg, vocab).fit(synthetic, state, resume=True, progress=False)
    assert res.steps == 8
    for (k, a), b in zip(straight.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), k


def test_step_budget_is_re_measured_as_training_goes():
    """Slow first steps (compilation) and one slow sample must not cut the run short: the
    fit follows the mean rate since warm-up, up to the planned steps."""
    from training.train import StepBudget
    now = [0.0]
    budget = StepBudget(100.0, clock=lambda: now[0])
    fits = {}
    for done in range(1, 201):
        now[0] += 2.0 if done <= 10 else (0.5 if done <= 20 else 0.1)  # slow warm-up, slow sample
        fit = budget.fit(done, done, planned=10_000)
        if fit is not None:
            fits[done] = fit
    assert 10 not in fits and min(fits) == 20  # nothing fitted before 10 steps past warm-up
    assert fits[20] < 200  # the first estimate believes 0.5 s/step
    # 200 steps took 20 + 5 + 18 = 43 s; the rate since warm-up is (5 + 18) / 190 s.
    assert fits[200] == 200 + int((100 - 43.0) / (23.0 / 190))
    frozen = StepBudget(1e9, clock=lambda: 0.0)
    assert frozen.fit(10, 10, planned=50) is None and frozen.fit(20, 20, planned=50) == 50


def test_a_re_planned_schedule_continues_its_decay(tiny_target, synthetic):
    """Unchanged, the schedule is warm-up then cosine over the planned steps; re-planned at
    step 300 (a time budget's new estimate) the learning rate goes on from where it was,
    never rising, and reaches its floor at the new end."""
    head, _ = _new_head("eagle", tiny_target, synthetic)
    cfg = _config("eagle", lr=1e-3)
    tr = Trainer(tiny_target, head, cfg)
    tr.set_schedule(1000)
    warm = int(cfg.warmup_ratio * 1000)
    for step in (0, warm - 1, warm, 400, 999):
        t = min(1.0, max(0, step - warm) / (1000 - warm))
        want = (cfg.lr * (step + 1) / warm if step < warm else
                cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))))
        assert tr.lr_at(step) == pytest.approx(want)
    before = [tr.lr_at(s) for s in range(300)]
    at_300 = tr.lr_at(300)
    tr.set_schedule(1800, from_step=300)  # the run turned out faster: more steps fit
    after = [tr.lr_at(s) for s in range(300, 1800)]
    assert after[0] == pytest.approx(at_300) and at_300 < before[-1]
    assert all(b <= a + 1e-15 for a, b in zip(before[warm:] + after, before[warm + 1:] + after[1:]))  # never rises
    assert after[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=1e-3)
    at_1000 = tr.lr_at(1000)
    tr.set_schedule(1100, from_step=1000)  # and slower: the end comes sooner
    assert tr.lr_at(1000) == pytest.approx(at_1000) and tr.lr_at(1100) == pytest.approx(cfg.lr * cfg.min_lr_ratio)


def test_answers_in_a_loop_are_stopped_early(wide_vocab_target, tokenizer):
    """A looping answer is cut once the loop shows and dropped, as the filter at its end
    would have dropped it, so the same run generates fewer tokens. (The tiny random
    target loops in every answer.)"""
    from training.data import generate_dataset
    users = [f"Tell me about topic number {i}." for i in range(8)]
    runs = {}
    for window in (24, 1000):  # 1000: past max_response_tokens, so never checked
        eng = LLMEngine(tiny_cfg(wide_vocab_target), tokenizer=tokenizer)
        runs[window] = generate_dataset(
            eng, tokenizer, n_samples=8, max_prompt_tokens=8, max_response_tokens=160, user_prompts=users,
            require_prompt_end=False, greedy_fraction=1.0, eval_fraction=0.0, seed=1, max_prompt_factor=1.0,
            loop_check_tokens=window, loop_check_every=1, progress=False).stats
        assert not eng.has_work  # the stopped requests left nothing behind
    cut, full = runs[24], runs[1000]
    assert full["responses_stopped_in_loop"] == 0 and full["responses_degenerate"] >= 8
    assert cut["responses_stopped_in_loop"] == cut["responses_degenerate"] >= 8
    assert cut["generated_tokens"] < full["generated_tokens"] / 2


def test_feature_stats_measures_the_captured_streams(tiny_target, synthetic):
    from training.ttt_attention import CausalAttention
    from training.feature_stats import stream_stats
    L = tiny_target.arch.num_layers
    samples = [s["input_ids"] for s in synthetic[:3]]
    stats = stream_stats(tiny_target, samples, (0, L))
    assert set(stats) == {0, L}
    with torch.no_grad():
        rows = [tiny_target(torch.tensor(ids), torch.arange(len(ids)), CausalAttention(1, len(ids)), (L,))[1][0][1:]
                for ids in samples]
    x = torch.cat(rows)  # [N, H] the last layer's output, first tokens left out
    assert stats[L]["rms"] == round(float(x.square().mean().sqrt()), 2)
    assert stats[L]["top_dim_rms"][0] >= stats[L]["median_dim_rms"] > 0
