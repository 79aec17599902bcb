"""The engine core names a stalled step in its log (EngineCore._note_slow): far slower
than the usual step of its mode and size, and past 100 ms, with the parts the rank
timed; the ordinary spread of step times, and bigger batches, stay quiet."""
import logging
from types import SimpleNamespace

from actors.protocol.step_plan import StepPlan
from serve_app.engine.engine_core import EngineCore


def _steps(core, steps) -> list[str]:
    for mode, rows, tokens, ms in steps:
        plan = StepPlan(0, mode, list(range(rows)), extend_lens=[tokens // rows] * rows if mode == "extend" else [])
        EngineCore._note_slow(core, 0, plan, {mode: ms / 1000, "gc": 0.0})


def test_a_stalled_step_is_logged_with_its_parts(caplog):
    core = SimpleNamespace(_usual_step={})
    caplog.set_level(logging.WARNING, logger="kestrel.engine")
    _steps(core, [("decode", 8, 0, 3.0)] * 20 + [("decode", 8, 0, 4.5), ("decode", 64, 0, 9.0)])
    _steps(core, [("extend", 1, 16, 2.0)] * 5 + [("extend", 64, 4096, 40.0)])
    assert not caplog.records  # the spread, a bigger batch, a long prefill: no stall
    _steps(core, [("extend", 1, 16, 1400.0)])  # the first grammar request's step, before the fix
    _steps(core, [("decode", 8, 0, 230.0)])  # a full collection in the rank
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "slow extend step (1 rows, 16 tokens)" in msgs[0] and "1400.0" in msgs[0]
    assert "slow decode step (8 rows)" in msgs[1] and "'gc': 0.0" in msgs[1]
