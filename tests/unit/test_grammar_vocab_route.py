"""The grammar vocabulary's route to the worker (serve_app/engine/scheduler.py): the first plan
with a grammar carries it, once, unless the worker holds it already (a served replica
sends it to its ranks at start-up, and then tells the core only that grammars may come)."""
import pytest

from configs.schema import load_config
from serve_app.engine.request import Request, SamplingParams
from serve_app.engine.scheduler import Scheduler


def scheduler() -> Scheduler:
    cfg = load_config(overrides=["model.max_model_len=64"])
    info = {"num_slots": 4096, "num_rows": 8, "max_context": 256, "window": 8}
    return Scheduler(cfg, info, eos_token_ids=[2])


def grammar_plans(s: Scheduler, n: int) -> list:
    """The plans that start n grammar requests, one request per plan."""
    plans = []
    for i in range(n):
        s.add_request(Request(f"g{i}", [1, 2, 3], SamplingParams(max_tokens=4, grammar="compiled")))
        plan = s.schedule()
        assert [g for _, g, _ in plan.grammar_resets] == ["compiled"]
        plans.append(plan)
    return plans


def test_the_first_grammar_plan_carries_the_vocabulary_once():
    s = scheduler()
    s.set_grammar_vocab("the vocabulary")
    s.set_grammar_vocab("another")  # kept: the first one counts
    first, second = grammar_plans(s, 2)
    assert first.grammar_vocab == "the vocabulary" and second.grammar_vocab is None


def test_no_plan_carries_what_the_ranks_hold():
    s = scheduler()
    s.set_grammar_vocab(None)
    assert all(p.grammar_vocab is None for p in grammar_plans(s, 2))


def test_a_grammar_before_the_vocabulary_is_refused():
    s = scheduler()
    with pytest.raises(ValueError, match="grammar vocabulary"):
        s.add_request(Request("g", [1, 2, 3], SamplingParams(max_tokens=4, grammar="compiled")))
