"""The in-process engine on real SmolLM2 weights (fp32): exactness, batching, KV accounting.
Tests of plumbing rather than of the model's tokens (KV accounting, the worker's slot table,
seeds, detokenizing once) run the 1-layer random model with SmolLM2's tokenizer
(tiny_model), whose steps cost a fraction of SmolLM2's."""
from __future__ import annotations

import pytest
import torch

from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams

from kestrel_testing import assert_greedy_under_reference, assert_same_or_near_tie

BASE = ["draft.enabled=false", "model.dtype=float32", "kv_cache.num_slots=8192",
        "scheduler.max_running_requests=16", "device=cpu"]


def make_engine(worker, tokenizer, *overrides, **kw) -> LLMEngine:
    return LLMEngine(load_config(overrides=BASE + list(overrides)), tokenizer=tokenizer,
                     workers=[worker], **kw)


def greedy(max_tokens=64):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def batch_outputs(plain_chat_outputs):
    """The 8 chat prompts in one batch, greedy, 64 tokens each (conftest.py: shared)."""
    return plain_chat_outputs


@pytest.fixture(scope="module")
def tiny_worker(tiny_model):
    from actors.worker.rank_worker import RankWorker
    return RankWorker(load_config(overrides=BASE + [f"model.path={tiny_model}"]))


def make_tiny_engine(worker, tokenizer, *overrides, **kw) -> LLMEngine:
    return LLMEngine(load_config(overrides=BASE + [f"model.path={worker.cfg.model.path}", *overrides]),
                     tokenizer=tokenizer, workers=[worker], **kw)


def test_greedy_equals_transformers(hf_model, chat_prompts, batch_outputs):
    # Teacher-forced: transformers' logits over prompt + our output, one forward per prompt,
    # must put each of our tokens at their top (up to a near-tie), which is what greedy
    # generation with transformers would check, token by token, at 64 decode steps each.
    for prompt, ours in zip(chat_prompts, batch_outputs):
        assert len(ours) == 64
        assert_greedy_under_reference(hf_model, prompt, ours)


def test_batch_equals_each_alone(fp32_worker, tokenizer, chat_prompts, batch_outputs):
    eng = make_engine(fp32_worker, tokenizer, "kv_cache.prefix_caching=false")
    # mixed lengths: the prompts differ in length by up to ~3x
    assert len({len(p) for p in chat_prompts}) > 4
    # 16 tokens alone (a decode step costs SmolLM2's weights per request; a row that read
    # another's KV or mask goes wrong at once): the batch of 8 must have given each the same.
    for i in (0, 3, 7):
        alone = eng.generate([chat_prompts[i]], greedy(16))[0].output_ids
        assert alone == batch_outputs[i][:16]


def test_free_count_returns_to_start(tiny_worker, tokenizer, chat_prompts):
    eng = make_tiny_engine(tiny_worker, tokenizer)
    sched = eng.schedulers[0]
    start = sched.slots.free_slots
    eng.generate(chat_prompts[:4], greedy(16))
    # the prefix cache keeps some KV, all of it evictable down to the last slot
    assert sched.slots.free_slots + sched.cache.evictable_slots == start
    assert sched.cache.total_slots > 0
    sched.cache.evict(sched.slots.capacity)
    assert sched.slots.free_slots == start == sched.slots.capacity


def test_prefix_cache_computes_only_new_tokens(fp32_worker, tokenizer):
    from serve_app.text.tokenizer import apply_chat_template
    long_system = "You are a meticulous assistant. " * 20
    msgs = lambda q: [{"role": "system", "content": long_system}, {"role": "user", "content": q}]
    first = apply_chat_template(tokenizer, msgs("Name a color."))
    second = apply_chat_template(tokenizer, msgs("Name a fruit."))
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common > 100
    eng = make_engine(fp32_worker, tokenizer)
    eng.generate([first], greedy(8))
    req = eng.generate([second], greedy(16))[0]
    assert req.cached_tokens >= common - 1 and req.cached_tokens <= common
    assert req.computed_prompt_tokens == len(second) - req.cached_tokens
    plain = make_engine(fp32_worker, tokenizer, "kv_cache.prefix_caching=false")
    ref = plain.generate([second], greedy(16))[0]
    assert ref.cached_tokens == 0 and ref.computed_prompt_tokens == len(second)
    assert req.output_ids == ref.output_ids


@pytest.mark.parametrize("overrides", [
    # Long: the third case chunks the prompts too (24 tokens a chunk, each reading the KV
    # of the chunks before), across pages of 4.
    pytest.param(("scheduler.chunked_prefill_size=16",), marks=pytest.mark.long),
    ("kv_cache.page_size=16",),
    ("kv_cache.page_size=4", "scheduler.chunked_prefill_size=24"),
])
def test_chunking_and_paging_do_not_change_tokens(fp32_worker, tokenizer, chat_prompts,
                                                  batch_outputs, overrides):
    # 16 tokens: every chunk's KV is read from the first, and each row's decode crosses a
    # page boundary (of 16 once, of 4 four times).
    eng = make_engine(fp32_worker, tokenizer, *overrides)
    reqs = eng.generate(chat_prompts[:4], greedy(16))
    for r, ref in zip(reqs, batch_outputs):
        assert r.output_ids == ref[:16]
    sched = eng.schedulers[0]
    sched.cache.evict(sched.slots.capacity)
    assert sched.slots.free_slots == sched.slots.capacity


def test_out_of_kv_preempts_and_stays_exact(fp32_worker, tokenizer, chat_prompts, batch_outputs,
                                            hf_model):
    # 8 requests of 52-87 prompt tokens (523 in all) + 24 outputs cannot all fit in 600 slots.
    eng = make_engine(fp32_worker, tokenizer, "scheduler.chunked_prefill_size=64",
                      "model.max_model_len=256", worker_info={"num_slots": 600})
    reqs = eng.generate(chat_prompts, greedy(24))
    sched = eng.schedulers[0]
    assert sched.stats["preemptions"] > 0
    # A resumed request recomputes its KV in one extend instead of token by token, so
    # fp32 rounding may differ: equal, or diverging only at a near-tie.
    for prompt, r, ref in zip(chat_prompts, reqs, batch_outputs):
        assert_same_or_near_tie(hf_model, prompt, r.output_ids, ref[:24])
    sched.cache.evict(sched.slots.capacity)
    assert sched.slots.free_slots == sched.slots.capacity


def test_stop_strings_eos_and_max_tokens(fp32_worker, tokenizer, chat_prompts, batch_outputs):
    eng = make_engine(fp32_worker, tokenizer)
    full = tokenizer.decode(batch_outputs[0])
    stop = full[20:26]
    req = eng.generate([chat_prompts[0]], SamplingParams(max_tokens=64, stop=[stop], ignore_eos=True))[0]
    assert req.finish_reason == "stop" and stop not in req.text and full.startswith(req.text)
    req = eng.generate([chat_prompts[0]], SamplingParams(max_tokens=5))[0]
    assert req.finish_reason == "length" and len(req.output_ids) == 5
    stop_id = batch_outputs[0][3]
    req = eng.generate([chat_prompts[0]], SamplingParams(max_tokens=64, stop_token_ids=[stop_id]))[0]
    assert req.finish_reason == "stop" and req.output_ids == batch_outputs[0][:batch_outputs[0].index(stop_id) + 1]


def test_seeded_sampling_is_reproducible(tiny_worker, tokenizer, chat_prompts):
    eng = make_tiny_engine(tiny_worker, tokenizer)
    p = SamplingParams(max_tokens=32, temperature=1.2, top_p=0.95, top_k=100, seed=123,
                       ignore_eos=True)
    a = eng.generate([chat_prompts[1]], p)[0].output_ids
    b = eng.generate([chat_prompts[1], chat_prompts[2]], [p, p])[0].output_ids
    assert a == b  # same seed, same tokens, whatever else is in the batch
    # ... and however its prompt was chunked (other prompts share the prefill budget)
    chunked = make_tiny_engine(tiny_worker, tokenizer, "scheduler.chunked_prefill_size=16")
    c = chunked.generate([chat_prompts[2], chat_prompts[1]], [p, p])[1].output_ids
    assert c == a
    others = [eng.generate([chat_prompts[1]], SamplingParams(
        max_tokens=32, temperature=1.2, seed=s, ignore_eos=True))[0].output_ids for s in (7, 8)]
    assert any(o != a for o in others)  # the seed matters


def test_bad_prompt_is_a_clear_error(fp32_worker, tokenizer):
    eng = make_engine(fp32_worker, tokenizer, "model.max_model_len=64")
    with pytest.raises(ValueError, match="at most 63"):
        eng.add_request(list(range(100)), greedy())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], greedy())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_worker_table_mirrors_scheduler_slots_under_pressure(tiny_worker, tokenizer, chat_prompts):
    """Every step, each live request's req_to_token row on the worker equals the slots the
    scheduler gave it, and no slot is both free and in use (admissions in an extend plan
    that is dropped for lack of KV must still reach the worker)."""
    eng = make_tiny_engine(tiny_worker, tokenizer, "scheduler.chunked_prefill_size=64",
                           "model.max_model_len=256", worker_info={"num_slots": 800})
    sched = eng.schedulers[0]
    for p in chat_prompts:
        eng.add_request(p, greedy(40))
    steps = 0
    while eng.has_work:
        eng.step()
        steps += 1
        free = set(sched.slots._free_pages)  # page size 1: page id == slot id
        for r in sched.prefilling + sched.running:
            row = tiny_worker.req_to_token.req_to_token[r.row, :r.kv_allocated_len]
            assert torch.equal(row, r.slots), f"step {steps}: row of {r.rid} differs from its slots"
            assert not free & set(r.slots.tolist()), f"step {steps}: {r.rid} holds a free slot"
    assert sched.stats["preemptions"] > 0


def test_text_detokenized_once_equals_streamed(tiny_worker, tokenizer, chat_prompts):
    """Without a stream or stop strings the text is decoded once at the end; it must be the
    text a streamed request assembles from its deltas (and the plain decode)."""
    eng = make_tiny_engine(tiny_worker, tokenizer)
    params = SamplingParams(max_tokens=40)
    deltas: list[str] = []
    streamed = eng.add_request(chat_prompts[1], params, on_output=lambda o: deltas.append(o.new_text))
    once = eng.add_request(chat_prompts[1], params)
    while eng.has_work:
        eng.step()
    assert once.output_ids == streamed.output_ids
    assert once.text == streamed.text == "".join(deltas)
    body = once.output_ids[:-1] if once.finish_reason == "stop" else once.output_ids
    assert once.text == tokenizer.decode(body, skip_special_tokens=True)


def test_abort_all_frees_queue_and_running(fp32_worker, tokenizer, chat_prompts):
    # Launching ahead (a GPU's default): abort_all also finishes the step in flight.
    eng = make_engine(fp32_worker, tokenizer, "scheduler.max_running_requests=2",
                      "scheduler.launch_ahead=true")
    reqs = [eng.add_request(p, greedy()) for p in chat_prompts[:5]]
    for _ in range(3):
        eng.step()
    sched = eng.schedulers[0]
    assert sched.running and sched.waiting and eng.launched == 1
    eng.abort_all()
    assert eng.launched == 0
    assert not eng.has_work
    assert all(r.finished and r.finish_reason == "abort" for r in reqs)
    sched.cache.evict(sched.slots.capacity)
    assert sched.slots.free_slots == sched.slots.capacity
