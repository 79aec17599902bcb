"""The EAGLE worker's graph runners and plan stream, wired into the real engine on CPU.

On CPU a GraphRunner's "graph" is the captured body run eagerly on its padded static
buffers, so these tests drive the very padding path of a CUDA replay (C04-C08): the
speculative output with runners equals the eager output token for token, at raw batch
sizes that need padding (3, 5) and one that does not (4). A recording plan stream checks
the C17 order around verify and draft extend inside the real iteration. The step graph
(one graph per iteration) is checked the same way, sampled batches too.
"""
from __future__ import annotations

import pytest
import torch
from graph_fakes import FakeEvent, FakeStream, without_event_names
from spec_helpers import CHAIN, TREE, outputs, random_prompts, tiny_engine

from actors.graphs.cuda_graph_runner import GraphRunner
from actors.spec.step_graph import Variant

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


def spy_step_graph(eagle) -> list[tuple[int, int]]:
    """Wrap the step graph's run to log (raw batch, padded size)."""
    from actors.spec.step_graph import StepGraph
    seen = []
    g = eagle.step_graph

    def run(rows, variant=Variant(), bs=None):
        seen.append((len(rows), g.pad_size(len(rows)) if bs is None else bs))
        return StepGraph.run(g, rows, variant, bs)

    g.run = run
    return seen


@pytest.mark.parametrize("step_graph", [False, True], ids=["phase_graphs", "step_graph"])
@pytest.mark.parametrize("raw", [3, 4, 5])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_graph_runners_equal_eager(tiny_llama_dir, shape, raw, step_graph):
    prompts = random_prompts(raw, seed=raw)
    want = outputs(tiny_engine(tiny_llama_dir, *shape), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *shape)
    eagle = eng.workers[0].eagle
    eagle.capture_graphs(SIZES, step_graph=step_graph)
    assert not eagle.graphs.verify.use_cuda_graph  # CPU: the eager stand-in
    assert (eagle.step_graph is not None) == step_graph
    seen = spy_replays(eagle)
    steps = spy_step_graph(eagle) if step_graph else []
    assert outputs(eng, prompts, MAX_TOKENS) == want
    padded = {3: 4, 4: 4, 5: 8}[raw]
    if step_graph:  # whole greedy iterations: the per-phase runners never replay
        assert (raw, padded) in steps and seen == []
    else:  # every kind replayed the full raw batch, padded to the next captured size
        full = {(kind, bs) for kind, n, bs in seen if n == raw}
        assert full == {(k, padded) for k in ("target_verify", "draft_decode", "draft_extend")}


def test_every_verify_graph_writes_the_one_logits_buffer(tiny_llama_dir):
    """The per-phase verify runner at every size and the step graph's verify part (grammar
    rows) return their logits in the EagleWorker's one verify_logits buffer, not in outputs
    of their own: one [bs*N, V] float32 output per size would be most of the graphs' memory."""
    eng = tiny_engine(tiny_llama_dir, *TREE)
    eagle = eng.workers[0].eagle
    eagle.capture_graphs(SIZES, step_graph=False)
    base = eagle.verify_logits
    assert base.shape == (max(SIZES) * eagle.N, eagle.w.arch.vocab_size) and base.dtype == torch.float32
    runner, starts = eagle.graphs.verify, []

    def replay(batch, *, bs=None, metadata_ready=False):
        out = GraphRunner.replay(runner, batch, bs=bs, metadata_ready=metadata_ready)
        starts.append((bs or runner.pad_size(batch.batch_size), out[0].data_ptr()))
        return out

    runner.replay = replay
    outputs(eng, random_prompts(5, seed=5), MAX_TOKENS)
    assert {bs for bs, _ in starts} == {4, 8}  # five requests, then four, as they finish
    assert {p for _, p in starts} == {base.data_ptr()}

    eagle.capture_graphs(SIZES)  # with the step graph and its parts
    g = eagle.step_graph
    assert g.masks is not None
    for bs in SIZES:
        g.run_draft([-1] * bs)  # every lane padded: row 0 and slot 0
        g.run_verify(bs)
        logits = g._graphs["verify", bs].output[0]  # [bs, N, V] fp32
        assert logits.shape == (bs, eagle.N, base.shape[1])
        assert logits.data_ptr() == eagle.verify_logits.data_ptr()


def test_decode_graphs_write_the_one_logits_buffer(tiny_llama_dir):
    """The plain decode graphs and the unprocessed sampled sets return their logits in the
    rank's one decode_logits buffer at every size; greedy output stays the eager output."""
    prompts = random_prompts(5, seed=9)
    want = outputs(tiny_engine(tiny_llama_dir, spec=False), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, spec=False)
    w = eng.workers[0]
    w.capture_decode_graphs(SIZES)
    base = w.decode_logits  # [max_bs, V] fp32
    assert base.shape == (max(SIZES), w.arch.vocab_size) and base.dtype == torch.float32
    for runner in (w.decode_graphs, w.sampled_decode_graphs[False, False], w.sampled_decode_graphs[False, True]):
        for bs in SIZES:
            with torch.inference_mode():
                runner.replay_all_padded(bs)
            out = runner._graphs[bs].output
            logits = out if isinstance(out, torch.Tensor) else out[0]  # [bs, V] fp32
            assert logits.shape == (bs, base.shape[1]) and logits.data_ptr() == base.data_ptr()
    assert outputs(eng, prompts, MAX_TOKENS) == want


def test_batches_above_largest_size_run_eagerly(tiny_llama_dir):
    prompts = random_prompts(5, seed=5)
    want = outputs(tiny_engine(tiny_llama_dir, *CHAIN), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *CHAIN)
    eng.workers[0].eagle.capture_graphs([1, 2], step_graph=False)
    seen = spy_replays(eng.workers[0].eagle)
    assert outputs(eng, prompts, MAX_TOKENS) == want
    assert all(n <= 2 for _, n, _ in seen)


def test_one_draft_step_has_no_draft_decode_runner(tiny_llama_dir):
    shape = ("draft.topk=2", "draft.num_steps=1", "draft.num_draft_tokens=3")
    prompts = random_prompts(3, seed=7)
    want = outputs(tiny_engine(tiny_llama_dir, *shape), prompts, MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *shape)
    eng.workers[0].eagle.capture_graphs(SIZES, step_graph=False)
    assert eng.workers[0].eagle.graphs.draft_decode is None
    assert outputs(eng, prompts, MAX_TOKENS) == want


# ----------------------------------------------------------------------- plan stream
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_iteration_prepares_verify_and_draft_extend_on_plan_stream(tiny_llama_dir, graphs):
    from actors.graphs.plan_stream import PlanStream
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
        eagle.capture_graphs(SIZES, step_graph=False)
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


# ----------------------------------------------------------------------- step graph
@pytest.mark.parametrize("variant,parts", [(Variant(), False), (Variant(True, True), False), (Variant(True, True), True)],
                         ids=["greedy", "processed_logprobs", "parts"])
def test_step_graph_padded_lanes_touch_only_reserved_row_and_slot(tiny_llama_dir, variant, parts):
    """Padded lanes read and write row 0 and slot 0 only: after real requests ran, an
    all-padded iteration leaves every other row's carried state and every other slot's
    KV (target and draft) as it was; with processing, no row's output counts change (the
    padded lanes emit nothing). The same for the three parts grammar batches replay."""
    import torch
    eng = tiny_engine(tiny_llama_dir, *TREE)
    eagle = eng.workers[0].eagle
    eagle.capture_graphs(SIZES)
    outputs(eng, random_prompts(3, seed=11), MAX_TOKENS)
    w = eagle.w
    w.counts.ensure()
    state = lambda: [t[1:].clone() for t in (w.future.seq_lens, w.future.bonus, w.future.topk_p,
                                             w.future.topk_index, w.future.hidden,
                                             *w.kv_pool.k, *w.kv_pool.v,
                                             *eagle.kv_pool.k, *eagle.kv_pool.v)]
    counts = lambda: [t.clone() for t in (w.counts.counts, w.counts.num_out, w.counts.tail)]
    before, counted = state(), counts()
    assert any(int(t.abs().sum()) for t in before[:2])  # the real requests left state behind
    rows = torch.full((4,), -1, dtype=torch.int64)
    if parts:
        d = eagle.step_draft(rows)
        out = eagle.step_accept(d, *eagle.step_verify(d), eagle.step_graph.masks[:4], variant)
    else:
        out = eagle.step_body(rows, variant)
    assert out[0].shape == (4, eagle.S + 2) and len(out) == (4 if variant.logprobs else 1)
    for old, new in zip(before + counted, state() + counts()):
        assert torch.equal(old, new)


@pytest.mark.parametrize("feature_graphs", [False, True])
def test_sampled_batches_take_the_sampled_step_graph(tiny_llama_dir, feature_graphs):
    """With attention.feature_graphs a sampled batch replays the step graph (its sampled
    variant); without, the per-phase runners. Both give the eager output."""
    from serve_app.engine.request import SamplingParams
    prompts = random_prompts(3, seed=13)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=5)

    def sampled(eng):
        return [r.output_ids for r in eng.generate(prompts, params)]

    want = sampled(tiny_engine(tiny_llama_dir, *TREE))
    eng = tiny_engine(tiny_llama_dir, *TREE, f"attention.feature_graphs={str(feature_graphs).lower()}")
    eagle = eng.workers[0].eagle
    eagle.capture_graphs(SIZES)
    steps, phases = spy_step_graph(eagle), spy_replays(eagle)
    assert sampled(eng) == want
    if feature_graphs:
        assert (3, 4) in steps and phases == []
    else:
        assert steps == [] and {k for k, _, _ in phases} == {"target_verify", "draft_decode",
                                                             "draft_extend"}
