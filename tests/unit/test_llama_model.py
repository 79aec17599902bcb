"""Our Llama forward on the real SmolLM2 GGUF against transformers' own GGUF load."""

import pytest
import torch
import torch.nn.functional as F

from actors.models.gguf_loader import permute_rows
from actors.models.loader import build_model, default_model_path
from serve_app.text.tokenizer import apply_chat_template, load_tokenizer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def causal_attn(q, k, v, layer_id):
    """Dense causal attention over one sequence: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # GQA -> MHA
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
    )  # [1, Hq, T, D]
    return o[0].transpose(0, 1)


def varlen_causal_attn(lengths):
    """Causal attention inside each of several concatenated sequences (a flat batch)."""

    def attn(q, k, v, layer_id):
        out, start = [], 0
        for n in lengths:
            s = slice(start, start + n)
            out.append(causal_attn(q[s], k[s], v[s], layer_id))
            start += n
        return torch.cat(out)

    return attn


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
    model, arch = build_model(gguf_path, torch.float32, "cpu")
    return model


# hf_model: transformers' own fp32 load of the same GGUF, the session fixture of
# tests/conftest.py (test_engine.py and the spec tests use it as their reference too).


@pytest.fixture(scope="module")
def prompt_ids(gguf_path):
    return apply_chat_template(load_tokenizer(gguf_path), MESSAGES)


AUX = (2, 15, 27, 30)


@pytest.fixture(scope="module")
def hf_out(hf_model, prompt_ids):
    with torch.no_grad():
        out = hf_model(torch.tensor(prompt_ids)[None], output_hidden_states=True)
    # hidden_states: [embeddings, after layer 0, ..., final normed]; [i] is layer i's input.
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


@pytest.fixture(scope="module")
def ours_out(ours, prompt_ids):
    ids = torch.tensor(prompt_ids)
    with torch.no_grad():
        hidden, aux = ours(ids, torch.arange(len(ids)), causal_attn, aux_layers=AUX)
        return hidden, aux, ours.compute_logits(hidden)


def test_gguf_arch(ours):
    a = ours.arch
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (30, 576, 9, 3, 64)
    assert a.tie_word_embeddings and a.rope_theta == 1e5 and a.rope_scaling is None
    assert a.eos_token_ids == [2] and a.bos_token_id == 1 and a.vocab_size == 49152


def test_gguf_logits_match_transformers(ours_out, hf_out, prompt_ids):
    assert 30 <= len(prompt_ids) <= 60
    logits, ref = ours_out[2], hf_out[0]
    assert logits.dtype == torch.float32 and logits.shape == ref.shape == (len(prompt_ids), 49152)
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, rel
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_aux_layers_are_residual_inputs(ours, ours_out, hf_out):
    aux, ref = ours_out[1], hf_out[1]
    assert len(aux) == len(AUX)
    for i, h in zip(AUX[:-1], aux[:-1]):
        assert torch.allclose(h, ref[i], atol=1e-4, rtol=1e-4), i
    # Index num_layers is the last layer's output before the final norm.
    with torch.no_grad():
        assert torch.allclose(ours.model.norm(aux[-1]), ref[-1], atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.model.norm(aux[-1]), ours_out[0])


def test_flat_batch_equals_separate_runs(ours, ours_out, prompt_ids):
    # Two requests in one flat batch, each with its own positions, attend only within
    # themselves: the result is what each gives alone (up to float summation order).
    a = torch.tensor(prompt_ids)
    b = torch.tensor(prompt_ids[5:17])
    with torch.no_grad():
        hb, _ = ours(b, torch.arange(len(b)), causal_attn)
        flat = torch.cat([a, b])
        pos = torch.cat([torch.arange(len(a)), torch.arange(len(b))])
        hab, _ = ours(flat, pos, varlen_causal_attn([len(a), len(b)]))
        got = ours.compute_logits(hab)
        want = torch.cat([ours_out[2], ours.compute_logits(hb)])
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 2e-5, rel
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_gguf_qk_permutation_is_undone(ours, hf_model):
    # transformers un-permutes llama.cpp's Q/K rows itself; ours must agree row for row, and a
    # loader that skipped the step would be off by exactly llama.cpp's permutation.
    ref = hf_model.state_dict()
    mine = ours.checkpoint_state()
    for i in (0, 29):
        for proj, n_head in (("q_proj", 9), ("k_proj", 3)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            assert torch.equal(mine[name], ref[name]), name
            assert not torch.allclose(permute_rows(mine[name], n_head), ref[name]), name
    v = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(mine[v], ref[v])
