"""scheduler.prefill_min_batch: while requests decode, admissions wait until enough can be
prefilled together (or prefill_max_delay_steps pass). Tokens stay the same; extend steps
become fewer; nobody waits past the delay."""
from spec_helpers import greedy, random_prompts, tiny_engine
from serve_app.engine.request import SamplingParams


def run(engine, prompts):
    """Greedy, staggered lengths so that requests finish one by one."""
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    reqs = engine.generate(prompts, params)
    return [r.output_ids for r in reqs]


def test_batched_admission_same_tokens_fewer_prefills(tiny_llama_dir):
    prompts = random_prompts(16, seed=5)
    base = tiny_engine(tiny_llama_dir, "scheduler.max_running_requests=8", spec=False)
    batched = tiny_engine(tiny_llama_dir, "scheduler.max_running_requests=8",
                          "scheduler.prefill_min_batch=4", spec=False)
    assert run(batched, prompts) == run(base, prompts)
    assert batched.mode_steps["extend"] < base.mode_steps["extend"]


def test_admission_waits_at_most_the_delay(tiny_llama_dir):
    eng = tiny_engine(tiny_llama_dir, "scheduler.max_running_requests=4",
                      "scheduler.prefill_min_batch=4", "scheduler.prefill_max_delay_steps=5",
                      spec=False)
    sched, worker = eng.schedulers[0], eng.workers[0]
    long = [eng.add_request(p, greedy(60)) for p in random_prompts(3, seed=1)]
    short = eng.add_request(random_prompts(1, seed=2)[0], greedy(2))
    while not short.finished:
        eng.step()
    # One row is free and three requests wait: fewer admissible than prefill_min_batch,
    # so they wait, but no longer than the delay.
    late = [eng.add_request(p, greedy(3)) for p in random_prompts(3, seed=3)]
    decodes = 0
    while not late[0].output_ids:
        plan = sched.schedule()
        decodes += plan.mode == "decode"
        sched.process_output(plan, worker.execute(plan))
    assert decodes == 5
    assert not any(r.finished for r in long)


def test_requests_arriving_one_by_one_are_prefilled_together(tiny_llama_dir):
    """A burst of clients over HTTP: requests arrive a step apart while others decode.
    With prefill_min_batch=4 they wait for each other (up to the delay) and take one
    prefill step, not one each; with 1 each is prefilled as it comes."""
    def extends(min_batch: int) -> int:
        eng = tiny_engine(tiny_llama_dir, "scheduler.max_running_requests=8",
                          f"scheduler.prefill_min_batch={min_batch}",
                          "scheduler.prefill_max_delay_steps=8", spec=False)
        eng.add_request(random_prompts(1, seed=1)[0], greedy(40))
        eng.step()
        before = eng.mode_steps["extend"]
        for p in random_prompts(4, seed=2):
            eng.add_request(p, greedy(4))
            eng.step()
        while eng.has_work:
            eng.step()
        return eng.mode_steps["extend"] - before
    assert extends(1) == 4
    assert extends(4) == 1


def test_a_long_prompt_holds_running_streams_one_chunk_at_a_time(tiny_llama_dir):
    """scheduler.decode_between_chunks: a prompt of four chunks arriving while another
    request decodes; on, a decode step runs between every two of its chunks (the running
    stream gets a token each time), off, its chunks run back to back. Same tokens."""
    def run(between: bool):
        eng = tiny_engine(tiny_llama_dir, "scheduler.max_running_requests=4",
                          "scheduler.chunked_prefill_size=16",
                          f"scheduler.decode_between_chunks={str(between).lower()}", spec=True)
        sched, worker = eng.schedulers[0], eng.workers[0]
        running = eng.add_request(random_prompts(1, seed=1)[0], greedy(40))
        while not running.output_ids:
            eng.step()
        long = eng.add_request([3 + i % 120 for i in range(60)], greedy(8))  # 4 chunks of 16
        modes = []
        while not long.output_ids:
            plan = sched.schedule()
            modes.append(plan.mode)
            sched.process_output(plan, worker.execute(plan))
        while eng.has_work:
            eng.step()
        return modes, (running.output_ids, long.output_ids)
    on, on_tokens = run(True)
    off, off_tokens = run(False)
    assert on == ["extend", "decode"] * 3 + ["extend"]
    assert off == ["extend"] * 4
    assert on_tokens == off_tokens


def test_by_cost_an_arrival_waits_while_the_pause_costs_more(tiny_llama_dir):
    """scheduler.prefill_by_cost: with a prefill step's pause worth more than the new
    request's wait (the running requests times the measured pause), it waits, at most the
    delay; once its wait outweighs the pause, or with nobody decoding, it goes at once.
    Tokens stay those of prefilling at once."""
    def engine():
        return tiny_engine(tiny_llama_dir, "scheduler.max_running_requests=4", "scheduler.prefill_by_cost=true",
                           "scheduler.prefill_max_delay_steps=6", spec=False)

    def decodes_before_prefill(eng, arrival_age: float) -> int:
        sched, worker = eng.schedulers[0], eng.workers[0]
        late = eng.add_request(random_prompts(1, seed=3)[0], greedy(3))
        late.arrival -= arrival_age
        decodes = 0
        while not late.output_ids:
            plan = sched.schedule()
            decodes += plan.mode == "decode"
            sched.process_output(plan, worker.execute(plan))
        return decodes

    outs = []
    for pause, age, want in [(10.0, 0.0, 6), (10.0, 25.0, 0), (0.0, 0.0, 0)]:
        eng = engine()
        long = [eng.add_request(p, greedy(40)) for p in random_prompts(2, seed=1)]
        while not long[-1].output_ids:
            eng.step()
        eng.schedulers[0].extend_period = pause  # two decoding: a pause worth 2 x 10 s
        assert decodes_before_prefill(eng, age) == want, (pause, age)
        while eng.has_work:
            eng.step()
        outs.append([r.output_ids for r in long])
    assert outs[0] == outs[1] == outs[2]
    solo = engine()
    solo.schedulers[0].extend_period = 10.0
    assert decodes_before_prefill(solo, 0.0) == 0  # nobody decoding: no pause to weigh


def test_by_cost_the_pause_is_measured_and_exported(tiny_llama_dir):
    """The scheduler times a prefill step that ran while others decoded, and /metrics
    shows it; without prefill_by_cost (and no draft policy) nothing is timed."""
    from serve_app.api.metrics import ServerMetrics

    def run(by_cost: bool) -> float:
        eng = tiny_engine(tiny_llama_dir, "scheduler.max_running_requests=8",
                          f"scheduler.prefill_by_cost={str(by_cost).lower()}", spec=False)
        eng.add_request(random_prompts(1, seed=1)[0], greedy(30))
        for _ in range(3):
            eng.step()
        for p in random_prompts(3, seed=2):
            eng.add_request(p, greedy(4))
            for _ in range(4):
                eng.step()
        while eng.has_work:
            eng.step()
        return eng.schedulers[0].extend_period
    assert run(False) == 0.0
    period = run(True)
    assert period > 0.0
    m = ServerMetrics("m")
    m.update_engine({"replica": "r", "running": 0, "waiting": 0, "kv": [],
                     "prefill_period": [{"rank": 0, "value": period}]})
    assert m.registry.get_sample_value("kestrel_engine_prefill_period_seconds",
                                       {"model": "m", "replica": "r", "rank": "0"}) == period
