"""The EAGLE worker's graph runners and plan stream, wired into the real engine on CPU.

On CPU a GraphRunner's "graph" is the captured body run eagerly on its padded static
buffers, so these tests drive the very padding path of a CUDA replay (C04-C08): the
speculative output with runners equals the eager output token for token, at raw batch
sizes that need padding (3, 5) and one that does not (4). A recording plan stream checks
the C17 order around verify and draft extend inside the real iteration.
"""
from __future__ import annotations

import pytest
from graph_fakes import FakeEvent, FakeStream, without_event_names
from spec_helpers import CHAIN, TREE, outputs, random_prompts, tiny_engine

from actors.cuda_graph_runner import GraphRunner

SIZES = [1, 2, 4, 8]
MAX_TOKENS = 12


def spy_replays(eagle) -> list[tuple[str, int, int]]:
    """Wrap each runner's replay to log (kind, raw batch, padded size)."""
    seen = []
    for runner in (eagle.graphs.verify, eagle.graphs.draft_decode, eagle.graphs.draft_extend):
        if runner is None:
            continue

        def replay(batch, *, bs=None, metadata_ready=False, _runner=runner):
            seen.append((_runner.kind.value, batch.batch_size,
                         bs or _runner.pad_size(batch.batch_size)))
            return GraphRunner.replay(_runner, batch, bs=bs, metadata_ready=metadata_ready)

        runner.replay = replay
    return seen


@pytest.mark.parametrize("raw", [3, 4, 5])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_graph_runners_equal_eager(tiny_llama_dir, shape, raw):
    prompts = random_prompts(raw, seed=raw)
    want = outputs(tiny_engine(tiny_llama_dir, *shape), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *shape)
    eagle = eng.workers[0].eagle
    eagle.capture_graphs(SIZES)
    assert not eagle.graphs.verify.use_cuda_graph  # CPU: the eager stand-in
    seen = spy_replays(eagle)
    assert outputs(eng, prompts, MAX_TOKENS) == want
    # Every kind replayed the full raw batch, padded to the next captured size.
    full = {(kind, bs) for kind, n, bs in seen if n == raw}
    padded = {3: 4, 4: 4, 5: 8}[raw]
    assert full == {(k, padded) for k in ("target_verify", "draft_decode", "draft_extend")}


def test_batches_above_largest_size_run_eagerly(tiny_llama_dir):
    prompts = random_prompts(5, seed=5)
    want = outputs(tiny_engine(tiny_llama_dir, *CHAIN), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *CHAIN)
    eng.workers[0].eagle.capture_graphs([1, 2])
    seen = spy_replays(eng.workers[0].eagle)
    assert outputs(eng, prompts, MAX_TOKENS) == want
    assert all(n <= 2 for _, n, _ in seen)


def test_one_draft_step_has_no_draft_decode_runner(tiny_llama_dir):
    shape = ("draft.topk=2", "draft.num_steps=1", "draft.num_draft_tokens=3")
    prompts = random_prompts(3, seed=7)
    want = outputs(tiny_engine(tiny_llama_dir, *shape), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *shape)
    eng.workers[0].eagle.capture_graphs(SIZES)
    assert eng.workers[0].eagle.graphs.draft_decode is None
    assert outputs(eng, prompts, MAX_TOKENS) == want


# ----------------------------------------------------------------------- plan stream
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_iteration_prepares_verify_and_draft_extend_on_plan_stream(tiny_llama_dir, graphs):
    from actors.plan_stream import PlanStream
    prompts = random_prompts(3, seed=3)
    want = outputs(tiny_engine(tiny_llama_dir, *TREE), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *TREE)
    eagle = eng.workers[0].eagle
    log: list[str] = []
    plan = PlanStream(True, "cpu", compute_stream=FakeStream("compute", log),
                      stream_factory=lambda d: FakeStream("plan", log),
                      event_factory=lambda: FakeEvent(log))
    eagle.plan = eagle.verify_path.plan = plan
    if graphs:
        eagle.capture_graphs(SIZES)
    steps = []
    original = eagle.decode

    def decode(step_plan):
        start = len(log)
        out = original(step_plan)
        steps.append(log[start:])
        return out

    eagle.decode = decode
    assert outputs(eng, prompts, MAX_TOKENS) == want
    one = ["compute:record", "plan:wait_event", "plan:enter", "plan:exit",
           "compute:wait_stream:plan"]
    assert steps and all(without_event_names(s) == one + one for s in steps)  # verify, then draft extend
