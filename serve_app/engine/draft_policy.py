"""Which draft shape a speculative decode step takes: the one with the most tokens per second.

A step of shape s at batch size b emits about accept(s) tokens per request and costs
cost(s, b) seconds, so it runs at accept(s) / cost(s, b) tokens per request-second. The
rank measured cost(s, b) for every shape and captured size at start-up (the shapes' step
graphs replayed, actors/spec/draft_shapes.py; a batch pads to the next captured size and
past the last one runs at the configured shape). Without graphs (the CPU) the rank timed
the shapes' eager iterations at a few sizes instead: any batch runs at any shape, at a
cost between those of the sizes around it; a shape that lost to plain steps even at its
deepest accept was not timed at larger sizes, and costs infinity there (never taken nor
explored). accept(s) is what this scheduler sees:
a moving average of the accept lengths of the steps that ran at s, starting from the most
the shape can accept (so a shape is tried before it is judged), the root-only shape's
exactly 1. Until a shape has seen a few requests' accept lengths its estimate is their
mean with the optimistic start counted as PRIOR of them: a step of 32 requests judges a
shape at once (a chain that costs several root steps there is dropped after one step,
not a dozen), a single stream over a few steps (one unlucky step does not drop it).

A step also teaches the shapes nested in its own (step_plan.nested_shapes: the same
top-k and steps, fewer nodes): their trees are its best-scored nodes from the same draft,
so the rank reports the accept length each would have given on the same requests
(exactly, for greedy rows). Without it, at one stream, where the prompt decides the accept
length, the 8-node tree kept a figure learnt on an easy prompt through hard ones and took
a third of the steps from the 16-node tree that accepts more on every step.
A shape not chosen is run now and then, so its estimate follows the traffic (the prompts,
not the batch size, decide how much drafts are accepted); a nested shape is run only when
its containing shapes have not been either. Exploring costs the time its
step takes beyond what its tokens are worth at the best shape's rate; a shape is explored
once the steps since it last ran took 1/EXPLORE_SHARE times that, so exploration never
loses more than EXPLORE_SHARE of the step time, at any batch size (a tree at 512 streams
costs five plain steps: explored rarely; a near-best shape: often). Greedy output is the
same at every shape (each one verifies its drafts against the target), so the choice
changes speed only.

A replay time is the GPU's alone. At hundreds of streams a step's host work (planning
its rows, committing and streaming its tokens) can outlast it, most for the cheap shapes:
read from replay times alone, the root-only shape looked as fast as a tree that costs
four times its replay and accepts four times its tokens, and at 512 streams the policy
took it on most steps (docs/benchmarks.md). With draft.measured_periods a shape's cost at
a captured size is also the step loop's time between its steps' outputs there (a moving
average, each sample at most PERIOD_CLIP times the cost so far, so a collector's pause
or an idle loop counts little), and a step costs the larger of the two: the shape whose
tokens come fastest through the whole loop wins. Exploration keeps the periods of shapes
not chosen current, as it does their accept lengths.

With draft.plain_steps the rank also measured a plain decode step's cost, and the policy
may choose it (`plain`, accept exactly 1). A plain step runs no draft forward, but writes
the draft's KV at its tokens' positions (a few small kernels): without that a request
would draft over a gap at its newest position from then on, and accept about 1 token a
step (docs/benchmarks.md). Its top-k stays the last speculative step's, so the first
speculative step after plain ones drafts from a stale state: the scheduler leaves those
requests' accept lengths out of what the policy learns. So a shape explored after plain
steps runs two steps in a row, the second one observed, and its exploration is charged for
both (the first emits about one token at the shape's cost). Explored once, it would never
be observed again: a few poor steps at one stream would leave the policy on plain steps for
good, where the tree is the faster shape.
"""
from __future__ import annotations

import bisect
import math

from actors.protocol.step_plan import PLAIN_STEP, deepest_accept, nested_shapes

EXPLORE_SHARE = 0.02  # the most of the step time exploring may lose
EMA = 0.1  # weight of one step's mean accept length in a shape's estimate
PERIOD_EMA = 0.1  # weight of one step's period in a shape's measured period
PERIOD_CLIP = 3.0  # a period sample counts at most this many times the cost so far
PRIOR = 4  # requests' worth of weight of a shape's optimistic start


PLAIN_NAME = "plain"  # a plain decode step's label in /metrics


def moving_period(period: float, seconds: float, floor: float = 0.0) -> float:
    """A step kind's measured period (0: none yet) after one more sample: a moving average
    (PERIOD_EMA), the sample at most PERIOD_CLIP times the larger of the period so far and
    `floor` (none with neither), so a collector's pause or an idle loop counts little."""
    cap = PERIOD_CLIP * max(period, floor)
    sample = min(seconds, cap) if cap else seconds
    return period + PERIOD_EMA * (sample - period) if period else sample


def shape_name(shape: tuple[int, int, int]) -> str:
    """A shape's label in /metrics: topk, steps, nodes."""
    k, s, n = shape
    return f"k{k}s{s}n{n}"


class DraftPolicy:
    plain: int | None = None  # the index choose() returns for a plain decode step, if any
    periods: list[list[float]] | None = None  # measured step periods (draft.measured_periods)

    def __init__(self, shapes: list[tuple[int, int, int]], costs: list[list[float]], sizes: list[int],
                 eager: bool = False, plain_costs: list[float] | None = None, periods: bool = False):
        """`costs[s][i]`: seconds of a step of shape s at batch sizes[i]; `eager`: measured
        eagerly (a batch between sizes interpolates, past the last takes the last's);
        `plain_costs[i]`: a plain decode step's, making it a choice (draft.plain_steps);
        `periods`: costs also follow the measured time between steps (draft.measured_periods;
        not for eager costs, which time whole steps already)."""
        if plain_costs is not None:
            shapes, costs = [*shapes, (0, 0, 1)], [*costs, plain_costs]  # no draft, the root alone
            self.plain = len(shapes) - 1
        if len(costs) != len(shapes) or any(len(c) != len(sizes) for c in costs):
            raise ValueError(f"step costs {[len(c) for c in costs]} do not match {len(shapes)} "
                             f"shapes at {len(sizes)} batch sizes")
        self.shapes, self.costs, self.sizes, self.eager = shapes, costs, sizes, eager
        self.accept = [float(deepest_accept(s, n)) for _, s, n in shapes]
        self.learns = [n > 1 for _, _, n in shapes]  # the root alone always emits one token
        self.nested = [nested_shapes(shapes, i) for i in range(len(shapes))]  # observed with i
        self.since = [0.0] * len(shapes)  # seconds of steps since each shape last ran
        self.seen = [0] * len(shapes)  # accept lengths observed per shape
        self.last_pick: int | None = None
        self.explore_again: int | None = None  # the second step of an exploration after plain
        # periods[s][i]: measured seconds between outputs of shape s's steps at sizes[i]; 0: none yet
        self.periods = [[0.0] * len(sizes) for _ in shapes] if periods and not eager else None

    @classmethod
    def from_worker(cls, shapes: list[tuple[int, int, int]], info: dict,
                    periods: bool = False) -> "DraftPolicy | None":
        """The policy for a rank whose info() measured its shapes' costs, replayed as graphs
        or eagerly (eager_draft_cost_sizes), else None (one shape and no plain steps, or
        dp_attention: every step takes the configured shape)."""
        costs, plain = info.get("draft_step_costs"), info.get("plain_step_costs")
        if not costs or len(costs) + (plain is not None) < 2:
            return None
        eager = info.get("eager_draft_cost_sizes")
        return cls(shapes[:len(costs)], costs, eager or info["graph_batch_sizes"], eager=bool(eager),
                   plain_costs=plain, periods=periods)

    def step_costs(self, batch: int) -> list[float] | None:
        """Seconds of a step of each shape at `batch`, None past the graphs."""
        i = bisect.bisect_left(self.sizes, batch)
        if i == len(self.sizes) and not self.eager:
            return None
        if self.periods is not None:
            return [max(c[i], p[i]) for c, p in zip(self.costs, self.periods)]
        if not self.eager or i == len(self.sizes) or i == 0 or self.sizes[i] == batch:
            i = min(i, len(self.sizes) - 1)  # eager past the last size: the last's costs
            return [c[i] for c in self.costs]
        t = (batch - self.sizes[i - 1]) / (self.sizes[i] - self.sizes[i - 1])
        return [math.inf if math.inf in (c[i - 1], c[i]) else c[i - 1] + t * (c[i] - c[i - 1])
                for c in self.costs]

    def rates(self, batch: int) -> list[float] | None:
        """Expected tokens per request-second of each shape at `batch`, None past the graphs."""
        costs = self.step_costs(batch)
        return None if costs is None else [a / c for a, c in zip(self.accept, costs)]

    def choose(self, batch: int) -> int:
        costs = self.step_costs(batch)
        if costs is None:
            self.last_pick = self.explore_again = None
            return 0
        rates = [a / c for a, c in zip(self.accept, costs)]
        best = max(range(len(rates)), key=rates.__getitem__)
        after_plain = self.plain is not None and self.last_pick == self.plain
        pick, margin = best, 0.0
        if self.explore_again is not None:
            pick, self.explore_again = self.explore_again, None
        else:
            for i in range(len(rates)):
                if self.learns[i] and i != best:
                    lost = costs[i] * (1 - rates[i] / rates[best])  # seconds exploring i loses
                    if after_plain:  # and a stale step first: about one token at i's cost
                        lost += max(0.0, costs[i] - 1 / rates[best])
                    if EXPLORE_SHARE * self.since[i] - lost > margin:
                        pick, margin = i, EXPLORE_SHARE * self.since[i] - lost
            if pick != best and after_plain:
                self.explore_again = pick
        for i in range(len(self.since)):  # shapes nested in the pick are observed with it
            self.since[i] = 0.0 if i == pick or i in self.nested[pick] else self.since[i] + costs[pick]
        self.last_pick = pick
        return pick

    def estimates(self) -> dict[str, float]:
        """Shape label -> the accept length the policy expects of it, for each shape that
        learns one (/metrics)."""
        return {shape_name(s): a for s, a, learns in zip(self.shapes, self.accept, self.learns) if learns}

    def periods_measured(self) -> list[tuple[str, int, float]]:
        """(shape label, batch size, seconds) of every measured period (/metrics)."""
        return [(PLAIN_NAME if s == self.plain else shape_name(self.shapes[s]), size, p)
                for s, row in enumerate(self.periods or []) for size, p in zip(self.sizes, row) if p]

    def observe_nested(self, shape: int, accepts: list[list[int]]) -> None:
        """A step at `shape` reported, per request, the accept length of each shape nested
        in it (StepOutput.nested_accepts, in nested_shapes' order): learnt as if they ran."""
        for col, j in enumerate(self.nested[shape]):
            self.observe(j, [a[col] for a in accepts])

    def observe_period(self, shape: int, batch: int, seconds: float) -> None:
        """A step of `shape` (an index of self.shapes; PLAIN_STEP: a plain one) at `batch`
        came `seconds` after the step before it finished (draft.measured_periods; else
        nothing to do)."""
        if shape == PLAIN_STEP:
            shape = self.plain
        if self.periods is None or shape is None:
            return
        i = bisect.bisect_left(self.sizes, batch)
        if i == len(self.sizes):
            return
        p = self.periods[shape]
        p[i] = moving_period(p[i], seconds, self.costs[shape][i])

    def observe(self, shape: int, accept_lengths: list[int]) -> None:
        """A step that ran at `shape` (PLAIN_STEP: a plain one) emitted these accept lengths
        (one per request that did not draft from a stale state)."""
        if shape == PLAIN_STEP or not self.learns[shape] or not accept_lengths:
            return
        n = len(accept_lengths)
        self.seen[shape] += n
        weight = max(EMA, n / (PRIOR + self.seen[shape]))  # a running mean until EMA's
        self.accept[shape] += weight * (sum(accept_lengths) / n - self.accept[shape])

