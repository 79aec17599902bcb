"""Adaptive draft shapes: a decode step may draft with a smaller shape than the configured
one (draft.adaptive_shapes), or run as a plain decode step (draft.plain_steps), chosen per
step by DraftPolicy from measured step costs and accept lengths, with step graphs (here
their CPU stand-ins) or, without graphs (the CPU), eagerly. Greedy output stays the plain
output token for token under any sequence of shapes and plain steps; what cannot run at a
smaller shape runs at the configured one, and says so."""
from __future__ import annotations

import math

import pytest
import torch
from spec_helpers import TREE, greedy, outputs, random_prompts, tiny_config, tiny_engine

from actors.protocol.step_plan import PLAIN_STEP, deepest_accept
from configs.schema import ConfigError, load_config
from serve_app.api.metrics import ServerMetrics
from serve_app.engine.draft_policy import EXPLORE_SHARE, PERIOD_CLIP, PERIOD_EMA, PRIOR, DraftPolicy, shape_name

SIZES = [1, 2, 4, 8]
MAX_TOKENS = 16
ROOT = "draft.adaptive_shapes=[[1,1]]"  # the default (TREE has none: spec_helpers.FIXED)
SHAPES3 = "draft.adaptive_shapes=[[2,3],[1,1]]"
EAGER = "draft.eager_shapes=true"  # a rank without graphs times its shapes
PLAIN = "draft.plain_steps=true"


class Cycle(DraftPolicy):
    """Every shape in turn, whatever the costs: the worst case for state carried between
    steps of different shapes. `plain`: the last of the n is a plain decode step."""

    def __init__(self, n: int, plain: bool = False):
        self.n, self.i, self.seen = n, 0, []
        self.plain = n - 1 if plain else None

    def choose(self, batch: int) -> int:
        self.i += 1
        return self.i % self.n

    def observe(self, shape: int, accept_lengths: list[int]) -> None:
        self.seen.append((shape, list(accept_lengths)))

    def estimates(self) -> dict[str, float]:
        return {"cycle": float(len(self.seen))}


def adaptive_engine(model_dir, *overrides, graphs: bool = True):
    """graphs: the shapes replay step graphs (on CPU their eager stand-ins); else they run
    as a CPU rank starts them, eagerly through the per-phase path."""
    eng = tiny_engine(model_dir, *TREE, ROOT, *overrides, *(() if graphs else (EAGER,)))
    if graphs:
        eng.workers[0].eagle.capture_graphs(SIZES)
    return eng


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("overrides", [(), (SHAPES3,)], ids=["root_only", "three_shapes"])
def test_greedy_output_is_plain_output_under_any_shape_sequence(tiny_llama_dir, overrides, graphs):
    prompts = random_prompts(5, seed=21)
    want = outputs(tiny_engine(tiny_llama_dir, spec=False), prompts, MAX_TOKENS)
    eng = adaptive_engine(tiny_llama_dir, *overrides, graphs=graphs)
    shapes = eng.workers[0].eagle.shapes
    assert [(s.S, s.N) for s in shapes[1:]] == ([(2, 3), (1, 1)] if overrides else [(1, 1)])
    assert all((s.step_graph is None) != graphs for s in shapes)
    policy = eng.schedulers[0].draft_policy = Cycle(len(shapes))
    assert outputs(eng, prompts, MAX_TOKENS) == want
    assert set(eng.shape_steps) == set(range(len(shapes)))  # every shape ran
    for shape, lengths in policy.seen:  # a shape never emits more than its tree can accept
        assert max(lengths) <= min(shapes[shape].S, shapes[shape].N - 1) + 1


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_greedy_output_is_plain_output_with_plain_steps_between_shapes(tiny_llama_dir, graphs):
    """Plain steps leave the draft's top-k behind (they write the draft's KV): the step
    after them drafts from a stale state, the output does not change, and that step's
    accept lengths do not teach the policy."""
    prompts = random_prompts(5, seed=22)
    want = outputs(tiny_engine(tiny_llama_dir, spec=False), prompts, MAX_TOKENS)
    eng = adaptive_engine(tiny_llama_dir, SHAPES3, PLAIN, graphs=graphs)
    shapes = eng.workers[0].eagle.shapes
    policy = eng.schedulers[0].draft_policy = Cycle(len(shapes) + 1, plain=True)
    assert outputs(eng, prompts, MAX_TOKENS) == want
    assert set(eng.shape_steps) == set(range(len(shapes))) | {PLAIN_STEP}
    # The five prompts decode together: the step after each plain one teaches nothing,
    # the one after that again.
    after = [i + 1 for i, (shape, _) in enumerate(policy.seen[:-2]) if shape == PLAIN_STEP]
    assert after and all(not policy.seen[i][1] and policy.seen[i + 1][1] for i in after)


def test_a_plain_step_writes_the_drafts_kv_as_draft_extend_would(tiny_llama_dir):
    """EagleHead.kv: the K and V the draft's forward stores at those positions, computed
    without its attention, MLP or LM head (what a plain step writes)."""
    import torch
    head = tiny_engine(tiny_llama_dir, *TREE).workers[0].eagle.head
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (5,), generator=g)  # [5] int64
    positions = torch.tensor([0, 3, 7, 8, 20])  # [5] int64
    feats = torch.randn(5, head.spec.hidden_size * max(1, len(head.aux_layers)), generator=g)  # [5, F]
    stored = {}

    def attn(q, k, v, layer):
        stored["k"], stored["v"] = k, v
        return q
    head(ids, positions, attn, feats)
    k, v = head.kv(ids, positions, feats)
    assert torch.equal(k, stored["k"]) and torch.equal(v, stored["v"])


def test_plain_steps_draft_kv_written_late_is_the_kv_written_at_once(tiny_llama_dir):
    """On the CPU a plain step's draft KV waits for the next step that runs the draft
    (actors/spec/pending_draft_kv.py). Every draft forward then reads what an immediate write
    would have left, so the accept lengths are the same step for step, and so is the pool."""
    from spec_helpers import greedy
    prompts = random_prompts(5, seed=23)
    runs = []
    for late in (True, False):
        eng = adaptive_engine(tiny_llama_dir, SHAPES3, PLAIN, graphs=False)
        eagle = eng.workers[0].eagle
        assert eagle.pending_kv is not None  # the CPU waits by default
        if not late:
            eagle.pending_kv = None
        eng.schedulers[0].draft_policy = Cycle(len(eagle.shapes) + 1, plain=True)
        results = eng.generate(prompts, greedy(MAX_TOKENS))
        eagle.flush_plain_kv()  # what still waits after the last step
        runs.append(([r.output_ids for r in results], [r.accept_lengths for r in results],
                     eagle.kv_pool.k_all.clone(), eagle.kv_pool.v_all.clone()))
    (out_late, acc_late, *kv_late), (out_now, acc_now, *kv_now) = runs
    assert out_late == out_now and acc_late == acc_now
    # Slot 0 is the padded lanes' scratch (start-up timing writes it): the rest must match.
    assert all(torch.equal(a[:, 1:], b[:, 1:]) for a, b in zip(kv_late, kv_now))


def test_pending_draft_kv_keeps_a_slots_last_row_and_bounds_what_waits():
    from actors.spec.pending_draft_kv import ROWS_MAX, PendingDraftKV
    pending = PendingDraftKV()
    assert pending.take() is None
    feats = torch.arange(8.0).view(4, 2)  # [4, 2]
    assert not pending.add(torch.tensor([1, 2]), torch.tensor([5, 6]), torch.tensor([10, 11]), feats[:2])
    # slot 10 freed and given to another request's next token before the write
    pending.add(torch.tensor([3, 4]), torch.tensor([9, 7]), torch.tensor([12, 10]), feats[2:])
    tokens, positions, loc, got = pending.take()
    assert loc.tolist() == [11, 12, 10] and tokens.tolist() == [2, 3, 4] and positions.tolist() == [6, 9, 7]
    assert torch.equal(got, feats[1:])
    assert pending.take() is None  # taken once
    rows = torch.zeros(ROWS_MAX // 2, dtype=torch.int64)
    assert not pending.add(rows, rows, rows, torch.zeros(ROWS_MAX // 2, 2))
    assert pending.add(rows, rows, rows, torch.zeros(ROWS_MAX // 2, 2))  # full: write now


def test_sampled_and_penalized_rows_take_plain_steps(tiny_llama_dir):
    from serve_app.engine.request import SamplingParams
    eng = adaptive_engine(tiny_llama_dir, PLAIN)
    eng.schedulers[0].draft_policy = Cycle(3, plain=True)  # tree, root, plain
    reqs = eng.generate(random_prompts(3, seed=5),
                        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=3,
                                       repetition_penalty=1.3))
    assert all(len(r.output_ids) == MAX_TOKENS for r in reqs)
    assert eng.shape_steps[PLAIN_STEP] and eng.shape_steps[0] and not eng.eager_steps


def test_plain_steps_mix_with_prefill_chunks(tiny_llama_dir):
    """scheduler.mixed_steps: a plain step's decode rows beside prompt chunks run plainly
    and report the plain step, so its accept lengths teach the policy nothing."""
    prompts = random_prompts(5, seed=23)
    want = outputs(tiny_engine(tiny_llama_dir, spec=False), prompts, MAX_TOKENS)
    eng = adaptive_engine(tiny_llama_dir, PLAIN, "scheduler.mixed_steps=true",
                          "scheduler.chunked_prefill_size=16", "scheduler.max_running_requests=2")
    policy = eng.schedulers[0].draft_policy = Cycle(3, plain=True)
    assert outputs(eng, prompts, MAX_TOKENS) == want
    assert eng.mode_steps.get("mixed", 0) >= 1
    plain = [lengths for shape, lengths in policy.seen if shape == PLAIN_STEP]
    assert plain and all(set(lengths) <= {1} for lengths in plain)


def explorations(policy: DraftPolicy, batch: int, steps: int, **kw) -> tuple[list[int], float]:
    """`steps` choices at `batch` -> (the picks, the share of the step time that picks other
    than the best shape lost: their cost beyond their tokens' worth at the best rate)."""
    costs, rates = policy.step_costs(batch), policy.rates(batch)
    best = max(range(len(rates)), key=rates.__getitem__)
    picks = [policy.choose(batch, **kw) for _ in range(steps)]
    lost = sum(costs[p] * (1 - rates[p] / rates[best]) for p in picks)
    return picks, lost / sum(costs[p] for p in picks)


def test_policy_takes_a_plain_step_where_it_costs_less_and_explores_now_and_then():
    shapes = [(4, 5, 8), (4, 1, 1)]
    # Plain costs 1.0 at both sizes; the tree 1.5 at batch 1 and 4 at 64, the root 1.2.
    policy = DraftPolicy(shapes, [[1.5, 4.0], [1.2, 1.2]], [1, 64], plain_costs=[1.0, 1.0])
    assert policy.plain == 2 and policy.accept == [6.0, 1.0, 1.0] and not policy.learns[2]
    assert policy.choose(1) == 0  # 6 / 1.5
    for _ in range(60):
        policy.observe(0, [2, 2])
    picks, lost = explorations(policy, 64, 1000)
    assert picks.count(2) > 900 and 1 not in picks  # the root never learns
    assert picks.count(0) >= 2 and lost <= EXPLORE_SHARE  # the tree, now and then
    before = policy.accept[0]
    policy.observe(PLAIN_STEP, [1, 1])  # a plain step teaches nothing
    assert policy.accept[0] == before
    assert DraftPolicy.from_worker(shapes, {"draft_step_costs": [[1.0]], "plain_step_costs": [0.5],
                                            "graph_batch_sizes": [8]}).plain == 1


def test_exploring_loses_a_bounded_share_of_the_step_time_at_any_cost():
    """A shape that costs five plain steps (a tree at 512 streams) is explored rarely, one
    nearly as good as the best often; either way at most EXPLORE_SHARE of the time is lost."""
    shapes = [(4, 5, 8), (4, 1, 1)]
    policy = DraftPolicy(shapes, [[2.1, 9.5], [1.5, 2.6]], [8, 512], plain_costs=[1.2, 1.7])
    for _ in range(60):
        policy.observe(0, [3, 3])
    far, lost_far = explorations(policy, 512, 2000)  # the tree: 3 / 9.5 against 1 / 1.7
    near, lost_near = explorations(policy, 8, 2000)  # 3 / 2.1 against 1 / 1.2: the tree is best
    assert 0 < lost_far <= EXPLORE_SHARE and 0 < far.count(0) < 20
    assert near.count(0) > 1900


def test_cpu_rank_times_plain_steps_beside_its_shapes(tiny_llama_dir):
    eng = tiny_engine(tiny_llama_dir, *TREE, ROOT, EAGER, PLAIN)
    info = eng.workers[0].info()
    assert len(info["draft_step_costs"]) == 2 and len(info["plain_step_costs"]) == 4
    assert min(info["plain_step_costs"]) > 0
    policy = eng.schedulers[0].draft_policy
    assert policy.plain == 2 and policy.costs[2] == info["plain_step_costs"]
    # Plain steps alone make a choice: the configured shape and plain.
    eng = tiny_engine(tiny_llama_dir, *TREE, EAGER, PLAIN)
    assert len(eng.workers[0].info()["draft_step_costs"]) == 1
    assert eng.schedulers[0].draft_policy.plain == 1


def test_plain_steps_without_a_measured_cost_say_they_take_no_effect(tiny_llama_dir, caplog):
    with caplog.at_level("WARNING", logger="kestrel.worker"):
        eng = tiny_engine(tiny_llama_dir, *TREE, ROOT, PLAIN)  # no graphs, no eager_shapes
    assert eng.schedulers[0].draft_policy is None
    assert "draft.plain_steps takes no effect" in caplog.text


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_sampled_steps_run_at_every_shape(tiny_llama_dir, graphs):
    """Sampled rows take each shape's sampled step (its graph, or eagerly) with the first
    N+1 of their coins."""
    from serve_app.engine.request import SamplingParams
    eng = adaptive_engine(tiny_llama_dir, graphs=graphs)
    eng.schedulers[0].draft_policy = Cycle(2)
    reqs = eng.generate(random_prompts(3, seed=4),
                        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=3))
    assert all(len(r.output_ids) == MAX_TOKENS for r in reqs)
    assert eng.shape_steps[0] and eng.shape_steps[1] and not eng.eager_steps


def test_a_step_a_smaller_shape_cannot_hold_runs_at_the_configured_one(tiny_llama_dir):
    """Past the smaller shape's graphs the step runs at shape 0 and reports shape 0."""
    prompts = random_prompts(5, seed=8)
    plain = tiny_engine(tiny_llama_dir, spec=False)
    want = outputs(plain, prompts, MAX_TOKENS), outputs(plain, prompts[:2], MAX_TOKENS)
    eng = tiny_engine(tiny_llama_dir, *TREE, ROOT)
    eagle = eng.workers[0].eagle
    eagle.capture_graphs([1, 2])  # 5 requests: no step graph holds them
    eng.schedulers[0].draft_policy = Cycle(2)
    w, seen = eng.workers[0], []
    launch = w.launch

    def spy(plan):
        step = launch(plan)
        if plan.mode == "decode":
            seen.append((len(plan.rows), plan.draft_shape, step.draft_shape))
        return step

    w.launch = spy
    assert (outputs(eng, prompts, MAX_TOKENS), outputs(eng, prompts[:2], MAX_TOKENS)) == want
    asked_big = [ran for n, asked, ran in seen if asked == 1 and n > 2]
    asked_small = [ran for n, asked, ran in seen if asked == 1 and n <= 2]
    assert asked_big and set(asked_big) == {0}  # too big for the smaller shape's graphs
    assert asked_small and set(asked_small) == {1}


def test_policy_picks_the_most_tokens_per_second_and_explores():
    shapes = [(4, 5, 8), (4, 1, 1)]
    # The tree costs 1.5 plain steps at batch 1 and 4 at batch 64.
    policy = DraftPolicy(shapes, [[1.5, 4.0], [1.0, 1.0]], [1, 64])
    assert policy.accept == [6.0, 1.0]  # optimistic: every draft accepted; the root exactly 1
    assert policy.choose(1) == 0 and policy.choose(64) == 0  # 6/4 > 1/1
    for _ in range(60):
        policy.observe(0, [3, 2, 3, 2])  # accepts 2.5 on average
    assert abs(policy.accept[0] - 2.5) < 0.01
    assert policy.choose(1) == 0  # 2.5 / 1.5 > 1
    picks, lost = explorations(policy, 64, 500)  # 2.5 / 4 < 1: the root
    assert picks.count(1) > 490 and picks.count(0) >= 2 and lost <= EXPLORE_SHARE  # the tree, now and then
    policy.observe(1, [5])  # the root alone accepts nothing to learn from
    assert policy.accept[1] == 1.0
    assert policy.choose(65) == 0  # past the graphs: the configured shape
    with pytest.raises(ValueError, match="do not match"):
        DraftPolicy(shapes, [[1.0]], [1, 64])


def test_eager_costs_interpolate_between_sizes_and_hold_past_the_last():
    """Eager costs (no graphs): a batch between two measured sizes costs in between, one
    past the last costs what the last does; no batch falls back to the configured shape."""
    shapes = [(1, 3, 4), (1, 1, 1)]
    # The chain costs 1.1 root steps at batch 1 and 2.5 at batch 32.
    policy = DraftPolicy(shapes, [[1.1, 2.5], [1.0, 1.0]], [1, 32], eager=True)
    for _ in range(200):
        policy.observe(0, [2, 2])  # accepts 2 on average
    assert policy.rates(1) == pytest.approx([2 / 1.1, 1.0], rel=1e-3)
    assert policy.rates(16) == pytest.approx([2 / (1.1 + 15 / 31 * 1.4), 1.0], rel=1e-3)
    assert policy.rates(200) == policy.rates(32)
    assert policy.choose(1) == 0 and policy.choose(8) == 0  # 2 / 1.42 > 1
    assert policy.choose(24) == 1 and policy.choose(200) == 1  # 2 / 2.14 < 1
    padded = DraftPolicy(shapes, [[1.1, 2.5], [1.0, 1.0]], [1, 32])
    assert padded.rates(16) == padded.rates(32) and padded.rates(33) is None  # padded to 32


def test_a_full_batch_judges_a_shape_at_once_a_single_stream_over_a_few_steps():
    """The optimistic start weighs PRIOR requests: one step of 32 requests accepting 1.9
    drops a chain that costs 2.5 root steps at once; at batch 1 one step accepting 1 does
    not drop a chain that costs 1.1 root steps, a run of them does."""
    shapes = [(1, 3, 4), (1, 1, 1)]
    policy = DraftPolicy(shapes, [[1.1, 2.5], [1.0, 1.0]], [1, 32], eager=True)
    assert policy.choose(32) == 0  # tried before judged: 4 / 2.5 > 1
    policy.observe(0, [2] * 29 + [1] * 3)
    assert policy.choose(32) == 1
    policy = DraftPolicy(shapes, [[1.1, 2.5], [1.0, 1.0]], [1, 32], eager=True)
    policy.observe(0, [1])
    assert policy.accept[0] == pytest.approx((4 * PRIOR + 1) / (PRIOR + 1))
    assert policy.choose(1) == 0
    for _ in range(5):
        policy.observe(0, [1])
    assert policy.accept[0] == pytest.approx(2.2)  # (16 + 6) / 10: from here on EMA steps
    for _ in range(30):
        policy.observe(0, [1])
    assert policy.choose(1) == 1


def test_policy_needs_measured_costs(tiny_llama_dir):
    shapes = tiny_config(tiny_llama_dir, *TREE, ROOT).draft.shapes()
    assert DraftPolicy.from_worker(shapes, {"draft_step_costs": None}) is None
    assert DraftPolicy.from_worker(shapes, {"draft_step_costs": [[1.0]]}) is None  # one shape
    p = DraftPolicy.from_worker(shapes, {"draft_step_costs": [[1.0], [0.5]], "graph_batch_sizes": [8]})
    assert p.shapes == shapes[:2] and not p.eager


@pytest.mark.parametrize("overrides", [(), (SHAPES3,)], ids=["root_only", "three_shapes"])
def test_cpu_rank_times_its_shapes_eagerly(tiny_llama_dir, overrides):
    """Without graphs the rank times every shape's eager iteration at powers of two up to
    the running limit (8 here), and the scheduler's policy reads those costs."""
    eng = tiny_engine(tiny_llama_dir, *TREE, ROOT, EAGER, *overrides)
    info = eng.workers[0].info()
    assert info["graph_batch_sizes"] is None and info["eager_draft_cost_sizes"] == [1, 2, 4, 8]
    costs = info["draft_step_costs"]
    assert len(costs) == len(eng.workers[0].eagle.shapes) == (3 if overrides else 2)
    assert all(len(c) == 4 and min(c) > 0 for c in costs)
    policy = eng.schedulers[0].draft_policy
    assert isinstance(policy, DraftPolicy) and policy.eager and policy.costs == costs
    assert policy.sizes == [1, 2, 4, 8]
    # adaptive_shapes=[]: one shape, nothing to time or choose; without eager_shapes the
    # shapes are not timed either, and every step drafts the configured shape
    for off in ((), (ROOT,)):
        eng = tiny_engine(tiny_llama_dir, *TREE, *off, *((EAGER,) if not off else ()))
        assert eng.workers[0].info()["draft_step_costs"] is None
        assert eng.schedulers[0].draft_policy is None


@pytest.mark.parametrize("value,fits", [("[[1,1]]", True), ("[[2,3],[1,1]]", True), ("[]", True),
                                        ("[[9,3]]", False), ("[[3,4]]", False), ("[[1,9]]", False),
                                        ("[[0,1]]", False)])
def test_adaptive_shapes_must_be_smaller_trees(value, fits):
    base = ["draft.enabled=true", "draft.topk=1", "draft.num_steps=3", "draft.num_draft_tokens=4"]
    if fits:
        assert len(load_config(overrides=base + [f"draft.adaptive_shapes={value}"]).draft.shapes()) \
            == 1 + value.count("[[") + value.count("],[")
    else:
        with pytest.raises(ConfigError, match="adaptive_shapes|exceeds"):
            load_config(overrides=base + [f"draft.adaptive_shapes={value}"])


def test_metrics_export_steps_per_shape():
    m = ServerMetrics("m")
    policy = DraftPolicy([(4, 5, 8), (4, 1, 1)], [[1.5], [1.0]], [1], plain_costs=[0.9], periods=True)
    policy.observe(0, [3])
    policy.observe_period(PLAIN_STEP, 1, 1.25)  # the scheduler reports a plain step so
    assert set(policy.estimates()) == {"k4s5n8"}  # the shapes that learn
    assert policy.periods_measured() == [("plain", 1, 1.25)]  # the shapes measured
    m.update_engine({"replica": "r", "running": 0, "waiting": 0, "kv": [],
                     "draft_shape_steps": {shape_name((4, 5, 8)): 7, shape_name((4, 1, 1)): 2},
                     "draft_accept": [{"rank": 0, "shape": s, "value": v} for s, v in policy.estimates().items()],
                     "draft_period": [{"rank": 0, "shape": s, "batch": b, "value": v}
                                      for s, b, v in policy.periods_measured()]})
    text = m.render()[0].decode()
    want = policy.accept[0]
    assert f'kestrel_engine_draft_accept_estimate{{model="m",rank="0",replica="r",shape="k4s5n8"}} {want}' in text
    assert 'kestrel_engine_draft_shape_steps_total{model="m",replica="r",shape="k4s5n8"} 7.0' in text
    assert 'shape="k4s1n1"} 2.0' in text
    period = 'kestrel_engine_draft_step_period_seconds{batch="1",model="m",rank="0",replica="r",shape="plain"} 1.25'
    assert period in text
    from benchmarks.http_client import parse_metrics, server_side
    after = parse_metrics(text)  # as the benchmark client reads /metrics
    assert after["kestrel_engine_draft_step_period_seconds:plain@1"] == 1.25
    after["kestrel_engine_steps_total:decode"] = 1
    assert server_side({}, after, 1.0)["draft_period_ms"] == {"plain@1": 1250.0}


def test_penalties_and_logprobs_at_eager_shapes_equal_plain(tiny_llama_dir, monkeypatch):
    """Processing and logprobs on the eager path at every shape in turn: the configured
    tree with an oracle draft (long accepts, each node processed with its path's counts),
    the root alone between its steps; tokens and logprobs equal plain decoding's."""
    from test_logprobs_lossless import TOL, run

    from serve_app.engine.request import SamplingParams
    prompts = random_prompts(3, seed=9)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=4, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={5: 1.0})
    plain = run(tiny_engine(tiny_llama_dir, spec=False), prompts, params)
    eng = adaptive_engine(tiny_llama_dir, graphs=False)
    policy = eng.schedulers[0].draft_policy = Cycle(2)
    spec = run(eng, prompts, params, [r.output_ids for r in plain], monkeypatch)
    assert max(max(lengths) for shape, lengths in policy.seen if shape == 0) >= 3  # the oracle's tree
    assert set(eng.shape_steps) == {0, 1}
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        for (lp, ids, lps), (lp2, ids2, lps2) in zip(p.token_logprobs, s.token_logprobs):
            assert ids2 == ids
            assert max(abs(a - b) for a, b in zip([lp, *lps], [lp2, *lps2])) < TOL


def test_a_shape_explored_after_plain_steps_runs_twice_and_learns_again():
    """At one stream a few poor steps can drop the tree's estimate below plain's. Its
    explorations after plain steps then run two steps in a row: the first drafts from the
    stale top-k and teaches nothing, the second is observed, so a tree that accepts well
    again wins back the stream instead of staying under plain steps for good."""
    policy = DraftPolicy([(4, 5, 8)], [[2.0]], [1], plain_costs=[1.2])
    for _ in range(40):
        policy.observe(0, [1])  # a run of rejections: 1 / 2.0 against plain's 1 / 1.2
    assert policy.choose(1) == policy.plain
    picks, stale = [], False
    for _ in range(400):
        pick = policy.choose(1)
        if pick == 0 and not stale:  # the scheduler leaves the stale step out
            policy.observe(0, [3])
        stale = pick == policy.plain
        picks.append(pick)
    first = picks.index(0)
    assert picks[first + 1] == 0  # explored twice in a row
    assert picks[-50:].count(0) == 50  # learned again: the tree for good


def test_a_shape_that_loses_at_its_deepest_accept_is_not_timed_at_larger_sizes():
    """eager_step_costs: a shape costing more than its deepest accept is worth in plain
    steps, at two sizes in a row, is not timed at larger sizes (the CPU's start-up spends
    most of its timing there) and costs infinity there, so the policy neither takes nor
    explores it; a shape that could pay is timed at every size."""
    import time

    from actors.spec.draft_shapes import EAGER_COST_ROUNDS, PlainStep, eager_step_costs

    class Sleeper:
        def __init__(self, steps, nodes, seconds):
            self.S, self.N, self.seconds, self.calls = steps, nodes, seconds, []

        def step_body(self, rows):
            self.calls.append(rows.numel())
            time.sleep(self.seconds)

    class Plain(PlainStep):
        def __init__(self):
            self.calls = []

        def step_body(self, rows):
            self.calls.append(rows.numel())
            time.sleep(0.002)

    dear, cheap, plain = Sleeper(3, 4, 0.02), Sleeper(1, 2, 0.002), Plain()
    sizes = [1, 2, 4, 8]
    costs = eager_step_costs([dear, cheap, plain], sizes, torch.device("cpu"))
    assert dear.calls == [1] * EAGER_COST_ROUNDS + [2] * EAGER_COST_ROUNDS  # 10x plain: out after two
    assert costs[0][2:] == [math.inf, math.inf] and all(c < math.inf for c in costs[0][:2])
    assert cheap.calls == plain.calls == [b for b in sizes for _ in range(EAGER_COST_ROUNDS)]
    policy = DraftPolicy([(1, 3, 4), (1, 1, 2)], costs[:2], sizes, eager=True, plain_costs=costs[2])
    assert {policy.choose(b) for b in (4, 6, 8) for _ in range(200)} <= {1, policy.plain}


def test_a_step_teaches_the_shapes_nested_in_it_and_spares_their_exploration():
    """The 16-node tree's steps report what the 8-node tree of the same draft would have
    accepted: its estimate follows them, and it is never run just to be judged. Different
    steps or the root alone are not nested."""
    shapes = [(4, 5, 16), (4, 5, 8), (4, 1, 1), (4, 3, 4)]
    costs = [[1.78, 7.0], [1.75, 5.0], [1.4, 1.7], [1.6, 3.0]]
    policy = DraftPolicy(shapes, costs, [1, 256])
    assert policy.nested == [[1], [], [], []]
    policy.accept[1] = 5.0  # learnt on an easy prompt; the prompts now are hard
    for _ in range(60):
        policy.observe(0, [3])
        policy.observe_nested(0, [[2]])
    assert abs(policy.accept[1] - 2.0) < 0.01 and policy.seen[1] == 60
    policy.accept[3] = 1.5  # a shorter tree, judged worse: still explored now and then
    picks = [policy.choose(1) for _ in range(1000)]
    assert picks.count(1) == 0  # each pick of the 16-node tree observed it
    assert 0 < picks.count(3) < 100 and picks.count(0) + picks.count(3) == 1000


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "step_graph"])
def test_the_rank_reports_the_nested_trees_accepts_and_the_policy_learns_them(tiny_llama_dir, graphs, monkeypatch):
    """An 8-node tree with the 4-node tree as an adaptive shape: each iteration also reports
    what the 4-node tree of the same draft would have accepted, and the first decode step's
    figures are what an engine whose configured tree has 4 nodes accepts on its first step
    (an oracle draft, the plain answers among decoys, so the two trees accept differently).
    The policy learns the 4-node tree's accept length without running it."""
    from test_c22_greedy_lossless import OracleDraft
    prompts = random_prompts(4, seed=3)
    plain = outputs(tiny_engine(tiny_llama_dir, spec=False), prompts, MAX_TOKENS)
    tree = ("draft.topk=4", "draft.num_steps=5")

    def first_decode(nodes: int, *overrides: str, policy=None):
        eng = tiny_engine(tiny_llama_dir, *tree, f"draft.num_draft_tokens={nodes}", *overrides)
        sched = eng.schedulers[0]
        if policy is not None:
            sched.draft_policy = policy
        eagle = eng.workers[0].eagle
        if graphs:
            eagle.capture_graphs(SIZES)
        reqs = [eng.add_request(p, greedy(MAX_TOKENS)) for p in prompts]
        eng.step()  # the prefill: rows are assigned now
        refs = {0: [], **{r.row: r.prompt_ids + ref for r, ref in zip(reqs, plain)}}  # 0: padded lanes
        oracle = OracleDraft(eagle, refs, 128)
        monkeypatch.setattr(eagle, "_draft", oracle)
        monkeypatch.setattr(eagle, "draft_body", oracle)
        seen, process = [], sched.process_output
        monkeypatch.setattr(sched, "process_output", lambda plan, out: seen.append((plan, out)) or process(plan, out))
        while eng.has_work:
            eng.step()
        assert [r.output_ids for r in reqs] == plain
        plan, out = next((p, o) for p, o in seen if p.mode == "decode")
        assert (eagle.step_graph is not None) == graphs
        return dict(zip(plan.rows, out.tokens)), dict(zip(plan.rows, out.nested_accepts or [])), eng

    small, none, _ = first_decode(4)
    assert none == {}  # no nested shape: nothing reported
    cfg = tiny_config(tiny_llama_dir, *tree, "draft.num_draft_tokens=8", "draft.adaptive_shapes=[[5,4]]")
    policy = DraftPolicy(cfg.draft.shapes(), [[1.0], [9.0]], [8])  # the 8-node tree always pays
    big, nested, eng = first_decode(8, "draft.adaptive_shapes=[[5,4]]", policy=policy)
    assert nested and {row: [len(t)] for row, t in small.items()} == nested
    assert any(len(big[row]) > n for row, (n,) in nested.items())  # the larger tree accepted more
    assert set(eng.shape_steps) == {0} and policy.seen[1] > 0
    assert policy.accept[1] < deepest_accept(5, 4)  # learnt from the reports, not the start


def test_measured_periods_raise_a_shape_whose_steps_outlast_their_replay():
    """At 512 streams the root alone replays in 2.4 ms against the tree's 9.1, and with
    the tree accepting 3.75 the two tie on replay times. Once the root's steps are
    measured 5 ms apart (the host's work per step), the tree wins; a period shorter than
    the replay never lowers a cost, and a pause (a collector's, an idle loop) counts at
    most PERIOD_CLIP times the cost so far. Without periods nothing changes."""
    shapes = [(4, 5, 8), (4, 1, 1)]
    costs = [[1.7e-3, 9.1e-3], [1.4e-3, 2.4e-3]]

    def policy(periods: bool) -> DraftPolicy:
        p = DraftPolicy(shapes, [list(c) for c in costs], [1, 512], periods=periods)
        p.accept[0] = 3.7
        return p

    with_periods, without = policy(True), policy(False)
    for p in (with_periods, without):
        assert p.step_costs(512) == costs_at(costs, 1) and p.choose(512) == 1  # 3.7 / 9.1 < 1 / 2.4
    for p in (with_periods, without):
        for _ in range(50):
            p.observe_period(1, 500, 5e-3)  # padded to 512
            p.observe_period(0, 512, 4e-3)  # shorter than its replay
    assert with_periods.step_costs(512) == pytest.approx([9.1e-3, 5e-3])
    assert with_periods.step_costs(1) == costs_at(costs, 0)  # another size: not measured there
    assert with_periods.choose(512) == 0
    assert without.step_costs(512) == costs_at(costs, 1) and without.periods is None
    with_periods.observe_period(1, 512, 10.0)  # a pause
    assert with_periods.periods[1][1] == pytest.approx(5e-3 + PERIOD_EMA * (PERIOD_CLIP - 1) * 5e-3)
    with_periods.observe_period(1, 513, 1.0)  # past the graphs: no cost to follow
    eager = DraftPolicy(shapes, costs, [1, 512], eager=True, periods=True)
    assert eager.periods is None  # eager costs time whole steps already


def costs_at(costs: list[list[float]], i: int) -> list[float]:
    return [c[i] for c in costs]


def test_the_scheduler_times_each_decode_step_through_the_loop(tiny_llama_dir):
    """Each decode step after the first output reports its shape, its batch and the time
    since the step before it was committed; extend steps report nothing."""
    eng = tiny_engine(tiny_llama_dir, *TREE, ROOT)
    sched = eng.schedulers[0]
    shapes = sched.cfg.draft.shapes()
    sched.draft_policy = DraftPolicy(shapes, [[1.0, 1.0]] * len(shapes), [4, 8], periods=True)
    seen = []
    sched.draft_policy.observe_period = lambda shape, batch, seconds: seen.append((shape, batch, seconds))
    modes = []
    process = sched.process_output
    sched.process_output = lambda plan, out: modes.append(plan.mode) or process(plan, out)
    outputs(eng, random_prompts(3, seed=5), 8)
    decodes = modes.count("decode") - (modes[0] == "decode")
    assert len(seen) == decodes > 0 and modes[0] == "extend"
    assert {b for _, b, _ in seen} <= {1, 2, 3} and all(0 < s < 60 for _, _, s in seen)
    assert {s for s, _, _ in seen} <= set(range(len(shapes)))
