"""Overlap: dispatching step N+1 before processing step N, and launching it on the worker
before step N has finished (scheduler.launch_ahead, as the served engine runs and the
in-process one on a GPU), gives the same tokens as one step at a time, with chunked prefills in flight and
requests joining mid-run, plain and speculative, greedy, sampled and with logprobs."""
import pytest

from serve_app.engine.request import SamplingParams
from spec_helpers import CHAIN, TREE, outputs, random_prompts, tiny_engine


SEQUENTIAL = "scheduler.launch_ahead=false"  # the reference: one step at a time
AHEAD = "scheduler.launch_ahead=true"  # on the CPU too, where the in-process default is not to


def _params(i: int) -> SamplingParams:
    kinds = [dict(), dict(temperature=0.9, seed=11 + i), dict(logprobs=2)]
    return SamplingParams(max_tokens=20, ignore_eos=True, **kinds[i % 3])


@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_two_steps_launched_ahead_equal_sequential(tiny_llama_dir, shape):
    spec = shape is not None
    ov = shape or ()
    prompts = random_prompts(8, seed=2)
    params = [_params(i) for i in range(len(prompts))]
    chunk = "scheduler.chunked_prefill_size=16"  # a sampled request draws coins per chunk
    want = tiny_engine(tiny_llama_dir, *ov, chunk, SEQUENTIAL, spec=spec).generate(prompts, params)
    eng = tiny_engine(tiny_llama_dir, *ov, chunk, AHEAD, spec=spec)
    sched = eng.schedulers[0]
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts[:3], params)]
    steps, overlapped = 0, 0
    while eng.has_work:
        eng.step()
        overlapped += eng.launched == 1  # N+1 was launched before N finished
        steps += 1
        if steps == 3:
            reqs += [eng.add_request(p, sp) for p, sp in zip(prompts[3:], params[3:])]
    assert overlapped > 5
    assert [r.output_ids for r in reqs] == [r.output_ids for r in want]
    for got, ref in zip(reqs, want):
        assert [lp[0] for lp in got.token_logprobs] == pytest.approx([lp[0] for lp in ref.token_logprobs], abs=5e-5)
    assert sched.slots.free_slots + sched.cache.evictable_slots == sched.slots.capacity


@pytest.mark.parametrize("shape", [None, TREE], ids=["plain", "tree"])
def test_preemption_with_two_steps_in_flight(tiny_llama_dir, shape):
    """Short KV: requests are preempted (and requeued) while a step of theirs is in flight,
    and readmitted, on the same row, before its output comes back. That output is stale:
    it must not count towards the readmitted request (it did: a prefill then held more
    committed tokens than slots)."""
    spec = shape is not None
    ov = (*(shape or ()), "model.max_model_len=160")
    prompts = [p * 3 for p in random_prompts(6, seed=3)]
    ref = outputs(tiny_engine(tiny_llama_dir, *ov, SEQUENTIAL, spec=spec), prompts, 16)
    eng = tiny_engine(tiny_llama_dir, *ov, "scheduler.chunked_prefill_size=16",
                      "kv_cache.num_slots=200", AHEAD, spec=spec)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
    overlapped = 0
    while eng.has_work:
        eng.step()
        overlapped += eng.launched == 1
    assert overlapped > 5 and eng.schedulers[0].stats["preemptions"] > 0
    assert [r.output_ids for r in reqs] == ref
