"""Grammar steps launched ahead (actors/sampling/grammar_rows.py `launched` / `settle`): step N+1
with grammar rows is launched before step N has finished, and its masks wait for N's
tokens only where they are made. The matchers accept each step's tokens exactly once, in
step order, by the matcher the row held at launch; the outputs then equal the in-process
engine's (LLMEngine.generate: finish(launch(plan)), one step at a time) token for token,
plain and tree, greedy and seeded-sampled, with rows without a grammar beside them, rows
that finished at N still in plan N+1, an abort whose row a new grammar request takes in
N+1, preemptions, and long accepts beside rejected drafts (an oracle draft); the same
through the step channel, whose launch / finish order shows the overlap. The target is
the random Llama with SmolLM2's vocabulary (conftest.py grammar_model), and SmolLM2
itself through the channel, whose JSON answers end and parse."""
from __future__ import annotations

import asyncio
import time
from collections import deque

import pytest
import torch
from spec_helpers import TREE, random_prompts, tiny_config
from test_grammar_lossless import SPECS, valid

from actors.sampling.grammar_rows import GrammarRows
from kestrel_testing import LocalEngine
from serve_app.text.grammar import GrammarCompiler
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams

pytestmark = pytest.mark.timeout(600)  # SmolLM2 through the channel: 4 min on a loaded 2-core CPU

SHAPES = {"plain": (), "tree": TREE, "tree-graphs": TREE}


@pytest.fixture(scope="module")
def compiled(tokenizer) -> dict[str, str]:
    c = GrammarCompiler(tokenizer)
    return {k: c.compile(SPECS[k]) for k in ("json_schema", "regex", "choice")}


def _params(compiled: dict[str, str], i: int) -> dict:
    """Grammar and free rows, greedy and seeded-sampled, ending at different steps: by
    their grammar's stop token (a choice ends within a few tokens), by length, or by EOS."""
    kinds = [dict(grammar=compiled["json_schema"], max_tokens=40),
             dict(max_tokens=7),
             dict(grammar=compiled["regex"], max_tokens=30, temperature=0.9, seed=20 + i),
             dict(grammar=compiled["json_schema"], max_tokens=13, temperature=0.8, seed=20 + i),
             dict(grammar=compiled["choice"], max_tokens=30),
             dict(max_tokens=30, temperature=0.9, seed=20 + i)]
    return kinds[i % len(kinds)]


def _mix(compiled: dict[str, str], n: int) -> list[SamplingParams]:
    return [SamplingParams(**_params(compiled, i)) for i in range(n)]


def _engine(model: str, tokenizer, shape: str, *overrides: str) -> LLMEngine:
    """An engine with a worker of its own (a worker's matchers outlive its scheduler) that
    steps one at a time: the reference, and what `Ahead` drives."""
    cfg = tiny_config(model, *SHAPES[shape], "scheduler.chunked_prefill_size=16",
                      "scheduler.launch_ahead=false", *overrides, spec=shape != "plain")
    eng = LLMEngine(cfg, tokenizer=tokenizer)
    if shape == "tree-graphs":  # greedy grammar batches replay the step graph in parts (_run_parts)
        from test_penalties_lossless import GRAPH_SIZES
        eng.workers[0].eagle.capture_graphs(GRAPH_SIZES)
    return eng


class Ahead:
    """Runs an engine's one rank as the step channel does, without its timing: step N+1 is
    launched before step N is finished, always (`act(plan)` runs after each launch)."""

    def __init__(self, eng: LLMEngine, act=None):
        self.eng, self.act = eng, act
        self.grammar_ahead = 0  # plans with grammar rows launched while the step before ran
        self.finished_rows_ahead = 0  # rows whose grammar request ended at N, in plan N+1

    def run(self) -> None:
        sched, worker = self.eng.schedulers[0], self.eng.workers[0]
        inflight = deque()
        while sched.has_work or inflight:
            while len(inflight) < 2:
                plan = sched.schedule()
                if plan is None:
                    break
                grammar = bool(plan.grammar_resets) or worker.grammars.any(plan.rows)
                self.grammar_ahead += grammar and bool(inflight)
                inflight.append((plan, worker.launch(plan)))
                if self.act is not None:
                    self.act(plan)
            plan, launched = inflight.popleft()
            running = {r.row: r for r in sched.running if r.params.grammar is not None}
            sched.process_output(plan, worker.finish(launched))
            ended = {row for row, r in running.items() if r.finished}
            self.finished_rows_ahead += sum(len(ended & set(p.rows)) for p, _ in inflight)


def _check_ended(reqs, tokenizer, compiled, kinds=("regex", "choice")) -> None:
    """The answers of grammar `kinds` that ended by the grammar's stop token are whole
    answers of it (a JSON answer parses and fits the schema); one of each kind at least."""
    for kind in kinds:
        ended = [r for r in reqs if r.params.grammar == compiled[kind] and r.finish_reason == "stop"]
        assert ended, (kind, [(r.finish_reason, tokenizer.decode(r.output_ids)) for r in reqs])
        for r in ended:
            assert valid(kind, tokenizer.decode(r.output_ids[:-1])), tokenizer.decode(r.output_ids)


def test_settle_accepts_each_launched_step_once_in_order_by_its_matcher(tokenizer, compiled):
    """Two steps launched before either settles: the masks' settle accepts both, in order;
    their finish then accepts nothing again; a row reset between launch and settle keeps
    its fresh matcher, and the old one, whose request has left the row, is fed nothing
    more; a terminated matcher is offered nothing."""
    class Step:
        def __init__(self, tokens):
            self._tokens, self.waits = tokens, 0

        def tokens(self):
            self.waits += 1
            return self._tokens

    import xgrammar as xgr
    g = GrammarRows()
    g.set_vocab(xgr.TokenizerInfo.from_huggingface(tokenizer).serialize_json())
    ab, cd = tokenizer.encode("alpha"), tokenizer.encode("delta")
    g.reset(1, compiled["choice"], [])
    g.reset(2, compiled["choice"], [])
    first = Step([ab[:1], cd[:1]])
    g.launched(first, [1, 2])
    old = g.matchers[2]
    g.reset(2, compiled["choice"], [])  # plan N+1 gives row 2 to another request
    second = Step([ab[1:] + [tokenizer.eos_token_id], []])
    g.launched(second, [1, 2])
    g.settle()  # step N+2's masks
    g.settle(first)  # then the steps finish
    g.settle(second)
    assert first.waits == second.waits == 1
    assert g.matchers[1].is_terminated()  # "alpha" and the stop token, each accepted once
    assert old.accept_token(cd[0])  # still at its start: the step's token was not fed to it
    assert g.matchers[2] is not old and g.matchers[2].accept_token(cd[0])  # nor to the new one
    late = Step([cd[:1], []])  # row 1 ended; a plan made before the scheduler knew holds it
    g.launched(late, [1, 2])
    g.settle(late)
    assert g.matchers[1].is_terminated() and 1 in g.matchers
    masks = g.next_masks([1, 2], torch.device("cpu"))  # [2, W] int32
    assert (masks[0] == -1).all() and not (masks[1] == -1).all()  # the ended row masks nothing


@pytest.mark.parametrize("shape", [
    "plain",
    # Long, for make test's budget: tree-graphs runs the same abort and late admission on a
    # tree's rows, and eager tree steps launched ahead are held to one-at-a-time output by
    # test_long_accepts_launched_ahead_equal_plain[tree] and
    # test_preempted_grammar_requests_with_steps_in_flight[tree].
    pytest.param("tree", marks=pytest.mark.long),
    "tree-graphs"])
def test_grammar_steps_launched_ahead_equal_one_at_a_time(grammar_model, tokenizer, compiled, shape, capfd):
    prompts = random_prompts(7, vocab=len(tokenizer), seed=4)  # a row free for the late one
    params = _mix(compiled, len(prompts))
    late_prompt = random_prompts(1, vocab=len(tokenizer), seed=9)[0]
    late_params = SamplingParams(grammar=compiled["json_schema"], max_tokens=30)
    want = _engine(grammar_model, tokenizer, shape).generate(prompts + [late_prompt], params + [late_params])

    eng = _engine(grammar_model, tokenizer, shape)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    late, gone = [], {}

    def abort_one(plan) -> None:
        """Once, after a decode step is launched: abort a grammar request of it and add
        one with a grammar, admitted in the next plan on the row it frees (rows are reused
        last freed first) while the aborted one's step has not settled."""
        if late and "late_row" not in gone:
            gone["late_row"] = late[0].row
        running = [r for r in eng.schedulers[0].running if r.params.grammar is not None and r.row in plan.rows]
        if plan.step_id < 6 or plan.mode != "decode" or gone or not running:
            return
        victim = running[0]
        gone.update(req=victim, row=victim.row)
        eng.abort(victim.rid)
        late.append(eng.add_request(late_prompt, late_params))

    ahead = Ahead(eng, abort_one)
    ahead.run()
    assert late and gone["late_row"] == gone["row"] and late[0].admissions == 1
    keep = [i for i, r in enumerate(reqs) if r is not gone["req"]]
    assert [reqs[i].output_ids for i in keep] == [want[i].output_ids for i in keep]
    assert late[0].output_ids == want[-1].output_ids
    _check_ended(reqs + late, tokenizer, compiled)
    assert ahead.grammar_ahead > 10 and ahead.finished_rows_ahead > 0
    assert "terminated" not in capfd.readouterr().err  # no xgrammar warning about late tokens


@pytest.mark.parametrize("shape", ["tree", "tree-graphs"])
def test_long_accepts_launched_ahead_equal_plain(grammar_model, tokenizer, compiled, shape, monkeypatch):
    """An oracle draft (the plain answers among decoys: tests/unit/spec/test_c22): several
    tokens accepted per step and the decoys beside them rejected, each step's accepted
    tokens settled into the matchers at once, before the next step's tree walk."""
    from test_c22_greedy_lossless import OracleDraft
    prompts = random_prompts(6, vocab=len(tokenizer), seed=7)
    params = [SamplingParams(**{**_params(compiled, i), "temperature": 0.0}) for i in range(len(prompts))]
    plain = [r.output_ids for r in _engine(grammar_model, tokenizer, "plain").generate(prompts, params)]
    eng = _engine(grammar_model, tokenizer, shape)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    eng.step()  # the first prefill: rows are assigned now
    eagle = eng.workers[0].eagle
    refs = {0: [], **{r.row: r.prompt_ids + ref for r, ref in zip(reqs, plain)}}  # 0: padded lanes
    oracle = OracleDraft(eagle, refs, len(tokenizer))
    monkeypatch.setattr(eagle, "_draft", oracle)
    monkeypatch.setattr(eagle, "draft_body", oracle)  # what the step graph's draft part calls
    parts = []  # greedy grammar batches on the step graph: its three parts (_run_parts)
    if eagle.step_graph is not None:
        accept = eagle.step_graph.run_accept
        monkeypatch.setattr(eagle.step_graph, "run_accept", lambda *a: parts.append(a) or accept(*a))
    ahead = Ahead(eng)
    ahead.run()
    assert [r.output_ids for r in reqs] == plain
    assert bool(parts) == (shape == "tree-graphs")
    assert max(a for r in reqs for a in r.accept_lengths) >= 3 and ahead.grammar_ahead > 5


@pytest.mark.parametrize("shape", ["plain", "tree"])
def test_preempted_grammar_requests_with_steps_in_flight(grammar_model, tokenizer, compiled, shape):
    """Short KV: grammar requests are preempted while a step of theirs is in flight and
    readmitted, their matcher replayed from their outputs, before that step settles.
    Greedy: a sampled request's coins drawn for a step in flight are spent when it is
    preempted, grammar or not."""
    prompts = [p * 3 for p in random_prompts(6, vocab=len(tokenizer), seed=3)]
    params = [SamplingParams(**{**_params(compiled, i), "temperature": 0.0}) for i in range(len(prompts))]
    over = ("model.max_model_len=160",)
    want = _engine(grammar_model, tokenizer, shape, *over).generate(prompts, params)
    # Chunks back to back, as in the schedule this KV size was chosen for: it preempts.
    eng = _engine(grammar_model, tokenizer, shape, *over, "kv_cache.num_slots=200",
                  "scheduler.decode_between_chunks=false")
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    ahead = Ahead(eng)
    ahead.run()
    assert eng.schedulers[0].stats["preemptions"] > 0 and ahead.grammar_ahead > 5
    assert [r.output_ids for r in reqs] == [r.output_ids for r in want]


class LateReady:
    """A RankWorker with a GPU's timing on the CPU, where `launch` runs the step to its end:
    a launched step says it is ready only `step_s` after its launch, or once the next
    step's masks have read its tokens, so the channel reads and launches the next plan
    first. Records the calls: ("launch", step id, grammar rows), ("launched", step id)
    when launch returns, and ("finish", step id)."""

    def __init__(self, worker, step_s: float):
        self.worker, self.step_s, self.calls = worker, step_s, []

    def on_steps_back(self, callback) -> None:
        self.worker.on_steps_back(callback)

    def launch(self, plan):
        grammar = bool(plan.grammar_resets) or self.worker.grammars.any(plan.rows)
        self.calls.append(("launch", plan.step_id, grammar))
        step, at = self.worker.launch(plan), time.monotonic() + self.step_s
        self.calls.append(("launched", plan.step_id))
        ready = lambda _: time.monotonic() >= at or step.tokens_read
        return type("Launched", (), {"ready": ready, "step": step})()

    def finish(self, launched):
        self.calls.append(("finish", launched.step.plan.step_id))
        return self.worker.finish(launched.step)


SMOLLM2 = ["model.dtype=float32", "kv_cache.num_slots=8192", "scheduler.max_running_requests=16",
           "device=cpu"]
ASK = ["Describe a pet as JSON with its name and age n.", "Reply in JSON: a short name and a number n.",
       "Give me a user record as JSON.", "Name a fruit and how many you want, in JSON.",
       "Pick a city and its population n as JSON.", "Say hello.", "What is 2+3? Answer as JSON."]


def _channel_params(compiled: dict[str, str], i: int) -> dict:
    """As _params, on SmolLM2 (which closes its JSON objects): JSON answers that end
    (greedy and sampled) or are cut by length, beside free, regex and choice rows."""
    kinds = [dict(grammar=compiled["json_schema"], max_tokens=40),
             dict(max_tokens=6),
             dict(grammar=compiled["json_schema"], max_tokens=40, temperature=0.8, seed=30 + i),
             dict(grammar=compiled["choice"], max_tokens=20),
             dict(grammar=compiled["json_schema"], max_tokens=9),
             dict(max_tokens=24, temperature=0.9, seed=30 + i),
             dict(grammar=compiled["regex"], max_tokens=16, temperature=0.9, seed=30 + i)]
    return kinds[i % len(kinds)]


@pytest.fixture(scope="module")
def smollm2_worker():
    """A SmolLM2 RankWorker per shape, built on demand; `fresh` gives it new matchers: a
    worker's matchers outlive the scheduler that set them (rows that ended by length keep
    theirs until their row's next reset)."""
    from actors.worker.rank_worker import RankWorker
    from configs.schema import load_config
    workers = {}

    def get(shape: str):
        if shape not in workers:
            # The shipped head: it accepts 2-3 tokens a step where a random one accepts 1, so
            # the same answers take half the steps.
            spec = ["draft.enabled=true", *TREE] if shape == "tree" else ["draft.enabled=false"]
            workers[shape] = RankWorker(load_config(overrides=SMOLLM2 + spec))
        w = workers[shape]
        w.grammars = GrammarRows(w.cfg.processing.grammar_threads)
        return w
    return get


@pytest.mark.parametrize("shape", [
    # Plain grammar steps launched ahead are held to one-at-a-time output in process
    # (test_grammar_steps_launched_ahead_equal_one_at_a_time), and the channel's overlap by
    # the tree case: long, for make test's budget.
    pytest.param("plain", marks=pytest.mark.long),
    "tree",
])
def test_grammar_plans_launch_ahead_on_the_step_channel(smollm2_worker, tokenizer, compiled, shape):
    """Through the step channel (EngineCore -> StepServer -> RankWorker) on SmolLM2: grammar
    plans are launched before the step ahead of them finished, and the outputs equal the
    in-process engine's token for token; the JSON answers parse."""
    from serve_app.text.tokenizer import apply_chat_template
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in ASK]
    params = [_channel_params(compiled, i) for i in range(len(prompts))]
    worker = smollm2_worker(shape)
    want = LLMEngine(worker.cfg, tokenizer=tokenizer, workers=[worker]).generate(
        prompts, [SamplingParams(**p) for p in params])
    _check_ended(want, tokenizer, compiled, ("json_schema", "choice"))
    runner = LateReady(smollm2_worker(shape), step_s=0.03)

    async def run():
        local = await LocalEngine.start(worker.cfg, worker.info(), runner, tokenizer)
        streams = [local.client.add_request(p, params[i], f"g{i}") for i, p in enumerate(prompts)]

        async def ids(stream):
            return [t async for out in stream for t in out.new_token_ids]
        got = await asyncio.gather(*(ids(s) for s in streams))
        await local.stop()
        return got

    got = asyncio.run(run())
    assert got == [r.output_ids for r in want]
    order = {(kind, step): i for i, (kind, step, *_) in enumerate(runner.calls)}
    ahead = [step for kind, step, *grammar in runner.calls
             if kind == "launch" and grammar[0] and order[("launch", step)] < order.get(("finish", step - 1), -1)]
    assert len(ahead) > 10, runner.calls  # launch(N+1) before finish(N), for grammar plans
    # N's output went back from inside launch(N+1), where its masks had read N's tokens:
    # the engine plans N+2 while N+1's masks are walked.
    inside = [step for step in ahead if order[("finish", step - 1)] < order[("launched", step)]]
    assert len(inside) > 5, runner.calls
