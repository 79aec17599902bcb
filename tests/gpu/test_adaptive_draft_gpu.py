"""Adaptive draft shapes on real CUDA graphs (SmolLM2, fp32, triton): each shape's step
graphs captured in one pool, its step cost measured per batch size, and greedy output
equal to plain decoding whatever shape each step takes; graphs for every batch up to the
running limit, so no step runs eagerly. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
from kestrel_testing import GPU_DRAFT

from serve_app.engine.draft_policy import DraftPolicy

BASE = ["device=cuda", "model.dtype=float32", "attention.backend=triton", "kv_cache.num_slots=65536",
        "scheduler.max_running_requests=12", "draft.path=random", "attention.cuda_graphs=true",
        "attention.plan_stream=true", *GPU_DRAFT]
TREE = ["draft.enabled=true", "draft.topk=4", "draft.num_steps=5", "draft.num_draft_tokens=8",
        "draft.adaptive_shapes=[[2,3],[1,1]]"]
MAX = 40


class Cycle(DraftPolicy):
    def __init__(self, n: int):
        self.n, self.i, self.seen = n, 0, []

    def choose(self, batch: int) -> int:
        self.i += 1
        return self.i % self.n

    def observe(self, shape: int, accept_lengths: list[int]) -> None:
        self.seen.append((shape, list(accept_lengths)))


def engine(tokenizer, *overrides, shipped_head: bool = False):
    """An engine on BASE; `shipped_head`: SmolLM2's own head instead of a random draft, where
    a test needs drafts that are accepted."""
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    base = [o for o in BASE if not (shipped_head and o == "draft.path=random")]
    return LLMEngine(load_config(overrides=base + list(overrides)), tokenizer=tokenizer)


def generate(eng, prompts, **sampling):
    from serve_app.engine.request import SamplingParams
    return [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=MAX, ignore_eos=True, **sampling))]


@pytest.fixture(scope="module")
def adaptive(tokenizer):
    return engine(tokenizer, *TREE)


def test_costs_measured_for_every_shape_and_size(adaptive):
    w = adaptive.workers[0]
    info = w.info()
    sizes = info["graph_batch_sizes"]
    assert sizes == [1, 2, 4, 8, 12]  # graph_sizes_up_to(12): every batch the scheduler forms
    costs = info["draft_step_costs"]
    assert len(costs) == 3 and all(len(c) == len(sizes) for c in costs)
    assert all(c > 0 for shape in costs for c in shape)
    assert all(costs[2][i] < costs[0][i] for i in range(len(sizes)))  # the root alone is cheaper
    assert isinstance(adaptive.schedulers[0].draft_policy, DraftPolicy)


def test_the_policy_measures_its_shapes_step_periods(tokenizer, chat_prompts):
    """draft.measured_periods on real graphs: the shapes that ran at a size get a measured
    period there, none shorter than a fraction of its replay (the loop cannot outrun
    the GPU), and the policy weighs the larger of the two."""
    eng = engine(tokenizer, *TREE)
    policy = eng.schedulers[0].draft_policy
    generate(eng, chat_prompts[:8])
    measured = policy.periods_measured()
    assert measured and {shape for shape, _, _ in measured} <= {"k4s5n8", "k4s2n3", "k4s1n1"}
    for s, row in enumerate(policy.periods):
        for i, period in enumerate(row):
            assert period == 0 or period > 0.5 * policy.costs[s][i]
    batch = max(size for _, size, _ in measured)
    i = policy.sizes.index(batch)
    assert policy.step_costs(batch) == [max(c[i], p[i]) for c, p in zip(policy.costs, policy.periods)]


@pytest.mark.parametrize("n", [1, 5, 12])
def test_greedy_output_is_plain_under_cycled_shapes(tokenizer, chat_prompts, adaptive, n):
    want = generate(engine(tokenizer, "draft.enabled=false"), chat_prompts[:n])
    adaptive.schedulers[0].draft_policy = Cycle(3)
    adaptive.shape_steps.clear()
    adaptive.eager_steps.clear()
    got = generate(adaptive, chat_prompts[:n])
    # fp32: only a draft near-tie could flip a token, and it cannot change the target's choice
    assert got == want
    assert set(adaptive.shape_steps) == {0, 1, 2} and not adaptive.eager_steps


def test_sampled_and_logprobs_steps_replay_at_smaller_shapes(chat_prompts, adaptive):
    adaptive.schedulers[0].draft_policy = Cycle(3)
    adaptive.eager_steps.clear()
    outs = generate(adaptive, chat_prompts[:6], temperature=0.8, top_p=0.9, seed=1, logprobs=2)
    assert all(len(o) == MAX for o in outs) and not adaptive.eager_steps
    torch.cuda.synchronize()


def test_plain_steps_cost_less_than_the_root_and_keep_greedy_output(tokenizer, chat_prompts):
    """draft.plain_steps on real graphs: the plain step's cost (the decode graph's replay and
    the draft's KV write) is below the root-only shape's (which runs the draft), plain steps
    between the shapes leave greedy output as plain decoding's, without an eager step, and
    the drafts after them are still accepted though the draft's slots held noise."""
    import torch
    from actors.protocol.step_plan import PLAIN_STEP
    eng = engine(tokenizer, *TREE, "draft.plain_steps=true", shipped_head=True)
    info = eng.workers[0].info()
    plain, root = info["plain_step_costs"], info["draft_step_costs"][2]
    assert len(plain) == len(info["graph_batch_sizes"]) and all(p < r for p, r in zip(plain, root))
    assert eng.schedulers[0].draft_policy.plain == 3
    want = generate(engine(tokenizer, "draft.enabled=false"), chat_prompts[:5])
    policy = eng.schedulers[0].draft_policy = Cycle(4)
    policy.plain = 3
    eng.schedulers[0].cache.reset()  # the prompts' KV is computed again, over the noise
    for buf in (eng.workers[0].eagle.kv_pool.k_all, eng.workers[0].eagle.kv_pool.v_all):
        buf.copy_(torch.randn_like(buf, dtype=torch.float32) * 4)  # what reused slots hold
    assert generate(eng, chat_prompts[:5]) == want
    assert set(eng.shape_steps) == {0, 1, 2, PLAIN_STEP} and not eng.eager_steps
    # The (2, 3) shape runs two steps after each plain one (the tree, right after it,
    # drafts from the stale top-k and is not observed); without the KV write ~1.0.
    lengths = [n for shape, seen in policy.seen if shape == 1 for n in seen]
    assert sum(lengths) / len(lengths) > 1.3, policy.seen


def test_each_step_reports_what_the_nested_tree_would_have_accepted(tokenizer, chat_prompts):
    """The h200 preset's shapes (16 nodes, the 8-node tree of the same draft nested in it,
    the root) on real step graphs with the shipped head, every step at 16 nodes: each
    reports the 8-node tree's accept length per request, and on the first decode step that
    is what an engine whose configured tree has 8 nodes accepts (fp32: only a draft
    near-tie between the two engines' graphs could differ)."""
    tree = ["draft.enabled=true", "draft.topk=4", "draft.num_steps=5"]

    class Fixed(Cycle):
        def choose(self, batch: int) -> int:
            return 0

        def observe_nested(self, shape: int, accepts: list[list[int]]) -> None:
            self.seen.append(("nested", shape, [a[0] for a in accepts]))

    def decodes(eng):
        sched, seen = eng.schedulers[0], []
        process = sched.process_output
        sched.process_output = lambda plan, out: seen.append((plan, out)) or process(plan, out)
        generate(eng, chat_prompts[:12])
        return [(p, o) for p, o in seen if p.mode == "decode"]

    big = engine(tokenizer, *tree, "draft.num_draft_tokens=16", "draft.adaptive_shapes=[[5,8],[1,1]]",
                 shipped_head=True)
    policy = big.schedulers[0].draft_policy = Fixed(3)
    steps = decodes(big)
    assert set(big.shape_steps) == {0} and not big.eager_steps
    pairs = [(a[0], len(t)) for _, o in steps for a, t in zip(o.nested_accepts, o.tokens)]
    assert all(n <= m for n, m in pairs) and any(n < m for n, m in pairs)  # 16 nodes accept more, at times
    assert sum(s[0] == "nested" for s in policy.seen) >= len(steps)
    plan, out = steps[0]  # every row's first decode (the prompts' prefill may take several steps)
    nested = [a[0] for a in out.nested_accepts]
    assert len(nested) == len(plan.rows) > 1
    small_plan, small_out = decodes(engine(tokenizer, *tree, "draft.num_draft_tokens=8",
                                           "draft.adaptive_shapes=[]", shipped_head=True))[0]
    assert small_plan.rows == plan.rows
    differ = sum(n != len(t) for n, t in zip(nested, small_out.tokens))
    assert differ <= 1, (nested, [len(t) for t in small_out.tokens])
