"""Overlap: dispatching step N+1 before processing step N (as the Serve engine does) gives
the same tokens as the one-at-a-time loop, with chunked prefills in flight and requests
joining mid-run, plain and speculative."""
from collections import deque

import pytest

from spec_helpers import CHAIN, TREE, greedy, outputs, random_prompts, tiny_engine


@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_two_steps_in_flight_equal_sequential(tiny_llama_dir, shape):
    spec = shape is not None
    ov = shape or ()
    prompts = random_prompts(8, seed=2)
    ref = outputs(tiny_engine(tiny_llama_dir, *ov, spec=spec), prompts, 20)
    eng = tiny_engine(tiny_llama_dir, *ov, "scheduler.chunked_prefill_size=16", spec=spec)
    sched, worker = eng.schedulers[0], eng.workers[0]
    reqs = [eng.add_request(p, greedy(20)) for p in prompts[:3]]
    inflight, steps, overlapped = deque(), 0, 0
    while sched.has_work or inflight:
        while len(inflight) < 2:
            plan = sched.schedule()
            if plan is None:
                break
            inflight.append((plan, worker.execute(plan)))
        overlapped += len(inflight) == 2
        plan, out = inflight.popleft()
        sched.process_output(plan, out)
        steps += 1
        if steps == 3:
            reqs += [eng.add_request(p, greedy(20)) for p in prompts[3:]]
    assert overlapped > 5
    assert [r.output_ids for r in reqs] == ref
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
    ref = outputs(tiny_engine(tiny_llama_dir, *ov, spec=spec), prompts, 16)
    eng = tiny_engine(tiny_llama_dir, *ov, "scheduler.chunked_prefill_size=16",
                      "kv_cache.num_slots=200", spec=spec)
    sched, worker = eng.schedulers[0], eng.workers[0]
    reqs = [eng.add_request(p, greedy(16)) for p in prompts]
    inflight = deque()
    while sched.has_work or inflight:
        while len(inflight) < 2:
            plan = sched.schedule()
            if plan is None:
                break
            inflight.append((plan, worker.execute(plan)))
        if not inflight:
            continue
        sched.process_output(*inflight.popleft())
    assert sched.stats["preemptions"] > 0
    assert [r.output_ids for r in reqs] == ref
